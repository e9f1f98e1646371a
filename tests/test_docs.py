"""Issue #33: the docs site builds with warnings as errors, its generated config reference covers every key the
schema accepts, and the Getting-started script runs as written under the launcher with 2 processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from zerospeed.config import removed
import typing

from zerospeed.config.loader import _field_keys
from zerospeed.config.normalize import ALIASES
from zerospeed.config.schema import ZeroSpeedConfig

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_pages", ROOT / "docs" / "gen_pages.py")
gen_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_pages)  # type: ignore[union-attr]


def _inner_model(annotation: object) -> tuple[type[BaseModel] | None, str]:
    """(the section model inside an annotation, "<name>." when it is a table of named sections)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if typing.get_origin(annotation) is dict:
        model, _ = _inner_model(typing.get_args(annotation)[-1])
        return model, "<name>."
    for arg in typing.get_args(annotation):
        model, named = _inner_model(arg)
        if model is not None:
            return model, named
    return None, ""


def accepted_keys(model: type[BaseModel] = ZeroSpeedConfig, prefix: str = "") -> set[str]:
    """Every dotted key the parser accepts (field names and their aliases), by the parser's own key table."""
    keys: set[str] = set()
    section_aliases = ALIASES.get(prefix.rstrip("."), {})
    for key, field in _field_keys(model).items():
        keys.add(prefix + key)
        keys.update(prefix + alias for alias in section_aliases.get(field, ()))
        if key == field:
            section, named = _inner_model(model.model_fields[field].annotation)
            if section is not None:
                keys |= accepted_keys(section, f"{prefix}{key}.{named}")
    return keys


def documented_keys(page: str) -> set[str]:
    keys: set[str] = set()
    for line in page.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        key = cells[0].strip("`")
        keys.add(key)
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        keys.update(parent + a.strip().strip("`") for a in cells[-1].split(",") if a.strip())
    return keys


def test_config_reference_covers_every_accepted_key() -> None:
    documented = documented_keys(gen_pages.config_page())
    accepted = accepted_keys()
    assert accepted - documented == set(), "keys the schema accepts but the reference lacks"
    assert documented - accepted == set(), "keys the reference shows but the schema refuses"
    assert {"zero_optimization.stage", "autotuning.max_seconds", "zero_optimization.prefetch_bucket_size"} <= accepted


def test_migration_tables_list_every_removed_and_unbuilt_key() -> None:
    text = gen_pages.migration_tables()
    for key in [*removed.REMOVED_KEYS, *(path for path, _, _ in removed.NOT_YET)]:
        assert f"| `{key}` |" in text


@pytest.mark.timeout(300)
def test_docs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for page in ("index.html", "migration/index.html", "errors/index.html", "reference/config/index.html",
                 "reference/cli/index.html", "api/index.html"):
        assert (site / page).is_file(), page
    home = (site / "index.html").read_text()
    assert "Regressor" in home and "add_config_arguments" in home  # the example file is included, not retyped
    search = json.loads((site / "search" / "search_index.json").read_text())
    assert any("stage3_prefetch_bucket_size" in doc["text"] for doc in search["docs"])  # search finds a key


@pytest.mark.timeout(200)
def test_getting_started_script_runs_under_the_launcher(tmp_path: Path) -> None:
    examples = ROOT / "docs" / "examples"
    out = subprocess.run([sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", "2",
                          str(examples / "quickstart.py"), "--deepspeed_config", str(examples / "ds.json")],
                         cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "16 steps, last loss" in out.stdout
