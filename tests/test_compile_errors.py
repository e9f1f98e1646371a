"""engine.compile / register_compile_pass / the compile config section: bad input, one line each.

No processes: the checks run before anything touches the module or torch.distributed.
"""

from types import SimpleNamespace

import pytest
import torch

from zerospeed.compile.engine_compile import compile_engine, state_of
from zerospeed.config import ConfigError, load_config

BASE = {"train_batch_size": 1}


def _engine():
    return SimpleNamespace(module=torch.nn.Linear(2, 2))


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_unknown_backend_is_named_with_the_known_ones():
    engine = _engine()
    with pytest.raises(ValueError) as e:
        compile_engine(engine, backend="inductorr")
    message = _one_line(e)
    assert "'inductorr'" in message and "inductor" in message and "aot_eager" in message
    assert not state_of(engine).compiled
    with pytest.raises(TypeError, match="backend must be a backend name or a callable, got int"):
        compile_engine(engine, backend=3)


def test_unknown_compile_kwarg_is_named():
    with pytest.raises(ValueError) as e:
        compile_engine(_engine(), backend="eager", compile_kwargs={"dynamik": True})
    message = _one_line(e)
    assert "'dynamik'" in message and "dynamic" in message


def test_unknown_pass_lists_known_passes_and_a_schedule_is_refused_without_deepcompile():
    engine = _engine()
    state_of(engine).passes.register("my_pass", lambda gm, profile: gm)
    with pytest.raises(ValueError) as e:
        compile_engine(engine, backend="eager", schedule=[(0, ["prefetchh"])])
    assert _one_line(e) == ("unknown compile pass 'prefetchh'; known passes: async_reduce, gather_release, insert_reduce_grads, "
                            "my_pass, prefetch, reduce_early, selective_unshard")
    with pytest.raises(ValueError) as e:
        compile_engine(engine, backend="eager", schedule=[(0, ["my_pass"])])
    assert "compile.deepcompile: true" in _one_line(e)
    with pytest.raises(ValueError, match="schedule must be a list of"):
        compile_engine(engine, backend="eager", schedule="gather_release")
    with pytest.raises(TypeError, match="fn must be callable"):
        state_of(engine).passes.register("x", 3)
    with pytest.raises(ValueError, match="already registered"):
        state_of(engine).passes.register("my_pass", lambda gm, profile: gm)


def test_deepcompile_names_an_unsupported_backend():
    from zerospeed.compile.deepcompile import compiler_for

    assert compiler_for("inductor") == "inductor" and compiler_for("aot_eager") == "eager"
    for backend in ("cudagraphs", lambda gm, inputs: gm):
        with pytest.raises(ValueError) as e:
            compiler_for(backend)
        assert "is not supported with compile.deepcompile" in _one_line(e)


def test_compiling_twice_is_an_error():
    engine = _engine()
    compile_engine(engine, backend="eager")
    assert state_of(engine).compiled and state_of(engine).report()["backend"] == "eager"
    with pytest.raises(RuntimeError, match="already compiled"):
        compile_engine(engine, backend="eager")


def test_compile_section_defaults_are_accepted():
    cfg = load_config({**BASE, "compile": {"deepcompile": False, "double_buffer": True, "free_activation": False,
                                           "free_activation_threshold": 1024}})
    assert cfg.compile.deepcompile is False and cfg.compile.free_activation_threshold == 1024
    assert load_config(BASE).compile.passes is None


def test_deepcompile_is_accepted_and_an_unbuilt_option_is_named_in_one_line():
    cfg = load_config({**BASE, "compile": {"deepcompile": True, "passes": ["gather_release"]}})
    assert cfg.compile.deepcompile and cfg.compile.passes == ["gather_release"]
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "compile": {"deepcompile": True, "offload_parameters": True}})
    message = _one_line(e)
    assert message.startswith("zerospeed config: compile.offload_parameters:") and "DeepCompile" in message


@pytest.mark.parametrize("key,value", [("free_activation", True), ("offload_activation", True),
                                       ("offload_opt_states", True), ("offload_parameters", True),
                                       ("double_buffer", False), ("passes", ["gather_release"])])
def test_deepcompile_only_options_are_named(key, value):
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "compile": {key: value}})
    message = _one_line(e)
    assert message.startswith(f"zerospeed config: compile.{key}:") and "DeepCompile" in message, message


def test_unknown_compile_key_is_refused():
    with pytest.raises(ConfigError, match="compile"):
        load_config({**BASE, "compile": {"deep_compile": True}})
