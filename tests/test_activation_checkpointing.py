"""Activation checkpointing (zerospeed.checkpointing): losses, gradient norms and weights equal to
no checkpointing at ZeRO stages 0-3 (full, host-offloaded and selective), in the pipeline, with
activations partitioned over tensor-parallel ranks; saved-activation bytes on the GPT at seq 512;
the RNG tracker; the errors of bad configuration.

Tolerance: recomputation repeats the same fp32 kernels on the same inputs with the same RNG
states, so results are compared at 1e-6 relative (observed: bit-identical on CPU).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerospeed.checkpointing as ck
from gpt_cases import GPT, GPTConfig
from pipe_cases import config as pipe_config
from pipe_cases import max_rel_err, pipeline_runs, reference_run
from zerospeed.config import ConfigError, load_config
from zerospeed.testing import run_distributed

TOL = 1e-6
PIPE_GAS = 4
DROPOUT_GPT = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, dropout=0.1)
MODES = {"off": None, "full": {}, "offload": {"cpu_checkpointing": True},
         "selective": {"selective_policy": "save_matmuls"}}


@pytest.fixture(autouse=True)
def _fresh_settings():
    ck.reset()
    yield
    ck.reset()


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# -- parity in the engine at every ZeRO stage ------------------------------------------------------
def _engine_runs(stages, steps=2):
    import zerospeed

    rank = dist.get_rank()
    out = {}
    for stage in stages:
        for mode, section in MODES.items():
            ck.reset()
            torch.manual_seed(0)
            model = GPT(DROPOUT_GPT)
            if section is not None:
                model.checkpoint_fn = ck.checkpoint
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000}}
            if section:
                cfg["activation_checkpointing"] = section
            engine, *_ = zerospeed.initialize(model=model, config=cfg)
            losses, norms = [], []
            for step in range(steps):
                for micro in range(2):
                    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
                    x = torch.randint(0, 64, (2, 16), generator=g)
                    torch.manual_seed(7 + 100 * step + 10 * micro + rank)  # the dropout masks
                    loss = engine(x, x.roll(-1, 1))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                norms.append(engine.get_global_grad_norm())
            out[(stage, mode)] = {"losses": losses, "norms": norms, "weights": engine.consolidated_state_dict()}
            engine.destroy()
    ck.reset()
    return out


@pytest.mark.timeout(180)
def test_losses_grad_norms_and_weights_equal_no_checkpointing_at_stages_0_to_3():
    results = run_distributed(_engine_runs, 2, [0, 1, 2, 3], timeout=170)
    for rank, runs in enumerate(results):
        for stage in range(4):
            ref = runs[(stage, "off")]
            for mode in ("full", "offload", "selective"):
                got, where = runs[(stage, mode)], f"stage {stage}, {mode}, rank {rank}"
                assert max(_rel(a, b) for a, b in zip(got["losses"], ref["losses"])) < TOL, where
                assert max(_rel(a, b) for a, b in zip(got["norms"], ref["norms"])) < TOL, where
                for name, w in ref["weights"].items():
                    assert (got["weights"][name] - w).abs().max() <= TOL * w.abs().max(), f"{where}: {name}"
    assert results[0][(3, "off")]["weights"]  # rank 0 holds the consolidated weights


# -- pipeline --------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_pipeline_activation_checkpoint_interval_matches_the_reference():
    ref = reference_run(PIPE_GAS, 1)
    cases = [(pipe_config("gpipe", PIPE_GAS, ckpt=1), 2), (pipe_config("zero_bubble", PIPE_GAS, ckpt=2), 2),
             # last: configures host offload for the rest of the process (the reentrant scheme)
             (pipe_config("1f1b", PIPE_GAS, ckpt=1, activation_checkpointing={"cpu_checkpointing": True}), 2)]
    runs = run_distributed(pipeline_runs, 2, cases, timeout=170)
    for rank, per_rank in enumerate(runs):
        for i, r in enumerate(per_rank):
            assert max(_rel(a, b) for a, b in zip(r["losses"], ref["losses"])) < 1e-5, (i, rank)
            assert max_rel_err(r["weights"], ref["weights"]) < 1e-5, (i, rank)


def test_pipeline_module_checkpoints_with_zerospeed_by_default():
    from zerospeed.pipe import LayerSpec, PipelineModule

    module = PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1, activation_checkpoint_interval=1)
    assert module.activation_checkpoint_func is ck.checkpoint


# -- memory --------------------------------------------------------------------------------------
def test_saved_activation_bytes_fall_by_more_than_half_on_the_gpt_at_seq_512():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=512))
    x = torch.randint(0, 256, (1, 512))
    measured = {}
    for mode in ("off", "full", "offload"):
        ck.reset()
        if mode == "offload":
            ck.configure(None, checkpoint_in_cpu=True)
        model.checkpoint_fn = None if mode == "off" else ck.checkpoint
        model.zero_grad()
        with ck.SavedTensorBytes(ignore=model.parameters()) as saved:  # weights are model state
            loss = model(x, x)
        loss.backward()
        measured[mode] = saved.total
    # what a checkpoint must keep: each block's input, (1, 512, 64) fp32 = 128 KiB per block
    block_input = 512 * 64 * 4
    assert measured["full"] <= measured["off"] / 2, measured
    assert measured["offload"] == measured["full"]  # on CPU host offload keeps the same host tensors
    assert measured["off"] > 20 * block_input  # the plain graph saves far more than the block inputs

    # the peak of allocated bytes over forward + backward (torch profiler's memory events) falls too
    def step():
        model(x, x).backward()

    ck.reset()
    model.checkpoint_fn = None
    peak_off = ck.peak_allocated_bytes(step)
    model.checkpoint_fn = ck.checkpoint
    peak_full = ck.peak_allocated_bytes(step)
    ck.configure(None, policy="save_matmuls")
    peak_selective = ck.peak_allocated_bytes(step)
    assert peak_full < 0.6 * peak_off and peak_full < peak_selective < peak_off, (peak_off, peak_full, peak_selective)


# -- tensor-parallel partitioning ---------------------------------------------------------------
class _Replicated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.GELU()) for _ in range(3))

    def forward(self, x, fn=None):
        for layer in self.layers:
            x = layer(x) if fn is None else fn(layer, x)
        return x.square().mean()


def _partition_run():
    from zerospeed import comm
    from zerospeed.comm.mesh import build_mesh, reset_mesh

    mesh = build_mesh(tp=2)
    torch.manual_seed(0)
    model = _Replicated()
    x = torch.randn(5, 7, 24).requires_grad_()  # replicated over the TP group, as between TP layers
    out = {}
    for mode in ("off", "checkpoint", "partitioned"):
        ck.reset()
        if mode == "partitioned":
            ck.configure(None, partition_activations=True, checkpoint_in_cpu=False)
        model.zero_grad()
        x.grad = None
        with ck.SavedTensorBytes() as saved:
            loss = model(x, None if mode == "off" else ck.checkpoint)
        before = comm.COUNTER.snapshot().get("all_gather", {}).get("count", 0)
        loss.backward()
        gathers = comm.COUNTER.snapshot().get("all_gather", {}).get("count", 0) - before
        out[mode] = {"loss": loss.item(), "grads": [p.grad.clone() for p in model.parameters()],
                     "x_grad": x.grad.clone(), "saved": saved.total, "gathers": gathers}
    out["tp"] = (mesh.get_model_parallel_world_size(), mesh.get_model_parallel_rank())
    reset_mesh()
    return out


@pytest.mark.timeout(120)
def test_partition_activations_splits_saved_inputs_over_tp_ranks():
    for r in run_distributed(_partition_run, 2):
        assert r["tp"][0] == 2
        ref = r["off"]
        for mode in ("checkpoint", "partitioned"):
            assert r[mode]["loss"] == ref["loss"]
            assert torch.allclose(r[mode]["x_grad"], ref["x_grad"], rtol=TOL, atol=0)
            for g, h in zip(r[mode]["grads"], ref["grads"]):
                assert torch.allclose(g, h, rtol=TOL, atol=1e-9)
        input_bytes = 5 * 7 * 24 * 4
        # three block inputs kept whole, plus the input of the loss's square (saved by autograd)
        assert r["checkpoint"]["saved"] == 4 * input_bytes
        assert r["partitioned"]["saved"] == 3 * input_bytes // 2 + input_bytes  # half of each block input per rank
        assert r["partitioned"]["gathers"] == 3 and r["checkpoint"]["gathers"] == 0


def test_partitioning_without_a_mesh_is_a_no_op():
    ck.configure(None, partition_activations=True)
    model = _Replicated()
    x = torch.randn(2, 24, requires_grad=True)
    model(x, ck.checkpoint).backward()
    ref = x.grad.clone()
    x.grad = None
    model(x).backward()
    assert torch.allclose(x.grad, ref, rtol=TOL)


# -- RNG tracker ----------------------------------------------------------------------------------
def test_rng_tracker_forks_a_separate_stream_and_recompute_replays_it():
    ck.model_parallel_cuda_manual_seed(123)
    tracker = ck.get_cuda_rng_tracker()
    default_before = torch.rand(4)
    ck.model_parallel_cuda_manual_seed(123)
    with tracker.fork():
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), default_before)  # forking does not advance the default stream
    torch.manual_seed(123 + 2718)
    assert torch.equal(inside, torch.rand(4))  # tp rank 0: seed + 2718
    with pytest.raises(KeyError, match="no state named 'other'"):
        with tracker.fork("other"):
            pass
    with pytest.raises(ValueError, match="seed 5 already exists"):
        tracker.add("a", 5)
        tracker.add("b", 5)

    # dropout under the tracker inside a host-offloaded (reentrant) checkpoint: the recomputation
    # draws the same masks, so gradients equal the plain run's
    ck.configure(None, checkpoint_in_cpu=True)
    w = torch.randn(8, 8, requires_grad=True)

    def layer(h):
        with tracker.fork():
            return nn.functional.dropout(h @ w, 0.5)

    x = torch.randn(3, 8, requires_grad=True)
    ck.model_parallel_cuda_manual_seed(7)
    layer(x).sum().backward()
    ref = w.grad.clone()
    w.grad = None
    ck.model_parallel_cuda_manual_seed(7)
    ck.checkpoint(layer, x).sum().backward()
    assert torch.equal(w.grad, ref)


# -- configuration and bad input ------------------------------------------------------------------
def test_configure_reads_the_config_section_and_arguments_override():
    assert not ck.is_configured()
    ck.configure(None, deepspeed_config={"train_batch_size": 1, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}}, checkpoint_in_cpu=False)
    s = ck.settings.current()
    assert ck.is_configured() and s.partition_activations and not s.cpu_checkpointing and s.contiguous_checkpointing
    assert s.num_checkpoints == 4 and s.synchronize and s.profile
    ck.reset()
    assert not ck.is_configured() and not ck.settings.current().partition_activations


def test_engine_config_applies_unless_the_user_configured():
    from zerospeed.checkpointing.settings import configure_from

    with_section = load_config({"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": True}})
    without = load_config({"train_batch_size": 1})
    configure_from(with_section)
    assert ck.is_configured() and ck.settings.current().cpu_checkpointing
    configure_from(without)  # a later engine without the section: back to the defaults
    assert not ck.is_configured() and not ck.settings.current().cpu_checkpointing
    ck.configure(None, partition_activations=True)  # the user's explicit call wins over any engine
    configure_from(with_section)
    configure_from(without)
    s = ck.settings.current()
    assert s.partition_activations and not s.cpu_checkpointing


def test_profile_and_contiguous_run_and_match():
    ck.configure(None, partition_activations=True, contiguous_checkpointing=True, profile=True, synchronize=True)
    ck.reset_profile_stats()
    model = _Replicated()
    x = torch.randn(2, 24, requires_grad=True)
    model(x, lambda layer, h: ck.checkpoint(lambda a, b: layer(a) + b, h, h)).backward()
    stats = ck.profile_stats()
    assert stats["num_forward"] == 3 and stats["num_recompute"] == 3 and stats["recompute_s"] > 0


@pytest.mark.parametrize("call, message", [
    (lambda: ck.configure(None, partition_activations="yes"),
     "activation_checkpointing.partition_activations: 'yes' is not a boolean"),
    (lambda: ck.configure(None, num_checkpoints=0), "activation_checkpointing.number_checkpoints: 0 is not allowed"),
    (lambda: ck.configure(None, contiguous_checkpointing=True),
     "contiguous_memory_optimization: true requires partition_activations: true"),
    (lambda: ck.configure(None, policy="save_everything"), "selective_policy: 'save_everything' is not one of"),
    (lambda: ck.configure(None, policy=["aten.not_an_op"]), "'aten.not_an_op' is not an aten operator"),
    (lambda: ck.configure(None, policy="save_matmuls", checkpoint_in_cpu=True), "cannot be combined"),
    (lambda: ck.configure(object()), "mpu_ must provide get_model_parallel_group()"),
    (lambda: ck.checkpoint(3, torch.ones(1)), "function must be callable, got int"),
])
def test_bad_checkpointing_input_is_one_line(call, message):
    with pytest.raises((ConfigError, TypeError)) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("section, key", [
    ({"partition_activation": True}, "activation_checkpointing.partition_activation"),
    ({"cpu_checkpointing": 1}, "activation_checkpointing.cpu_checkpointing"),
    ({"number_checkpoints": 0}, "activation_checkpointing.number_checkpoints"),
    ({"selective_policy": "all"}, "activation_checkpointing.selective_policy"),
])
def test_bad_activation_checkpointing_keys_give_one_clear_line(section, key):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "activation_checkpointing": section})
    assert str(info.value).startswith(f"zerospeed config: {key}: ") and "\n" not in str(info.value)
