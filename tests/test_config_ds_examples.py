"""Every published DeepSpeedExamples config either parses or fails naming the offending key.

The files live in ``../shared/ds_configs`` (next to the repository, not inside it).  A file's batch
numbers are written for some GPU count, so each file is tried with data-parallel world sizes
1, 2, 4, ... until it parses or fails for a reason other than the batch arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerospeed.config import ConfigError, load_config

DS_CONFIGS = Path(__file__).parents[1].parent / "shared" / "ds_configs"
FILES = sorted(DS_CONFIGS.glob("*.json")) if DS_CONFIGS.is_dir() else []
WORLD_SIZES = tuple(2**i for i in range(11))

#: the problems a file may legitimately be refused for
ACCEPTED_PROBLEMS = (
    "removed in DeepSpeed and not supported by zerospeed",
    "not supported by zerospeed yet",
    "'auto' cannot be resolved outside the HF Trainer",
    "unknown key",
)


def _outcome(path: Path) -> tuple[int | None, ConfigError | None]:
    """(world size it parsed with, None) or (None, the non-arithmetic error)."""
    last: ConfigError | None = None
    for dp in WORLD_SIZES:
        try:
            load_config(path, dp_world_size=dp)
            return dp, None
        except ConfigError as err:
            arithmetic = err.key_path == "train_batch_size" and (
                "!=" in err.problem or "not divisible" in err.problem
            )
            if not arithmetic:
                return None, err
            last = err
    pytest.fail(f"{path.name}: no data-parallel world size in {WORLD_SIZES} fits: {last}")


def _keys(node: object, prefix: str = "") -> set[str]:
    """All dotted key paths present in a JSON object."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            found.add(path)
            found |= _keys(value, f"{path}.")
    return found


@pytest.mark.skipif(not FILES, reason=f"no DeepSpeed example configs at {DS_CONFIGS}")
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_example_config_parses_or_names_the_key(path: Path) -> None:
    dp, err = _outcome(path)
    if err is None:
        assert dp is not None
        return
    message = str(err)
    assert "\n" not in message
    assert err.key_path in _keys(json.loads(path.read_text())), message
    assert any(problem in err.problem for problem in ACCEPTED_PROBLEMS), message


EXPECTED = {
    "training__pipeline_parallelism__ds_config.json": ("parses", None),
    "training__gan__gan_deepspeed_config.json": ("parses", None),
    "inference__sglang__ds_offload_cpu.json": ("parses", None),
    "inference__sglang__ds_offload_nvme_aio.json": ("parses", None),
    "compression__bert__config__ds_config_W1A8_Qgroup64_fp16.json": ("parses", None),
    "training__bing_bert__deepspeed_bsz4k_progressive_layer_drop_config_seq128.json":
        ("removed", "progressive_layer_drop"),
    "training__bing_bert__deepspeed_bsz64k_lamb_config_seq128.json": ("removed", "sparse_attention"),
    "training__bing_bert__1-bit_lamb__nccl__deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json":
        ("parses", None),  # OneBitLamb built (issue #28), as OneBitAdam
    "training__BingBertSquad__1-bit_adam__nccl__deepspeed_onebitadam_bsz96_config.json": ("parses", None),
    "training__tensor_parallel__hf_integration__configs__ds_config.json": ("auto", "bf16.enabled"),
    "training__DeepSpeed-ZenFlow__finetuning__zf_config.json": ("not yet", "zero_optimization.zenflow"),
    "inference__sglang__ds_offload_nvme_gds.json": ("not yet", "aio.use_gds"),
    "training__autotuning__hf__bert-base__ds_config_tune.json": ("auto", "train_micro_batch_size_per_gpu"),
    "training__data_efficiency__gpt_finetuning__config__ds_config_gpt_medium_random_ltd.json":
        ("not yet", "data_efficiency"),
    "training__bf16_master_weight__configs__bf16_full.json": ("parses", None),  # torch_autocast built (issue 20)
    "training__autotuning__hf__dsconfigs__ds_config_z2.json": ("auto", "train_micro_batch_size_per_gpu"),
    "training__imagenet__config__ds_fp16_z1_config.json": ("unknown", "cuda_visible_devices"),
}  # fmt: skip

PROBLEM_OF = {
    "removed": "removed in DeepSpeed",
    "not yet": "not supported by zerospeed yet",
    "auto": "'auto' cannot be resolved outside the HF Trainer",
    "unknown": "unknown key",
}


@pytest.mark.skipif(not FILES, reason=f"no DeepSpeed example configs at {DS_CONFIGS}")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_known_example_outcomes(name: str) -> None:
    path = DS_CONFIGS / name
    if not path.exists():
        pytest.skip(f"{name} is not in {DS_CONFIGS}")
    kind, key_path = EXPECTED[name]
    dp, err = _outcome(path)
    if kind == "parses":
        assert err is None, str(err)
        return
    assert err is not None, f"{name} parsed with dp_world_size={dp}"
    assert err.key_path == key_path, str(err)
    assert PROBLEM_OF[kind] in err.problem, str(err)


@pytest.mark.skipif(not FILES, reason=f"no DeepSpeed example configs at {DS_CONFIGS}")
def test_pipeline_example_values() -> None:
    c = load_config(DS_CONFIGS / "training__pipeline_parallelism__ds_config.json")
    triple = (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)
    assert triple == (256, 8, 32)
    assert c.optimizer is not None and c.optimizer.type == "Adam"
    assert c.optimizer.params["betas"] == [0.9, 0.999]
    c8 = load_config(c, dp_world_size=8)
    assert c8.gradient_accumulation_steps == 4


COMPRESSION_FILES = [f for f in FILES if f.name.startswith("compression__")]


@pytest.mark.skipif(not COMPRESSION_FILES, reason=f"no DeepSpeed compression configs at {DS_CONFIGS}")
def test_every_compression_config_parses() -> None:
    """The 14 compression configs (12 with a compression_training section) parse into typed objects."""
    sections = 0
    for path in COMPRESSION_FILES:
        dp, err = _outcome(path)
        assert err is None, f"{path.name}: {err}"
        section = load_config(path, dp_world_size=dp).compression_training
        sections += section is not None
        if section is not None:
            assert section.any_enabled, path.name
    assert len(COMPRESSION_FILES) == 14 and sections == 12


@pytest.mark.skipif(not COMPRESSION_FILES, reason=f"no DeepSpeed compression configs at {DS_CONFIGS}")
def test_compression_example_values() -> None:
    c = load_config(DS_CONFIGS / "compression__bert__config__ZeroQuant__ds_config_W48A8_Qgroup48_lkd_fp32.json")
    wq = c.compression_training.weight_quantization
    assert wq.shared_parameters.quantize_groups == 48 and wq.shared_parameters.rounding == "nearest"
    assert [(g.params.start_bits, g.params.target_bits) for g in wq.different_groups.values()] == [(8, 8), (4, 4)]
    assert wq.different_groups["wq2"].modules == ["intermediate", r"layer.\w+.output.dense"]
    hp = c.compression_training.head_pruning
    assert hp.shared_parameters.num_heads == 12 and hp.different_groups["rp1"].related_modules == [
        ["self.query", "self.key", "self.value"]]
    lr = c.compression_training.layer_reduction
    assert not lr.enabled and lr.teacher_layer == [2, 4, 6, 8, 10]
