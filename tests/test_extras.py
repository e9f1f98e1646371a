"""Issue #33: a missing optional package is one line naming ``pip install 'zerospeed[extra]'``.

Absence is simulated the way Python itself reports it: ``sys.modules[name] = None`` makes ``import name`` fail and
``importlib.util.find_spec(name)`` answer ``None``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerospeed.config import extras

ROOT = Path(__file__).resolve().parents[1]


def test_every_optional_package_is_in_the_extra_it_names() -> None:
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {req.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower().replace("_", "-")
                     for req in reqs} for extra, reqs in optional.items()}
    for package, (dist, extra) in extras.EXTRAS.items():
        assert dist.lower().replace("_", "-") in names[extra], f"{package}: {dist} is not in the [{extra}] extra"


def test_serve_without_fastapi_is_one_line() -> None:
    code = "import sys; sys.modules['fastapi'] = None\nfrom zerospeed.cli import main\nsys.exit(main(['serve', 'm']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "zerospeed serve: error: zerospeed serve needs fastapi, which is not installed: pip install 'zerospeed[serve]'"]


def test_monitor_and_tuners_name_their_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from zerospeed.autotuning.tuners import make_tuner
    from zerospeed.monitor.writers import TensorBoardWriter, WandbWriter

    section = SimpleNamespace(output_path=str(tmp_path), job_name="j", project="p", group=None, team=None)
    for name in ("tensorboard", "wandb", "optuna", "sklearn"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(extras.MissingExtraError) as info:
        TensorBoardWriter(section)
    assert str(info.value) == "tensorboard.enabled needs tensorboard, which is not installed: " \
                              "pip install 'zerospeed[monitor]'"
    with pytest.raises(extras.MissingExtraError, match=r"^wandb.enabled needs wandb, .*zerospeed\[monitor\]'$"):
        WandbWriter(section)
    candidates = [{"zero_optimization.stage": 0}, {"zero_optimization.stage": 1}]
    with pytest.raises(extras.MissingExtraError, match=r"'model_based' needs optuna, .*zerospeed\[autotune\]'$"):
        make_tuner("model_based", candidates).search(lambda c: 1.0)
    with pytest.raises(extras.MissingExtraError, match=r"'cost_model' needs scikit-learn, .*zerospeed\[autotune\]'$"):
        make_tuner("cost_model", candidates).search(lambda c: 1.0)


def test_an_installed_package_imports_and_an_unknown_name_is_a_bug() -> None:
    assert extras.require("optuna", feature="x").__name__ == "optuna"
    with pytest.raises(KeyError, match="'json' is not an optional dependency"):
        extras.check("json", feature="x")
