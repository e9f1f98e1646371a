"""Shared model, data and reference run for the pipeline engine tests (imported by the test module
and by the ranks the harness starts).

The model is a tiny MLP as a list of 8 layers: a tied ``embed`` Linear(6, 8) first, six
Linear(8, 8)+tanh blocks, and the tied ``embed`` again last used as the head (``x @ W``: 8 -> 6),
so the tied weight's gradient comes from both ends of the pipeline. Every layer has parameters,
so any partition into up to 8 (virtual) stages is valid. Layers are seeded by index
(``seed_layers=True``); the reference builds them the same way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

DIM_IN, HIDDEN, NUM_BLOCKS = 6, 8, 6
GLOBAL_BATCH = 16
STEPS = 3
BASE_SEED = 1234
LR, BETAS, EPS, CLIP = 0.05, (0.9, 0.99), 1e-8, 0.1
LR_16BIT = 0.005


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def head(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight  # (B, 8) @ (8, 6): the embedding's weight reused as the output layer


def mse(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, labels)


def layer_specs() -> list:
    return ([TiedLayerSpec("embed", nn.Linear, DIM_IN, HIDDEN)]
            + [LayerSpec(Block, HIDDEN) for _ in range(NUM_BLOCKS)]
            + [TiedLayerSpec("embed", nn.Linear, DIM_IN, HIDDEN, forward_fn=head)])


def make_pipeline(num_stages: int, **kwargs) -> PipelineModule:
    kwargs.setdefault("partition_method", "uniform")
    return PipelineModule(layer_specs(), num_stages=num_stages, loss_fn=mse, seed_layers=True,
                          base_seed=BASE_SEED, **kwargs)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, DIM_IN, generator=g), torch.randn(GLOBAL_BATCH, DIM_IN, generator=g)


def micro_batches(step: int, dp_rank: int, num_dp: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's micro-batches of the global batch: replica slice, then ``gas`` pieces."""
    x, y = global_batch(step)
    xs, ys = x.chunk(num_dp)[dp_rank], y.chunk(num_dp)[dp_rank]
    return list(zip(xs.chunk(gas), ys.chunk(gas)))


def config(schedule: str, gas: int, zero: int = 0, virtual: int = 1, ckpt: int = 0, lr: float = LR,
           **extra) -> dict:
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": 0.0}},
           "gradient_clipping": CLIP, "steps_per_print": 0,
           "zero_optimization": {"stage": zero, "reduce_bucket_size": 50, "allgather_bucket_size": 50},
           "pipeline": {"schedule": schedule, "virtual_stages": virtual,
                        "activation_checkpoint_interval": ckpt}}
    cfg.update(extra)
    return cfg


# ---------------------------------------------------------------------------------------------
class Reference(nn.Module):
    """The same layers in one process, parameter names as in PipelineModule."""

    def __init__(self) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        specs = layer_specs()
        for i, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    torch.manual_seed(BASE_SEED + i)
                    self.tied_modules[spec.key] = spec.build()
            else:
                torch.manual_seed(BASE_SEED + i)
                self.add_module(str(i), spec.build())
        self.blocks = [getattr(self, str(i)) for i in range(1, NUM_BLOCKS + 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tied_modules["embed"](x)
        for block in self.blocks:
            h = block(h)
        return head(self.tied_modules["embed"], h)


def reference_run(gas: int, num_dp: int, steps: int = STEPS, eval_step: int | None = None,
                  lr: float = LR) -> dict:
    model = Reference()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        pieces = [mb for d in range(num_dp) for mb in micro_batches(step, d, num_dp, gas)]
        for x, y in pieces:
            loss = mse(model(x), y) / len(pieces)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total)
    out = {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if eval_step is not None:
        with torch.no_grad():
            x, y = global_batch(eval_step)
            out["eval_loss"] = mse(model(x), y).item()
    return out


# ---------------------------------------------------------------------------------------------
def pipeline_run(cfg: dict, num_stages: int, steps: int = STEPS, eval_step: int | None = None) -> dict:
    """Train on this rank; return losses and the weights of this rank's stage(s).

    Tied copies are returned under ``tied/<stage>/<name>``; the copy on the lowest owning stage
    also under its plain name (it is the one compared with the reference's single copy).
    """
    import zerospeed

    model = make_pipeline(num_stages)
    engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
    num_dp = dist.get_world_size() // num_stages
    dp_rank = dist.get_rank() % num_dp
    gas = engine.gradient_accumulation_steps()
    losses, norms = [], []
    for step in range(steps):
        data = iter(micro_batches(step, dp_rank, num_dp, gas))
        needs = engine.is_first_stage() or engine.is_last_stage()
        losses.append(float(engine.train_batch(data if needs else None)))
        norms.append(engine.get_global_grad_norm())
    weights: dict[str, torch.Tensor] = {}
    for stage, chunk in engine.stage_modules.items():
        owners = chunk.tied_stages
        for name, p in chunk.named_parameters():
            value = p.detach().float().clone()
            if name.startswith("tied_modules."):
                key = name.split(".")[1]
                weights[f"tied/{stage}/{name}"] = value
                if stage != owners[key][0]:
                    continue
            weights[name] = value
    out = {"losses": losses, "weights": weights, "norms": norms, "global_steps": engine.global_steps}
    if eval_step is not None:
        x, y = global_batch(eval_step)
        xs, ys = x.chunk(num_dp)[dp_rank], y.chunk(num_dp)[dp_rank]
        data = iter(list(zip(xs.chunk(gas), ys.chunk(gas))))
        out["eval_loss"] = float(engine.eval_batch(data))
    return out


def pipeline_runs(cases: list[tuple[dict, int]], eval_step: int | None = None) -> list[dict]:
    """Several engines one after another in the same process group (saves process start-ups)."""
    return [pipeline_run(cfg, stages, eval_step=eval_step) for cfg, stages in cases]


def max_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in got if k in ref)


# ---------------------------------------------------------------------------------------------
def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return type(exc).__name__, str(exc)
    return "ok", ""


def error_cases() -> dict[str, tuple[str, str]]:
    """Each bad input on a world of 2, in one process group; every case fails the same way on
    every rank (so the next case still finds the peers in step)."""
    import zerospeed

    rank = dist.get_rank()
    out: dict[str, tuple[str, str]] = {}
    out["stages_not_dividing_world"] = _outcome(lambda: make_pipeline(3))
    out["more_stages_than_layers"] = _outcome(
        lambda: PipelineModule([LayerSpec(nn.Linear, 6, 6)], num_stages=2, loss_fn=mse))
    three = [LayerSpec(nn.Linear, 6, 6) for _ in range(3)]
    out["virtual_stages_than_layers"] = _outcome(lambda: zerospeed.initialize(
        model=PipelineModule(three, num_stages=2, loss_fn=mse), config=config("interleaved_1f1b", 4, virtual=2)))
    out["stage_without_parameters"] = _outcome(lambda: zerospeed.initialize(  # fails on rank 1 only
        model=PipelineModule([LayerSpec(nn.Linear, 6, 6), LayerSpec(nn.Tanh)], num_stages=2, loss_fn=mse,
                             partition_method="uniform"), config=config("1f1b", 4)))
    out["batch_not_divisible"] = _outcome(lambda: zerospeed.initialize(
        model=make_pipeline(2), config=config("1f1b", 4, train_batch_size=15)))
    out["interleaved_microbatches"] = _outcome(lambda: zerospeed.initialize(
        model=make_pipeline(2), config=config("interleaved_1f1b", 3, virtual=2, train_batch_size=12)))
    out["zero_stage_2"] = _outcome(lambda: zerospeed.initialize(model=make_pipeline(2), config=config("1f1b", 4, zero=2)))
    out["stages_config_mismatch"] = _outcome(lambda: zerospeed.initialize(
        model=make_pipeline(2), config=config("1f1b", 4, pipeline={"stages": 4})))

    def shape_mismatch() -> None:
        model = PipelineModule([LayerSpec(nn.Linear, 6, 8), LayerSpec(nn.Linear, 5, 6)], num_stages=2,
                               loss_fn=mse, partition_method="uniform")
        engine, _, _, _ = zerospeed.initialize(model=model, config=config("1f1b", 4))
        before = [p.detach().clone() for p in model.parameters()]
        try:
            engine.train_batch(iter(micro_batches(0, 0, 1, 4)))
        finally:
            assert engine.global_steps == 0
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out["shape_mismatch"] = _outcome(shape_mismatch)

    def missing_iterator() -> None:
        engine, _, _, _ = zerospeed.initialize(model=make_pipeline(2), config=config("gpipe", 4))
        engine.train_batch(iter(micro_batches(0, 0, 1, 4)) if rank == 0 else None)
    out["missing_data_iter"] = _outcome(missing_iterator)

    def bad_loss() -> None:
        model = PipelineModule(layer_specs(), num_stages=2, loss_fn=_elementwise_loss, seed_layers=True,
                               partition_method="uniform")
        engine, _, _, _ = zerospeed.initialize(model=model, config=config("1f1b", 4))
        engine.train_batch(iter(micro_batches(0, 0, 1, 4)))
    out["non_scalar_loss"] = _outcome(bad_loss)

    def call_engine() -> None:
        engine, _, _, _ = zerospeed.initialize(model=make_pipeline(2), config=config("1f1b", 4))
        engine(torch.zeros(2, DIM_IN))
    out["engine_call"] = _outcome(call_engine)

    def dynamic_shapes() -> None:
        model = PipelineModule(layer_specs(), num_stages=2, loss_fn=mse, seed_layers=True,
                               partition_method="uniform", dynamic_shape=True)
        engine, _, _, _ = zerospeed.initialize(model=model, config=config("zero_bubble", 4))
        x, y = global_batch(0)
        sizes = [3, 5, 4, 4]  # micro-batches of different sizes: a header precedes every activation
        data = list(zip(x.split(sizes), y.split(sizes)))
        loss = engine.train_batch(iter(data))
        assert torch.isfinite(loss) and engine.global_steps == 1
    out["dynamic_shape"] = _outcome(dynamic_shapes)
    return out


def _elementwise_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (out - labels) ** 2


def eval_cases() -> dict:
    """eval_batch's variants on 2 stages, before any training (the reference is the initial model)."""
    import zerospeed

    engine, _, _, _ = zerospeed.initialize(model=make_pipeline(2), config=config("1f1b", 4))
    batches = micro_batches(5, 0, 1, 4)
    out = {"loss": float(engine.eval_batch(iter(batches)))}
    loss, logits = engine.eval_batch(iter(batches), return_logits=True)
    out["logits"] = logits
    out["per_microbatch"] = engine.eval_batch(iter(batches), reduce_output=None)
    out["outputs"] = engine.eval_batch(iter(batches), compute_loss=False, reduce_output=None)
    out["not_broadcast"] = engine.eval_batch(iter(batches), bcast_loss=False)
    out["global_steps"] = engine.global_steps
    out["training"] = engine.module.training
    return out


def data_loader_case() -> dict:
    """initialize(training_data=...) and train_batch() without an iterator, as DeepSpeed allows."""
    import zerospeed

    x, y = global_batch(0)
    dataset = torch.utils.data.TensorDataset(x, y)
    engine, _, loader, _ = zerospeed.initialize(model=make_pipeline(2), config=config("1f1b", 4),
                                                training_data=dataset)
    losses = [float(engine.train_batch()) for _ in range(3)]  # 3 steps of 16 samples: the loader repeats
    return {"losses": losses, "global_steps": engine.global_steps, "loader_len": len(loader)}


def world2_cases() -> dict:
    out = {"errors": error_cases(), "eval": eval_cases(), "loader": data_loader_case()}
    for precision in ("bf16", "fp16"):  # a smaller lr: Adam turns 16-bit noise in ~0 gradients into +-lr steps
        cfg = config("zero_bubble", 4, zero=1, lr=LR_16BIT, **{precision: {"enabled": True}})
        out[precision] = pipeline_run(cfg, 2)
    return out


def reference_eval(step: int) -> tuple[float, torch.Tensor]:
    model = Reference()
    with torch.no_grad():
        x, y = global_batch(step)
        out = model(x)
        return mse(out, y).item(), out
