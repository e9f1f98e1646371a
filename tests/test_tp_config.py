"""The ``tensor_parallel`` config section: degree, layer specs, presets and their one-line errors."""
import pytest

from zerospeed.config import ConfigError, load_config


def _tp(section):
    return load_config({"train_batch_size": 4, "tensor_parallel": section}).tensor_parallel


def test_degree_from_either_key_and_off_by_default():
    assert load_config({"train_batch_size": 4}).tensor_parallel.size == 1
    assert _tp({"autotp_size": 2}).size == 2 and _tp({"autotp_size": 2}).enabled
    assert _tp({"tp": {"tp_size": 4}}).size == 4
    assert _tp({"autotp_size": 0}).enabled is False


def test_partition_config_is_typed():
    cfg = _tp({"autotp_size": 2, "preset_model": "LLAMA", "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "ROW"},
        {"patterns": [r".*\.qkv_proj\.weight$"], "shape": [[64, 16, 16], -1]},
        {"patterns": [r".*\.gate$"], "partition_type": "skip"}]}})
    specs = cfg.partition_config.layer_specs
    assert [s.partition_type for s in specs] == ["row", "column", "skip"]
    assert specs[0].resolved_partition_dim == 1 and specs[1].resolved_partition_dim == 0
    assert specs[1].shape == ((64, 16, 16), -1)
    assert cfg.preset_model == "llama" and cfg.partition_config.use_default_specs is False


@pytest.mark.parametrize("section,key,problem", [
    ({"preset_model": "gpt5"}, "tensor_parallel.preset_model", "'gpt5' is not a known preset"),
    ({"partition_config": {"layer_specs": [{"patterns": ["("]}]}},
     "tensor_parallel.partition_config.layer_specs.0.patterns.0", "is not a valid regex"),
    ({"partition_config": {"layer_specs": [{"patterns": []}]}},
     "tensor_parallel.partition_config.layer_specs.0.patterns", "give at least one regex"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}},
     "tensor_parallel.partition_config.layer_specs.0.partition_type", "'diagonal' is not one of"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [2, 0]}]}},
     "tensor_parallel.partition_config.layer_specs.0.shape", "use positive ints or -1"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [2, -1], "partition_dim": 2}]}},
     "tensor_parallel.partition_config.layer_specs.0.partition_dim", "out of range for shape"),
    ({"autotp_size": 2, "tp": {"tp_size": 4}}, "tensor_parallel.autotp_size", "conflicts with tp.tp_size 4"),
    ({"kernel_inject": True}, "tensor_parallel.replace_with_kernel_inject", "no fused kernels"),
    ({"autotp_size": -1}, "tensor_parallel.autotp_size", "must be >= 0"),
    ({"tp_size": 2}, "tensor_parallel.tp_size", "unknown key"),
])
def test_bad_input_names_the_key(section, key, problem):
    with pytest.raises(ConfigError) as info:
        _tp(section)
    assert info.value.key_path == key, str(info.value)
    assert problem in str(info.value) and "\n" not in str(info.value)
