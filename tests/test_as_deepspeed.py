"""zerospeed-as-deepspeed and ``import zerospeed.as_deepspeed`` (issue 27): zerospeed under DeepSpeed's name.

Each case runs a fresh interpreter (the alias changes ``sys.path`` and ``sys.meta_path`` of the process it runs
in), through the console script's module (``python -m zerospeed.deepspeed_alias.cli``):

* HuggingFace's checks find DeepSpeed (``find_spec`` plus the distribution's metadata: Transformers' and
  Accelerate's ``is_deepspeed_available``), its version passes their ``compare_versions`` checks and says
  zerospeed; ``deepspeed.X`` is the very module / object ``zerospeed.X``; every DeepSpeed module path and name
  that Transformers, Accelerate, PEFT and TRL import (read from their sources) imports;
* a DeepSpeed module or name zerospeed does not build is refused with one line naming it;
* never active unless asked: a plain interpreter finds no ``deepspeed``;
* a real DeepSpeed on the path (a fake package with its dist-info) is refused with one line, by the launcher,
  by the in-process switch and by the generated package itself; ``--force`` shadows it;
* the in-process switch refuses to come after Accelerate (which decides at import whether DeepSpeed exists);
* the launcher passes on the command's exit status, says when the command is not found (127), and removes the
  generated directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PY = sys.executable
CLI = [PY, "-m", "zerospeed.deepspeed_alias.cli"]

#: (module, names) that transformers 5, accelerate 1.15, peft 0.21 and trl 1.16 import from deepspeed
LIBRARY_PATHS = [
    ("deepspeed", ["initialize", "zero", "comm", "DeepSpeedEngine", "tp_model_init", "init_distributed",
                   "__version__"]),
    ("deepspeed.zero", ["Init", "GatheredParameters", "register_external_parameter"]),
    ("deepspeed.comm", ["get_rank", "init_distributed", "is_initialized"]),
    ("deepspeed.utils", ["logger", "groups", "set_z3_leaf_modules", "safe_get_full_grad"]),
    ("deepspeed.utils.groups", []),
    ("deepspeed.accelerator", ["get_accelerator"]),
    ("deepspeed.runtime.engine", ["DeepSpeedEngine"]),
    ("deepspeed.runtime.zero", ["GatheredParameters"]),
    ("deepspeed.runtime.zero.partition_parameters", ["ZeroParamStatus"]),
    ("deepspeed.runtime.lr_schedules", ["VALID_LR_SCHEDULES"]),
    ("deepspeed.runtime.utils", ["move_to_device"]),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp", ["UlyssesSPDataLoaderAdapter"]),
    ("deepspeed.ops.adam", ["DeepSpeedCPUAdam"]),
    ("deepspeed.ops.adagrad", ["DeepSpeedCPUAdagrad"]),
    ("deepspeed.ops.lion", ["DeepSpeedCPULion"]),
    ("deepspeed.launcher.runner", ["DEEPSPEED_ENVIRONMENT_NAME"]),
    ("deepspeed.checkpoint.utils", ["clone_tensors_for_torch_save"]),
]

#: names those libraries import that zerospeed does not build yet: importing them fails with Python's one line naming
#: the name (``cannot import name ...``); when one is built, move it to LIBRARY_PATHS (this test then says so).
#: None left: set_z3_leaf_modules (Accelerate, for the MoE classes it lists) and safe_get_full_grad (PEFT's AdaLoRA) are
#: built (zerospeed.utils.z3_leaf_module, zerospeed.utils.tensor_fragment).
NOT_BUILT: list[tuple[str, str]] = []


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("ZEROSPEED_AS_DEEPSPEED_FORCE", "ZEROSPEED_AS_DEEPSPEED_DIR"):
        env.pop(key, None)
    env.update(extra)
    return env


def _run(args, timeout=120, **env):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env(**env))


def _py(code):
    return [PY, "-c", textwrap.dedent(code)]


@pytest.fixture()
def fake_deepspeed(tmp_path):
    """A 'real' DeepSpeed: a package and its distribution metadata, as pip would install them."""
    root = tmp_path / "site"
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\nREAL = True\n")
    info = root / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    return str(root)


@pytest.mark.timeout(150)
def test_libraries_find_zerospeed_and_import_every_path():
    checks, not_built = repr(LIBRARY_PATHS), repr(NOT_BUILT)
    code = f"""
        import importlib, importlib.util, importlib.metadata, os
        import zerospeed
        assert importlib.util.find_spec("deepspeed") is not None
        version = importlib.metadata.version("deepspeed")
        import deepspeed
        assert deepspeed.__version__ == version and "+zerospeed." in version, version
        assert deepspeed.zero is zerospeed.zero and deepspeed.initialize is zerospeed.initialize
        import deepspeed.runtime.engine as e
        assert e is importlib.import_module("zerospeed.runtime.engine")
        from accelerate.utils import is_deepspeed_available, compare_versions
        assert is_deepspeed_available() and compare_versions("deepspeed", ">=", "0.16.4")
        assert not compare_versions("deepspeed", "<", "0.15.2")
        from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
        assert hf_available()
        missing = []
        for module, names in {checks}:
            try:
                m = importlib.import_module(module)
            except ImportError as exc:
                missing.append(f"{{module}}: {{exc}}")
                continue
            missing += [f"{{module}}.{{n}}" for n in names if not hasattr(m, n)]
        assert not missing, missing
        for module, name in {not_built}:
            try:
                exec(f"from {{module}} import {{name}}")
            except ImportError as exc:
                assert f"cannot import name '{{name}}'" in str(exc), exc
            else:
                raise AssertionError(f"{{module}}.{{name}} is built now: move it to LIBRARY_PATHS")
        assert os.path.isdir(os.environ["ZEROSPEED_AS_DEEPSPEED_DIR"])
        print("DIR", os.environ["ZEROSPEED_AS_DEEPSPEED_DIR"])
    """
    out = _run(CLI + _py(code))
    assert out.returncode == 0, out.stderr[-3000:]
    generated = out.stdout.split("DIR ")[1].strip()
    assert not os.path.exists(generated)  # the launcher removed it


@pytest.mark.timeout(60)
def test_a_name_zerospeed_lacks_is_refused_naming_it():
    code = """
        import deepspeed
        try:
            import deepspeed.not_a_deepspeed_module.sub
        except ModuleNotFoundError as exc:
            print("MODULE", exc)
        try:
            deepspeed.not_a_deepspeed_name
        except AttributeError as exc:
            print("NAME", exc)
        print("HAS", hasattr(deepspeed, "not_a_deepspeed_name"))
    """
    out = _run(CLI + _py(code))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == ("MODULE zerospeed-as-deepspeed: DeepSpeed module 'deepspeed.not_a_deepspeed_module' is not "
                        "built by zerospeed (no module 'zerospeed.not_a_deepspeed_module')")
    assert lines[1].startswith("NAME zerospeed-as-deepspeed: DeepSpeed name 'deepspeed.not_a_deepspeed_name' is not "
                               "built by zerospeed")
    assert lines[2] == "HAS False"


@pytest.mark.timeout(60)
def test_never_active_unless_asked():
    out = _run(_py("""
        import importlib.util, importlib.metadata, zerospeed, zerospeed.zero, zerospeed.deepspeed_alias
        print(importlib.util.find_spec("deepspeed"))
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            print("no dist")
    """))
    assert out.returncode == 0 and out.stdout.split() == ["None", "no", "dist"], out.stdout + out.stderr


@pytest.mark.timeout(90)
def test_real_deepspeed_is_refused_unless_forced(fake_deepspeed):
    probe = _py("import deepspeed; print(deepspeed.__version__, hasattr(deepspeed, 'REAL'))")
    # the launcher
    out = _run(CLI + probe, PYTHONPATH=fake_deepspeed)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("zerospeed-as-deepspeed: a real DeepSpeed is importable (the package at "
                                 f"{fake_deepspeed}"), out.stderr
    assert "--force" in out.stderr
    forced = _run(CLI[:] + ["--force"] + probe, PYTHONPATH=fake_deepspeed)
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert forced.stdout.split()[1] == "False" and "+zerospeed." in forced.stdout.split()[0]
    # the in-process switch
    inproc = _run(_py("import zerospeed.as_deepspeed"), PYTHONPATH=fake_deepspeed)
    assert inproc.returncode == 1
    last = inproc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: zerospeed.as_deepspeed: a real DeepSpeed is importable"), last
    forced_in = _run(_py("import zerospeed.as_deepspeed, deepspeed; print(deepspeed.__version__)"),
                     PYTHONPATH=fake_deepspeed, ZEROSPEED_AS_DEEPSPEED_FORCE="1")
    assert forced_in.returncode == 0 and "+zerospeed." in forced_in.stdout, forced_in.stderr[-2000:]
    # the generated package itself, when the launcher's check was bypassed (a child's own PYTHONPATH)
    child = _py("""
        from zerospeed.deepspeed_alias import layout
        import os, subprocess, sys
        root = layout.write()
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + sys.argv[1])
        r = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True)
        layout.remove(root)
        print(r.returncode, r.stderr.strip().splitlines()[-1])
    """) + [fake_deepspeed]
    out = _run(child)
    assert out.stdout.startswith("1 ImportError: zerospeed-as-deepspeed: a real DeepSpeed is importable"), \
        out.stdout + out.stderr[-2000:]


@pytest.mark.timeout(90)
def test_in_process_switch_works_and_must_come_first():
    ok = _run(_py("""
        import zerospeed.as_deepspeed
        import os, subprocess, sys
        from accelerate.utils import is_deepspeed_available
        import deepspeed
        print(is_deepspeed_available(), deepspeed.zero.GatheredParameters.__module__)
        # its children see it too (PYTHONPATH)
        r = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                           capture_output=True, text=True, check=True)
        print(r.stdout.strip())
    """))
    assert ok.returncode == 0, ok.stderr[-2000:]
    first, second = ok.stdout.splitlines()[-2:]
    assert first == "True zerospeed.zero.gathered" and "+zerospeed." in second
    late = _run(_py("import accelerate\nimport zerospeed.as_deepspeed"))
    assert late.returncode == 1
    assert late.stderr.strip().splitlines()[-1] == (
        "ImportError: zerospeed.as_deepspeed: import it before accelerate (already imported: they look for "
        "DeepSpeed when they are imported)")


@pytest.mark.timeout(60)
def test_launcher_exit_status_and_bad_command():
    assert _run(CLI + [PY, "-c", "raise SystemExit(7)"]).returncode == 7
    missing = _run(CLI + ["no-such-command-zerospeed"])
    assert missing.returncode == 127
    assert missing.stderr.strip() == "zerospeed-as-deepspeed: command not found: 'no-such-command-zerospeed'"
    empty = _run(CLI)
    assert empty.returncode == 2 and "no command given" in empty.stderr
    bad = _run(CLI + ["--frce", "python"])
    assert bad.returncode == 2 and "unknown option '--frce'" in bad.stderr


def test_cpu_optimizer_names_are_torch_optimizers_with_deepspeeds_signature():
    import torch

    from zerospeed.ops.adagrad import DeepSpeedCPUAdagrad
    from zerospeed.ops.lion import DeepSpeedCPULion, Lion

    def run(make):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5))
        opt = make([p])
        for i in range(3):
            p.grad = torch.sin(torch.arange(5.0) + i)
            opt.step()
        return p.detach()

    assert torch.equal(run(lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1)), run(lambda ps: torch.optim.Adagrad(ps, lr=0.1,
                                                                                                         eps=1e-10)))
    assert torch.equal(run(lambda ps: DeepSpeedCPULion(ps, lr=0.1)), run(lambda ps: Lion(ps, lr=0.1)))
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.ones(1))], fp32_optimizer_states=False)
    with pytest.raises(ValueError, match="amsgrad=True"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.ones(1))], amsgrad=True)
