"""Run bodies for tests/test_device_parity.py and tests/test_device_multirank.py: the suite's own
models, data and configs (engine_cases, zero3_cases, compile_cases, inference_cases), with every
tensor placed on the device under test.

The CPU-only helpers they mirror (``engine_cases.reference_run`` / ``engine_run``) build their data
on the CPU and add losses into CPU tensors; these take a ``device`` and move the batches there, and
bring results back as float32 CPU tensors so that runs on different devices compare directly.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import engine_cases
from device_util import to_cpu


def zero_config(stage: int, gas: int = 2, precision: str = "fp32", clip: float = 1.0,
                offload: str | None = None, nvme_root: str | None = None, **fp16) -> dict:
    """``engine_cases.config`` (TinyNet, 64-element buckets); stage 3 shards every parameter; ``offload``:
    ``"cpu"`` / ``"nvme"`` (optimizer) or ``"param"`` (stage 3: parameters and optimizer in host memory)."""
    cfg = engine_cases.config(stage, gas, precision, clip)
    zcfg = cfg["zero_optimization"]
    if stage == 3:
        zcfg.update(stage3_param_persistence_threshold=0, stage3_collective_timeout_s=60)
    if offload in ("cpu", "nvme"):
        zcfg["offload_optimizer"] = {"device": offload, **({"nvme_path": nvme_root} if offload == "nvme" else {})}
    elif offload == "param":
        zcfg["offload_optimizer"] = {"device": "cpu"}
        zcfg["offload_param"] = {"device": "cpu"}
    elif offload is not None:
        raise ValueError(offload)
    if fp16:
        cfg["fp16"].update(fp16)
    return cfg


def reference_run(device: torch.device, gas: int, clip: float = 1.0,
                  steps: int = engine_cases.STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``engine_cases.reference_run`` on ``device``: plain PyTorch, the for-loop AdamW."""
    model = engine_cases.make_model().to(device)
    opt = torch.optim.AdamW(engine_cases.param_groups(model), lr=0.05, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    losses = []
    for step in range(steps):
        x, y = engine_cases.global_batch(step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(gas), y.chunk(gas)):
            loss = model(xm.to(device), ym.to(device)) / gas
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, to_cpu(dict(model.named_parameters()))


def engine_train(cfg: dict, steps: int = engine_cases.STEPS) -> dict:
    """Train TinyNet with zerospeed on this rank's slice of each global batch, on the engine's device;
    losses averaged over ranks, consolidated weights (rank 0), where the parameters lived, loss scale."""
    import zerospeed

    model = engine_cases.make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=engine_cases.param_groups(model), config=cfg)
    device = engine.device
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    losses, scales, after_first = [], [], None
    param_devices = set()
    for step in range(steps):
        x, y = engine_cases.global_batch(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        total = torch.zeros((), device=device)
        for xm, ym in zip(xs.chunk(gas), ys.chunk(gas)):
            loss = engine(xm.to(device), ym.to(device))
            param_devices |= {p.device.type for p in engine.module.parameters()}
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        dist.all_reduce(total)
        losses.append(total.item() / world)
        scales.append(float(engine.loss_scale))
        if step == 0:
            after_first = to_cpu(engine.consolidated_state_dict())
    weights = to_cpu(engine.consolidated_state_dict())
    out = {"losses": losses, "weights": weights, "after_first": after_first, "device": str(device),
           "param_devices": sorted(param_devices), "skipped_steps": engine.skipped_steps,
           "loss_scales": scales, "global_steps": engine.global_steps}
    engine.destroy()
    return out


def rel_losses(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# -- compile ------------------------------------------------------------------------------------


def compile_train(stage: int, backend: str | None, deepcompile: bool = False, steps: int = 3) -> dict:
    """``compile_cases.train`` on the engine's device: the tiny GPT at ``stage``, eager (``backend`` None),
    ``engine.compile(backend=...)``, or DeepCompile (``compile.deepcompile: true``)."""
    import torch._dynamo

    import zerospeed
    from compile_cases import TINY, batch, config
    from gpt_cases import GPT

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(TINY)
    cfg = config(stage)
    if deepcompile:
        cfg["compile"] = {"deepcompile": True}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if backend is not None:
        engine.compile(backend=backend)
    device = engine.device
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = engine(x.to(device), targets=y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses, "weights": to_cpu(engine.consolidated_state_dict()),
           "report": engine.compile_report() if backend is not None else None, "device": str(device)}
    engine.destroy()
    return out


# -- inference ----------------------------------------------------------------------------------


def teacher_forced_margins(model, prompt: list[int], tokens: list[int], device: torch.device) -> list[float]:
    """For each generated token, how far its logit is below the best logit of HF's forward over the
    prompt and the tokens before it (0 where it is the argmax)."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return (logits.max(dim=1).values - chosen).tolist()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, device: torch.device) -> list[int]:
    """``inference_cases.hf_greedy`` with the ids on ``device``."""
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


# -- two ranks on one device (tests/test_device_multirank.py) --------------------------------------


def multirank_train(device: str, stage: int) -> dict:
    """One rank of a gloo world: ``DS_ACCELERATOR=cuda`` puts the model and every collective's tensors
    on the GPU (``comm.device_for_backend``); gloo carries CUDA tensors for all-reduce and broadcast,
    which is all zerospeed's gloo path uses for reduce-scatter and all-gather."""
    if device == "cuda":
        os.environ["DS_ACCELERATOR"] = "cuda"
        from device_util import pin_cuda_numerics

        pin_cuda_numerics()
    out = engine_train(zero_config(stage, gas=2))
    out["backend"] = dist.get_backend()
    return out
