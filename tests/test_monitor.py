"""Monitors: TensorBoard event files and CSV files read back with the engine's values and steps,
W&B offline, the user's own events, and the errors of bad events and config keys."""

import csv
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.monitor import Monitor, csv_file_name
from zerospeed.testing import run_distributed

GAS, MICRO, SEQ, STEPS = 2, 2, 5, 3


class TokenNet(nn.Module):
    """A one-layer next-token model over integer inputs (so the monitor counts tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, idx, targets):
        return nn.functional.cross_entropy(self.head(self.emb(idx)).flatten(0, 1), targets.flatten())


def _read_tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def _train_with_monitors(out_dir, stage):
    import zerospeed

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage},
           "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
           "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"}}
    engine, *_ = zerospeed.initialize(model=TokenNet(), config=cfg)
    losses, lrs, norms = [], [], []
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        step_losses = []
        for _ in range(GAS):
            x = torch.randint(0, 11, (MICRO, SEQ), generator=g)
            loss = engine(x, x.roll(1, 1))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / GAS)
        lrs.append(engine.get_lr()[0])
        norms.append(engine.get_global_grad_norm())
    engine.monitor.write_events([("custom/value", 2.5, 7), ("custom/value", torch.tensor(3.5), 8)])
    engine.destroy()
    return {"losses": losses, "lrs": lrs, "norms": norms, "samples": engine.global_samples}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_engine_events_read_back_from_tensorboard_and_csv(tmp_path, stage):
    results = run_distributed(_train_with_monitors, 2, str(tmp_path), stage)
    world = len(results)
    samples_per_step = MICRO * GAS * world
    steps = [samples_per_step * (i + 1) for i in range(STEPS)]
    mean_loss = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]

    tb = _read_tensorboard(str(tmp_path / "tb"))
    assert [s for s, _ in tb["Train/Samples/train_loss"]] == steps
    assert [v for _, v in tb["Train/Samples/train_loss"]] == pytest.approx(mean_loss, rel=1e-6)
    assert [v for _, v in tb["Train/Samples/lr"]] == pytest.approx(results[0]["lrs"], rel=1e-6)
    assert [v for _, v in tb["Train/Samples/grad_norm"]] == pytest.approx(results[0]["norms"], rel=1e-5)
    assert [v for _, v in tb["Train/Samples/loss_scale"]] == [1.0] * STEPS
    assert [v for _, v in tb["Train/Samples/global_step"]] == [1.0, 2.0, 3.0]
    assert all(v > 0 for _, v in tb["Train/Samples/samples_per_sec"])
    # every rank's tokens over the same wall time: tokens/s = samples/s * SEQ
    for (_, tok), (_, smp) in zip(tb["Train/Samples/tokens_per_sec"], tb["Train/Samples/samples_per_sec"]):
        assert tok == pytest.approx(smp * SEQ, rel=1e-5)
    for r in range(world):
        assert [s for s, _ in tb[f"Train/Memory/rank{r}_MiB"]] == steps
        assert all(v > 1 for _, v in tb[f"Train/Memory/rank{r}_MiB"])  # a process holds more than 1 MiB
    assert tb["custom/value"] == [(7, 2.5), (8, 3.5)]

    header, rows = _read_csv(tmp_path / "csv" / csv_file_name("Train/Samples/train_loss"))
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == steps
    assert [v for _, v in rows] == pytest.approx(mean_loss, rel=1e-6)
    assert _read_csv(tmp_path / "csv" / "custom_value.csv") == (["step", "value"], [(7, 2.5), (8, 3.5)])


def test_monitor_off_writes_nothing_and_only_rank_0_writes(tmp_path):
    off = Monitor(load_config({"train_batch_size": 1}), rank=0)
    assert not off.enabled and off.writers == []
    off.write_events([("a", 1.0, 0)])  # no writer, no error
    cfg = load_config({"train_batch_size": 1, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                              "job_name": "j"}})
    other = Monitor(cfg, rank=1)
    assert other.enabled and other.writers == []
    other.write_events([("a", 1.0, 0)])
    assert not (tmp_path / "j").exists()


@pytest.mark.parametrize("events, message", [
    ([("a", 1.0)], "event 0 is ('a', 1.0); expected a (name, value, step) tuple"),
    ([("a", 1.0, 0), ("", 1.0, 0)], "event 1 has name ''"),
    ([("a", "x", 0)], "event 0 (a) has value 'x'; expected a real number"),
    ([("a", 1.0, -1)], "event 0 (a) has step -1; expected an integer >= 0"),
    ([("a", 1.0, 1.5)], "event 0 (a) has step 1.5"),
    ("abc", "expects a list of (name, value, step) tuples, got str"),
])
def test_bad_events_are_refused_before_anything_is_written(tmp_path, events, message):
    cfg = load_config({"train_batch_size": 1, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                              "job_name": "j"}})
    monitor = Monitor(cfg, rank=0)
    with pytest.raises(ValueError, match="write_events: |write_events expects") as info:
        monitor.write_events(events)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert os.listdir(tmp_path / "j") == []
    monitor.close()


def _wandb_records(path, kind):
    """Records of one type in an offline W&B run file: a LevelDB-style log (7-byte file header,
    32 KiB blocks, records framed as crc32 / little-endian length / kind) of wandb Record protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, frame = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if frame in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except Exception:  # a record still being written
                break
            pending = b""
            if record.WhichOneof("record_type") == kind:
                out.append(record)
    return out


def _wandb_history(path):
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in _wandb_records(path, "history")]


@pytest.mark.timeout(120)
def test_wandb_offline_run_records_the_events(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config({"train_batch_size": 1, "wandb": {"enabled": True, "project": "zs-test", "group": "g"}})
    monitor = Monitor(cfg, rank=0)
    monitor.write_events([("Train/Samples/train_loss", 2.0, 4), ("Train/Samples/lr", 0.1, 4),
                          ("Train/Samples/train_loss", 1.5, 8)])
    monitor.close()
    (run_dir,) = [p for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-")]
    (log,) = run_dir.glob("*.wandb")
    # wandb's service finishes writing the file after run.finish() returns: wait for its exit record
    deadline = time.monotonic() + 60
    while not _wandb_records(log, "exit") and time.monotonic() < deadline:
        time.sleep(0.2)
    history = [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"} for row in _wandb_history(log)]
    assert history == [{"Train/Samples/train_loss": 2.0, "Train/Samples/lr": 0.1, "_step": 4},
                       {"Train/Samples/train_loss": 1.5, "_step": 8}]


@pytest.mark.parametrize("raw, key", [
    ({"tensorboard": {"enabled": True, "outputpath": "x"}}, "tensorboard.outputpath"),
    ({"csv_monitor": {"enabled": "yes"}}, "csv_monitor.enabled"),
    ({"wandb": {"enabled": True, "projct": "p"}}, "wandb.projct"),
    ({"tensorboard": {"job_name": 3}}, "tensorboard.job_name"),
])
def test_bad_monitor_keys_give_one_clear_line(raw, key):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, **raw})
    assert str(info.value).startswith(f"zerospeed config: {key}: ") and "\n" not in str(info.value)


@pytest.mark.timeout(120)
def test_pipeline_engine_feeds_the_monitor(tmp_path):
    from pipe_cases import config as pipe_config
    from pipe_cases import pipeline_runs

    cfg = pipe_config("1f1b", 4, tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "pipe"})
    (r0,), (r1,) = run_distributed(pipeline_runs, 2, [(cfg, 2)])
    tb = _read_tensorboard(str(tmp_path / "pipe"))
    batch = cfg["train_batch_size"]
    assert [s for s, _ in tb["Train/Samples/train_loss"]] == [batch * (i + 1) for i in range(len(r0["losses"]))]
    assert [v for _, v in tb["Train/Samples/train_loss"]] == pytest.approx(r0["losses"], rel=1e-6)
    assert [v for _, v in tb["Train/Samples/grad_norm"]] == pytest.approx(r0["norms"], rel=1e-5)
    assert r0["losses"] == r1["losses"]
