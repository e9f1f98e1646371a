"""DeepSpeed's zero_to_fp32 helper names (issue #26) on DeepSpeed folders and on zerospeed checkpoints.

The reference is what DeepSpeed 0.19.8 itself held as fp32 masters (tests/fixtures/deepspeed/*/
expected.safetensors); a zerospeed checkpoint made by loading the same folder and saving it must give
the same tensors, bit for bit (both are copies of the same fp32 values).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ds_checkpoint_cases import FIXTURES, make_model, resave_case, zs_config
from zerospeed.testing import run_distributed
from zerospeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          convert_zero_checkpoint_to_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)

NAMES = ["inp.weight", "inp.bias", "norm.weight", "norm.bias", "mid.weight", "mid.bias", "out.weight", "out.bias"]


def reference(case: str) -> dict[str, torch.Tensor]:
    ref = load_file(os.path.join(FIXTURES, case, "expected.safetensors"))
    return {n: ref[f"{n}.master"] for n in NAMES}


@pytest.fixture(scope="module")
def zerospeed_ckpt(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("zs"))
    run_distributed(resave_case, 2, zs_config(3, "bf16", 2), os.path.join(FIXTURES, "zero3_bf16", "ckpt"), d,
                    timeout=100)
    return d


@pytest.mark.parametrize("case", ["zero0_fp32", "zero0_fp16", "zero1_bf16", "zero2_fp32", "zero3_fp32", "zero3_bf16",
                                  "zero3_fp32_universal"])
def test_fp32_state_dict_of_deepspeed_folders(case: str) -> None:
    sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(FIXTURES, case, "ckpt"))
    for n, t in reference(case).items():
        assert sd[n].dtype == torch.float32 and torch.equal(sd[n], t), n
    assert torch.equal(sd["offset"], torch.tensor([0.1, -0.2, 0.3]))
    tag = "global_step3_universal" if case.endswith("_universal") else "global_step3"
    tag_dir = get_fp32_state_dict_from_zero_checkpoint(os.path.join(FIXTURES, case, "ckpt", tag))
    assert all(torch.equal(tag_dir[k], sd[k]) for k in sd) and list(tag_dir) == list(sd)


@pytest.mark.timeout(120)
def test_fp32_state_dict_of_a_zerospeed_checkpoint(zerospeed_ckpt: str) -> None:
    sd = get_fp32_state_dict_from_zero_checkpoint(zerospeed_ckpt)
    for n, t in reference("zero3_bf16").items():
        assert torch.equal(sd[n], t), n


@pytest.mark.parametrize("safe", [False, True])
def test_convert_shards_and_loads_back(tmp_path, safe: bool) -> None:
    src = os.path.join(FIXTURES, "zero2_fp32", "ckpt")
    files = convert_zero_checkpoint_to_fp32_state_dict(src, str(tmp_path), max_shard_size="300B",
                                                       safe_serialization=safe)
    ext = "safetensors" if safe else "bin"
    index_name = ("model.safetensors" if safe else "pytorch_model.bin") + ".index.json"
    assert files[-1] == os.path.join(tmp_path, index_name)
    with open(files[-1]) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(NAMES) | {"offset"}
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        assert shard.endswith(ext)
        part = load_file(os.path.join(tmp_path, shard)) if safe else \
            torch.load(os.path.join(tmp_path, shard), weights_only=True)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 300, shard
        merged.update(part)
    for n, t in reference("zero2_fp32").items():
        assert torch.equal(merged[n], t), n
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_convert_in_bf16_to_one_file(tmp_path) -> None:
    src = os.path.join(FIXTURES, "zero1_bf16", "ckpt")
    files = convert_zero_checkpoint_to_state_dict(src, str(tmp_path), dtype="bfloat16", safe_serialization=True)
    assert files == [os.path.join(tmp_path, "model.safetensors")]
    sd = load_file(files[0])
    for n, t in reference("zero1_bf16").items():
        assert sd[n].dtype == torch.bfloat16 and torch.equal(sd[n], t.to(torch.bfloat16)), n
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        convert_zero_checkpoint_to_state_dict(src, str(tmp_path), dtype="int8")
    with pytest.raises(ValueError, match="max_shard_size: 'big'"):
        convert_zero_checkpoint_to_state_dict(src, str(tmp_path), max_shard_size="big")


def test_load_state_dict_into_a_model() -> None:
    model = load_state_dict_from_zero_checkpoint(make_model(7), os.path.join(FIXTURES, "zero3_fp32", "ckpt"))
    for n, t in reference("zero3_fp32").items():
        assert torch.equal(model.state_dict()[n], t), n


def test_missing_folder_names_it(tmp_path) -> None:
    from zerospeed.checkpoint.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "nope")):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "nope"))


# -- a released DeepSpeed file mapped again from its skeleton (checkpoint/deepspeed/remap.py) ----------------------
def _same_object(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() \
            and a.storage_offset() == b.storage_offset() and type(a) is type(b) \
            and a.requires_grad == b.requires_grad and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            _same_object(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_object(x, y, f"{where}[{i}]")
    else:
        assert a is b or a == b, where


def test_remapped_files_equal_their_first_load() -> None:
    """Every fixture file rebuilt from its skeleton (a fresh mapping, no unpickling) is the object the safe
    unpickler gave: same containers, same tensors (dtype, shape, stride, storage offset, bits)."""
    import glob

    from zerospeed.checkpoint.deepspeed import load_pickle
    from zerospeed.checkpoint.deepspeed.remap import rebuild, skeleton

    paths = sorted(glob.glob(os.path.join(FIXTURES, "*", "ckpt", "*", "*.pt")))
    assert len(paths) > 50
    for path in paths:
        first = load_pickle(path)
        skel = skeleton(path, first)
        assert skel is not None, path
        _same_object(first, rebuild(path, skel), path)


def test_no_skeleton_for_a_tensor_inside_an_object(tmp_path) -> None:
    """A tensor held by an object (not a dict, list or tuple) cannot be re-pointed: no skeleton, so the reader
    unpickles such a file again."""
    from zerospeed.checkpoint.deepspeed.remap import skeleton

    class Holder:
        def __init__(self) -> None:
            self.t = torch.arange(4.0)

    path = str(tmp_path / "f.pt")
    torch.save({"a": torch.ones(3)}, path)
    obj = torch.load(path, mmap=True, weights_only=True)
    assert skeleton(path, obj) is not None
    obj["h"] = Holder()
    assert skeleton(path, obj) is None


def test_a_rebuilt_file_is_unmapped_when_dropped(tmp_path) -> None:
    """The loader's memory bound rests on a dropped file giving its touched pages back at once: a rebuilt
    object's mapping must go with its last tensor, without waiting for the cyclic garbage collector."""
    import gc

    from zerospeed.checkpoint.deepspeed import load_pickle
    from zerospeed.checkpoint.deepspeed.remap import rebuild, skeleton

    def rss_file_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) / 1024

    path = str(tmp_path / "big.pt")
    torch.save({"flat": [torch.ones(16 * 2**20)]}, path)  # 64 MiB
    skel = skeleton(path, load_pickle(path))
    gc.disable()
    try:
        before = rss_file_mib()
        obj = rebuild(path, skel)
        assert float(obj["flat"][0].sum()) == 16 * 2**20  # every page touched
        touched = rss_file_mib()
        del obj
        after = rss_file_mib()
    finally:
        gc.enable()
    assert touched - before > 48, (before, touched)
    assert after - before < 8, f"the mapping outlived the object: {before:.0f} -> {touched:.0f} -> {after:.0f} MiB"
