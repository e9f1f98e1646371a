"""The checkpoint format's pure parts, without processes: safetensors I/O with CRCs, JSON state,
the resharding map, tag rules and crash-window recovery."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import safetensors.torch
import torch

from zerospeed.checkpoint import CheckpointCorruptError, CheckpointNotFoundError
from zerospeed.checkpoint import publish
from zerospeed.checkpoint.jsonstate import capture_rng, decode, encode, restore_rng
from zerospeed.checkpoint.shards import SourcePiece, copy_pieces, plan_range
from zerospeed.checkpoint.tensor_io import SafetensorsReader, write_safetensors


def test_safetensors_roundtrip_interop_and_crc(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    tensors = {"view": base.narrow(0, 5, 7), "bf16": torch.randn(3, 4).bfloat16(), "scalar": torch.tensor(2.5),
               "ints": torch.arange(6, dtype=torch.int64).view(2, 3), "empty": torch.zeros(0),
               "flag": torch.tensor([True])}
    path = str(tmp_path / "x.safetensors")
    rec = write_safetensors(path, tensors)
    assert rec.num_bytes == os.path.getsize(path)
    lib = safetensors.torch.load_file(path)  # a standard safetensors file
    with SafetensorsReader(path, rec.num_bytes) as r:
        for k, t in tensors.items():
            assert torch.equal(lib[k], t) and torch.equal(r.read(k, rec.crc32[k]), t)
    with open(path, "r+b") as f:  # flip one bit of "view"
        f.seek(os.path.getsize(path) - sum(t.numel() * t.element_size() for t in tensors.values()) + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with SafetensorsReader(path, rec.num_bytes) as r, pytest.raises(CheckpointCorruptError, match="CRC-32"):
        r.read("view", rec.crc32["view"])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        SafetensorsReader(path, rec.num_bytes + 1)
    with open(path, "r+b") as f:  # header length pointing past the end
        f.write((10**9).to_bytes(8, "little"))
    with pytest.raises(CheckpointCorruptError, match="header length"):
        SafetensorsReader(path)
    with pytest.raises(CheckpointNotFoundError, match="missing"):
        SafetensorsReader(str(tmp_path / "nope.safetensors"))
    # a list of 1-D parts is stored as one tensor, their concatenation, without building it
    parts = [torch.arange(3.0), base.narrow(0, 2, 4)]
    rec = write_safetensors(str(tmp_path / "p.safetensors"), {"joined": parts})
    assert torch.equal(safetensors.torch.load_file(str(tmp_path / "p.safetensors"))["joined"], torch.cat(parts))


def test_json_state_roundtrip_and_refusal():
    tensors: dict = {}
    value = {"a": (1, [2.5, None, "s"]), "t": torch.ones(2, dtype=torch.bfloat16), "n": np.arange(3),
             "np": np.float32(1.5)}
    enc = encode(value, "client_state", tensors, "client.")
    assert set(tensors) == {"client.0", "client.1"}
    dec = decode(enc, tensors)
    assert dec["a"] == (1, [2.5, None, "s"]) and torch.equal(dec["t"], value["t"]) and dec["n"].tolist() == [0, 1, 2]
    assert dec["np"] == 1.5
    inline = decode(encode({"lr": torch.tensor(0.5)}, "g", None))
    assert torch.equal(inline["lr"], torch.tensor(0.5))
    with pytest.raises(TypeError, match=r"client_state\['x'\]\[1\] is a builtins.object"):
        encode({"x": [1, object()]}, "client_state", {})
    with pytest.raises(TypeError, match="str keys"):
        encode({1: 2}, "client_state", {})


def test_rng_capture_restore():
    tensors: dict = {}
    meta = capture_rng(tensors)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng(meta, tensors)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_plan_range_overlapping_sources_and_gaps():
    # parameter of 10 elements written as [0,4) [4,10) by one world size and [3,8) again by a replica
    src = [SourcePiece(0, 2, 0, 4), SourcePiece(1, 0, 4, 6), SourcePiece(2, 0, 3, 5)]
    data = {0: torch.tensor([9., 9, 0, 1, 2, 3]), 1: torch.arange(4., 10), 2: torch.arange(3., 8)}
    ops = plan_range("w", src, 2, 7, 1)  # elements [2, 9) into target positions [1, 8)
    target = torch.full((9,), -1.0)
    copy_pieces(ops, data.__getitem__, target)
    assert target.tolist() == [-1, 2, 3, 4, 5, 6, 7, 8, -1]
    with pytest.raises(CheckpointCorruptError, match=r"elements \[4, 10\)"):
        plan_range("w", [SourcePiece(0, 0, 0, 4)], 0, 10, 0)


def test_tags_and_crash_window_recovery(tmp_path):
    for bad in ("", "a/b", "..", ".hidden", "latest", None):
        with pytest.raises(ValueError):
            publish.validate_tag(bad)
    d = tmp_path / "ck"
    (d / "t1").mkdir(parents=True)
    (d / "t1" / "index.json").write_text("{}")
    (d / ".old-t0-00000000deadbeef").mkdir()  # a half-deleted aside copy (no index.json): ignored, removed
    publish.write_text_atomic(str(d / "latest"), "t1")
    assert publish.read_latest(str(d)) == "t1"
    # killed between the two renames of a re-save of t1: only the aside copy exists
    os.rename(d / "t1", d / ".old-t1-0123456789abcdef")
    (d / ".tmp-t1-fedcba9876543210").mkdir()
    assert publish.resolve_tag_dir(str(d), "t1", True).endswith(".old-t1-0123456789abcdef")
    publish.prepare_save_dir(str(d))  # the next save repairs it and drops the temporary
    assert sorted(os.listdir(d)) == ["latest", "t1"]
    with pytest.raises(CheckpointNotFoundError, match="checkpoints present: t1"):
        publish.resolve_tag_dir(str(d), "t2", False)
