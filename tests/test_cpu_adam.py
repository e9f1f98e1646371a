"""zerospeed.ops.adam.CPUAdam: torch's Adam/AdamW semantics, sub-group pipeline, state dicts."""

from __future__ import annotations

import copy

import pytest
import torch

from zerospeed.ops.adam import (
    AdamHyperParams,
    AdamThreadPool,
    CPUAdam,
    DeepSpeedCPUAdam,
    SubGroup,
    SyncCopies,
    adam_update,
    plan_chunks,
    run_subgroup_pipeline,
)

SHAPES = [(300, 257), (4099,), (7, 3), (1,)]


@pytest.fixture(autouse=True)
def _fused_family(monkeypatch):
    """These tests pin the fused family (they check bit-identity with torch's fused kernel); the
    measured choice and the other families are tested in test_fast_paths_training.py."""
    monkeypatch.setenv("ZEROSPEED_FAST_PATHS", "adam_kernel=fused")
TOL = dict(rtol=1e-6, atol=1e-6)  # fp32 rounding: a few ulps after several steps of lr 1e-2


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _run(make_opt, steps=5, dtype=torch.float32, skip=None):
    params = [p.requires_grad_() for p in _params(dtype=dtype)]
    opt = make_opt(params)
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(step, dtype))):
            p.grad = None if i == skip else g
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_matches_torch(adamw_mode, weight_decay, amsgrad):
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, amsgrad=amsgrad)
    ours, _ = _run(lambda ps: CPUAdam(ps, adamw_mode=adamw_mode, chunk_numel=5000, **kw))
    fused, _ = _run(lambda ps: torch_cls(ps, fused=True, **kw))
    default, _ = _run(lambda ps: torch_cls(ps, **kw))
    for a, b, c in zip(ours, fused, default):
        assert torch.equal(a, b)  # same kernel: bit-identical to torch's fused optimizer
        torch.testing.assert_close(a, c, **TOL)


def test_maximize_param_groups_and_missing_grads():
    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.1}]

    ours, opt = _run(lambda ps: CPUAdam(groups(ps), lr=1e-2, maximize=True), skip=3)
    ref, _ = _run(lambda ps: torch.optim.AdamW(groups(ps), lr=1e-2, maximize=True, weight_decay=0.0), skip=3)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.equal(ours[3], _params()[3])  # no grad: untouched, no state
    assert len(opt.state) == 3


def test_bias_correction_off_matches_formula():
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.01
    ours, _ = _run(lambda ps: CPUAdam(ps, lr=lr, bias_correction=False, weight_decay=wd), steps=4)
    for i, p0 in enumerate(_params()):
        p, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
        for step in range(4):
            g = _grads(step)[i].double()
            p = p * (1 - lr * wd)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - lr * m / (v.sqrt() + eps)
        torch.testing.assert_close(ours[i], p.float(), **TOL)


def test_threads_and_chunk_sizes_do_not_change_results():
    results = []
    for threads, chunk in [(1, 1 << 20), (2, 1000), (3, 4096), (2, 1)]:
        out, _ = _run(lambda ps: CPUAdam(ps, lr=1e-2, num_threads=threads, chunk_numel=chunk,
                                         sub_group_size=50_000), steps=3)
        results.append(out)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_low_precision_params_with_fp32_states():
    ours, opt = _run(lambda ps: CPUAdam(ps, lr=1e-2), steps=3, dtype=torch.bfloat16)
    state = opt.state[next(iter(opt.state))]
    assert state["exp_avg"].dtype == torch.float32
    # reference: each step upcasts the bf16 param, updates in fp32 states, rounds back
    for i, p0 in enumerate(_params(dtype=torch.bfloat16)):
        p, m, v = p0.clone(), torch.zeros(p0.shape), torch.zeros(p0.shape)
        for step in range(3):
            p32, g32 = p.float(), _grads(step, torch.bfloat16)[i].float()
            torch._fused_adamw_([p32], [g32], [m], [v], [], [torch.tensor(step + 1.0)], lr=1e-2,
                                beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                                maximize=False)
            p = p32.to(torch.bfloat16)
        assert torch.equal(ours[i], p)
    same, opt = _run(lambda ps: CPUAdam(ps, lr=1e-2, fp32_optimizer_states=False), steps=3,
                     dtype=torch.bfloat16)
    ref, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0, fused=True), steps=3,
                  dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(same, ref))
    assert opt.state[next(iter(opt.state))]["exp_avg"].dtype == torch.bfloat16


def test_state_dict_round_trip_and_torch_interop():
    kw = dict(lr=1e-2, weight_decay=0.01)
    params = [p.requires_grad_() for p in _params()]
    opt = CPUAdam(params, **kw)
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as after torch.save/load: no tensors shared
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["step"].item() == 3.0
    # torch's AdamW loads it and continues exactly like CPUAdam does
    twin = [p.detach().clone().requires_grad_() for p in params]
    torch_opt = torch.optim.AdamW(twin, fused=True, **kw)
    torch_opt.load_state_dict(sd)
    # and a fresh CPUAdam loads torch's state_dict back (groups lack adamw_mode etc.)
    third = [p.detach().clone().requires_grad_() for p in params]
    back = CPUAdam(third, lr=0.5)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert back.param_groups[0]["adamw_mode"] is True and back.param_groups[0]["lr"] == 1e-2
    for step in range(3, 5):
        for ps in (params, twin, third):
            for p, g in zip(ps, _grads(step)):
                p.grad = g
        opt.step()
        torch_opt.step()
        back.step()
    for a, b, c in zip(params, twin, third):
        assert torch.equal(a, c)
        torch.testing.assert_close(a, b, **TOL)  # torch's loaded group lost fused=True


def test_state_dict_keeps_fp32_states_of_bf16_params():
    """torch's load_state_dict casts states to the param dtype; CPUAdam keeps them fp32."""
    _, opt = _run(lambda ps: CPUAdam(ps, lr=1e-2), steps=2, dtype=torch.bfloat16)
    sd = copy.deepcopy(opt.state_dict())
    fresh = CPUAdam([p.detach().clone().requires_grad_() for p in _params(dtype=torch.bfloat16)], lr=1e-2)
    fresh.load_state_dict(sd)
    for i, p in enumerate(fresh.param_groups[0]["params"]):
        state = fresh.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(state["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])


def test_step_subgroup_deepspeed_style():
    """ZeRO-3 puts one flat partition in the group at a time; state is keyed by sub-group id."""
    flats = [torch.randn(5000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = [f.clone().requires_grad_() for f in flats]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, fused=True)
    holder = torch.zeros(1, requires_grad=True)
    opt = DeepSpeedCPUAdam([holder], lr=1e-2)
    assert opt.adam_w_mode
    for step in range(3):
        grads = [torch.randn(5000, generator=torch.Generator().manual_seed(100 + step * 3 + i))
                 for i in range(3)]
        for i, (f, g) in enumerate(zip(flats, grads)):
            f.grad = g
            opt.param_groups[0]["params"] = [f]
            opt.step_subgroup(i)
        for r, g in zip(ref, grads):
            r.grad = g
        ref_opt.step()
    assert sorted(opt.state) == [0, 1, 2] and opt.state[2]["step"].item() == 3.0
    assert all(torch.equal(f, r) for f, r in zip(flats, ref))


def _flat_setup(numel=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g), [torch.randn(numel, generator=g) for _ in range(3)]


@pytest.mark.parametrize("bounds", [[0, 12_032, 30_016, 30_080, 50_000], [0, 12_000, 30_001, 30_002, 50_000]])
def test_subgroup_pipeline_equals_one_shot_with_device_copies(bounds):
    """Bit-identical when sub-group boundaries are multiples of 64 elements, else within rounding."""
    numel = 50_000
    exact = all(b % 64 == 0 for b in bounds[:-1])
    param0, grads = _flat_setup(numel)
    # one shot over the whole flat buffer
    p, m, v, step = param0.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    hp = AdamHyperParams(lr=1e-2, weight_decay=0.01)
    for g in grads:
        step += 1
        adam_update([(p, g, m, v, None, step)], hp)
    # pipeline: host master + moments as sub-group views; "device" grads and bf16 "device" params
    master, hm, hv, hgrad = param0.clone(), torch.zeros(numel), torch.zeros(numel), torch.empty(numel)
    device_param = param0.to(torch.bfloat16)
    steps = [torch.zeros(()) for _ in bounds[1:]]
    opt = CPUAdam([torch.zeros(1, requires_grad=True)], lr=1e-2, weight_decay=0.01)
    for g in grads:
        device_grad = g.clone()
        subgroups = [SubGroup(master[a:b], hgrad[a:b], hm[a:b], hv[a:b], steps[k],
                              device_grad=device_grad[a:b], device_param=device_param[a:b])
                     for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        opt.step_subgroups(subgroups)
    for got, want in ((master, p), (hm, m), (hv, v)):
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(device_param, master.to(torch.bfloat16))
    assert all(s.item() == len(grads) for s in steps)


def test_pipeline_issues_copies_in_overlap_order():
    log = []

    class Recording(SyncCopies):
        def start_d2h(self, i):
            log.append(f"d2h{i}")
            super().start_d2h(i)

        def start_h2d(self, i):
            log.append(f"h2d{i}")
            super().start_h2d(i)

        def finish(self):
            log.append("finish")

    sgs = [SubGroup.allocate(10) for _ in range(3)]
    run_subgroup_pipeline(sgs, lambda sg: log.append(f"upd{sgs.index(sg)}"), Recording(sgs))
    assert log == ["d2h0", "d2h1", "upd0", "h2d0", "d2h2", "upd1", "h2d1", "upd2", "h2d2", "finish"]


def test_subgroup_validation_and_errors():
    sg = SubGroup.allocate(10)
    sg.grad = torch.zeros(11)
    with pytest.raises(ValueError, match="sub-group 0: grad has 11 elements"):
        run_subgroup_pipeline([sg], lambda s: None)
    opt = CPUAdam([torch.zeros(1, requires_grad=True)], amsgrad=True)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        opt.step_subgroups([SubGroup.allocate(4)])
    meta = torch.zeros(3, device="meta", requires_grad=True)
    meta.grad = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError, match="CPU parameters"):
        CPUAdam([meta]).step()
    for bad in (dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1.0), dict(weight_decay=-0.1),
                dict(sub_group_size=0), dict(num_threads=0)):
        with pytest.raises(ValueError):
            CPUAdam([torch.zeros(1, requires_grad=True)], **bad)
    with pytest.raises(TypeError):  # keyword-only after lr: torch and DeepSpeed orders differ
        CPUAdam([torch.zeros(1, requires_grad=True)], 1e-3, (0.9, 0.99))


def test_plan_chunks_splits_big_and_batches_small():
    step = torch.zeros(())
    big = [torch.zeros(2500) for _ in range(4)] + [None, step]
    small = [[torch.zeros(10) for _ in range(4)] + [None, step] for _ in range(5)]
    tasks = plan_chunks([tuple(big), *map(tuple, small)], chunk_numel=1000)  # -> 1024 (64-aligned)
    assert [sum(it[0].numel() for it in t) for t in tasks] == [1024, 1024, 452, 50]
    assert tasks[1][0][0].data_ptr() == big[0].data_ptr() + 1024 * 4  # views, not copies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_pipeline_matches_cpu():  # pragma: no cover - no GPU on the dev machine
    numel, bounds = 40_000, [0, 10_000, 25_000, 40_000]
    param0, grads = _flat_setup(numel, seed=3)
    results = []
    for device in ("cpu", "cuda"):
        master, hm, hv = param0.clone(), torch.zeros(numel), torch.zeros(numel)
        hgrad = torch.empty(numel, pin_memory=device == "cuda")
        dev_param = param0.to(device, torch.bfloat16)
        steps = [torch.zeros(()) for _ in bounds[1:]]
        opt = CPUAdam([torch.zeros(1, requires_grad=True)], lr=1e-2)
        for g in grads:
            dg = g.to(device)
            opt.step_subgroups([SubGroup(master[a:b], hgrad[a:b], hm[a:b], hv[a:b], steps[k],
                                         device_grad=dg[a:b], device_param=dev_param[a:b])
                                for k, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        results.append((master, dev_param.cpu()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_shared_pool_restores_thread_count():
    before = torch.get_num_threads()
    pool = AdamThreadPool(2)
    assert torch.get_num_threads() == before
    pool.shutdown()
