"""Tiny models and configs shared by the compression tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

DS_CONFIGS = Path(__file__).parents[1].parent / "shared" / "ds_configs"
TINY_GPT = GPTConfig(vocab_size=64, n_layer=4, n_head=4, d_model=32, seq_len=16)


def tiny_gpt(seed: int = 0, cfg: GPTConfig = TINY_GPT) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batch(step: int, size: int = 4, cfg: GPTConfig = TINY_GPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, cfg.vocab_size, (size, cfg.seq_len), generator=g)


def group(params: dict, modules: list[str], related: list[list[str]] | None = None) -> dict:
    out = {"params": params, "modules": modules}
    if related is not None:
        out["related_modules"] = related
    return out


def wq(bits: int, modules: list[str], start: int | None = None, period: int = 0, groups: int = 1,
       offset: int = 0, qtype: str = "symmetric", rounding: str = "nearest") -> dict:
    return {"shared_parameters": {"enabled": True, "schedule_offset": offset, "quantize_groups": groups,
                                  "quantization_type": qtype, "rounding": rounding},
            "different_groups": {"wq1": group({"start_bits": start or bits, "target_bits": bits,
                                               "quantization_period": period}, modules)}}


def aq(bits: int, modules: list[str], calibration: str = "dynamic", qtype: str = "symmetric") -> dict:
    return {"shared_parameters": {"enabled": True, "range_calibration": calibration, "quantization_type": qtype},
            "different_groups": {"aq1": group({"bits": bits}, modules)}}


def prune(ratio: float, modules: list[str], method: str = "l1", offset: int = 0,
          related: list[list[str]] | None = None, **shared) -> dict:
    return {"shared_parameters": {"enabled": True, "schedule_offset": offset, "method": method, **shared},
            "different_groups": {"p1": group({"dense_ratio": ratio}, modules, related)}}


def ds(compression: dict, **extra) -> dict:
    cfg = {"train_batch_size": 4, "steps_per_print": 0, "compression_training": compression,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}
    cfg.update(extra)
    return cfg


class Block(nn.Module):
    """A ResNet basic block with the names the cifar channel-pruning config expects."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class TinyResNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(Block(channels), Block(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean(dim=(2, 3)))


def tiny_bert(num_layers: int = 12, seed: int = 0) -> nn.Module:
    """Random-init HF BERT classifier whose shapes all the DeepSpeedExamples group counts (1, 48, 64) divide."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=48, num_hidden_layers=num_layers, num_attention_heads=12,
                     intermediate_size=96, max_position_embeddings=32, type_vocab_size=2, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).eval()


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


ZERO_COMPRESSION = {
    "weight_quantization": wq(8, ["blocks"], start=12, period=2, groups=4),
    "activation_quantization": aq(8, ["mlp"], calibration="static"),
    "sparse_pruning": prune(0.5, ["attn.qkv"], offset=1),
    "row_pruning": prune(0.5, ["mlp.fc"], offset=2, related=[["mlp.proj"]]),
}


def zero_config(stage: int) -> dict:
    # SGD: Adam would turn the float noise of the attention key bias (whose true gradient is 0) into
    # lr-sized steps that differ between world sizes
    return ds(ZERO_COMPRESSION, zero_optimization={"stage": stage, "reduce_bucket_size": 2000,
                                                   "allgather_bucket_size": 2000},
              optimizer={"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}})


def _masks(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith(("_mask", "act_low", "act_high"))}


def zero_compressed_runs(stages: list[int], steps: int = 4, ckpt_dir: str | None = None) -> list[dict]:
    """Train the compressed tiny GPT under each ZeRO stage on this rank's share of each global batch."""
    import torch.distributed as dist

    import zerospeed
    from zerospeed.compression import init_compression

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []

    def build(stage: int):
        model = init_compression(tiny_gpt(), zero_config(stage))
        engine, *_ = zerospeed.initialize(model=model, config=zero_config(stage))
        return engine

    def train(engine, first: int, last: int) -> list[float]:
        losses = []
        for step in range(first, last):
            x = batch(step).chunk(world)[rank]
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        return losses

    for stage in stages:
        engine = build(stage)
        losses = train(engine, 0, steps)
        out.append({"stage": stage, "losses": losses, "state": engine.consolidated_state_dict(),
                    "masks": _masks(engine.module),
                    "bits": engine.module.blocks[0].mlp.fc.wq_bits})
    if ckpt_dir is not None:  # checkpoint round trip at stage 3: save after 2 steps, resume in a new engine
        engine = build(3)
        first = train(engine, 0, 2)
        engine.save_checkpoint(ckpt_dir, tag="mid")
        resumed = build(3)
        resumed.load_checkpoint(ckpt_dir, tag="mid")
        out.append({"stage": "resumed", "losses": first + train(resumed, 2, steps),
                    "masks": _masks(resumed.module), "bits": resumed.module.blocks[0].mlp.fc.wq_bits})
    return out


PIPE_COMPRESSION = {
    "weight_quantization": wq(4, [r"^\d+\.lin$"], start=8, period=1),
    "row_pruning": prune(0.5, [r"^\d+\.lin$"], offset=1),
}


def pipe_reference(steps: int) -> dict:
    """pipe_cases' single-process reference with the same compression, the schedule stepped by hand."""
    from pipe_cases import BETAS, CLIP, EPS, LR, Reference, micro_batches, mse

    from zerospeed.compression import init_compression, scheduler_of

    model = init_compression(Reference(), {"compression_training": PIPE_COMPRESSION})
    model.blocks = [getattr(model, str(i)) for i in range(1, len(model.blocks) + 1)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        pieces = micro_batches(step, 0, 1, 2)
        total = 0.0
        for x, y in pieces:
            loss = mse(model(x), y) / len(pieces)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        scheduler_of(model).step()
        losses.append(total)
    return {"losses": losses, "bits": model.blocks[0].lin.wq_bits}


def pipe_compressed_run(steps: int) -> dict:
    """Two pipeline stages (1F1B), each compressing its own blocks; the engine steps the schedule."""
    import zerospeed
    from pipe_cases import config, make_pipeline, micro_batches

    from zerospeed.compression import init_compression

    cfg = config("1f1b", 2, compression_training=PIPE_COMPRESSION)
    model = init_compression(make_pipeline(2), cfg)
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    losses = []
    for step in range(steps):
        data = iter(micro_batches(step, 0, 1, 2))
        needs = engine.is_first_stage() or engine.is_last_stage()
        losses.append(float(engine.train_batch(data if needs else None)))
    layers = [m for m in model.modules() if hasattr(m, "wq_bits")]
    return {"losses": losses, "bits": [m.wq_bits for m in layers],
            "kept_rows": [int(m.row_mask.sum()) for m in layers]}
