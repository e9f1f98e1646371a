"""Issue #33: the docs site builds with warnings as errors, its generated config reference covers every key the
schema accepts, the Benchmarks pages hold bench/results/ as written, and every page of the built site works in
headless Chromium. (The code blocks, the Getting-started script under the launcher included, run in
tests/test_docs_blocks.py.)"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from zerospeed.config import removed
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


def test_cli_reference_has_every_installed_command() -> None:
    """Every [project.scripts] entry of pyproject.toml (and `zerospeed serve`) with the --help its parser prints."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert gen_pages.console_scripts() == scripts  # the installed entry points are pyproject's
    page = gen_pages.cli_page()
    for name in [*scripts, "zerospeed serve"]:
        section = page.split(f"## `{name}`\n", 1)[1].split("\n## ", 1)[0]
        assert f"usage: {name} " in section, name
    assert "--port" in page.split("## `zerospeed serve`")[1].split("\n## ")[0]
    assert "--num_procs" in page and "--max-shard-size" in page and "--force" in page


def test_readme_is_short_and_its_links_and_results_files_exist() -> None:
    """The README stays a front page (about 150 lines, issue #33, plus the short long-context and RL sections that
    issues #29 and #32 ask of it: <= 175) that links the site; every relative link resolves (GitHub renders
    it from the repository), and every results file it or a guide names is in bench/results/."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 175
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert "docs/index.md" in links and "docs/migration.md" in links
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).is_file(), link
    texts = [readme, *(p.read_text() for p in (ROOT / "docs").rglob("*.md"))]
    named = {m for text in texts for m in re.findall(r"\b([a-z_0-9-]+-\d{8}-\d{6}\.(?:md|json))", text)}
    assert len(named) > 10
    missing = sorted(name for name in named if not (ROOT / "bench" / "results" / name).is_file())
    assert missing == [], missing


def test_install_table_lists_every_extra_of_pyproject() -> None:
    """Getting started's extras table is generated from pyproject.toml, and every extra says what it is for."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(gen_pages.EXTRA_USES) == set(declared), "an extra without its line in docs/gen_pages.EXTRA_USES"
    table = gen_pages.extras_table()
    for name in declared:
        assert f"| `{name}` |" in table
    assert "fastapi" in table and "mkdocs-material" in table
    assert "<!-- generated: extras -->" in (ROOT / "docs" / "index.md").read_text()


def test_api_page_renders_every_public_name() -> None:
    """Every function and class in zerospeed.__all__ has a mkdocstrings entry (under its defining module's path)."""
    import zerospeed

    page = (ROOT / "docs" / "api.md").read_text()
    for name in zerospeed.__all__:
        obj = getattr(zerospeed, name)
        if callable(obj) and hasattr(obj, "__qualname__"):
            assert f"::: {obj.__module__}.{obj.__qualname__}\n" in page, name


def test_migration_tables_list_every_removed_and_unbuilt_key() -> None:
    from zerospeed.config import compile as compile_config
    from zerospeed.config import expert_parallel
    from zerospeed.runtime import engine_api

    text = gen_pages.migration_tables()
    for key in [*removed.REMOVED_KEYS, *(path for path, _, _ in removed.NOT_YET),
                *(f"compile.{k}" for k in compile_config.DEEPCOMPILE_ONLY_DEFAULTS),
                *(f"expert_parallel.{k}" for k in expert_parallel.DEFAULT_ONLY), *engine_api.LACKS]:
        assert f"| `{key}` |" in text, key
    for name in (*engine_api.HAS, *engine_api.ADDS):
        assert f"`{name}`" in text, name


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module's tests (mkdocs build --strict: any warning fails it)."""
    site = tmp_path_factory.mktemp("site")
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(site)], cwd=tmp_path_factory.getbasetemp(), env=env, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return site


@pytest.mark.timeout(300)
def test_docs_build_strict(built_site: Path) -> None:
    site = built_site
    for page in ("index.html", "migration/index.html", "errors/index.html", "reference/config/index.html",
                 "reference/cli/index.html", "api/index.html", "benchmarks/index.html",
                 "benchmarks/ddp_vs_zerospeed/index.html", "guides/zero/index.html", "guides/serving/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    assert all(name in api for name in ("run_distributed", "GatheredParameters", "save_checkpoint", "init_inference"))
    home = (site / "index.html").read_text()
    assert "Regressor" in home and "add_config_arguments" in home  # the example file is included, not retyped
    search = json.loads((site / "search" / "search_index.json").read_text())
    assert any("stage3_prefetch_bucket_size" in doc["text"] for doc in search["docs"])  # search finds a key


def test_benchmark_pages_hold_the_results_files_as_written() -> None:
    """One page per benchmark, each results file's tables copied from bench/results/ (not retyped), the command of
    its latest run first; the overview lists every benchmark."""
    pages = gen_pages.benchmark_pages()
    runs = gen_pages.benchmark_runs()
    assert {"ddp_vs_zerospeed", "inference_bench", "serve_bench", "offload_bench"} <= set(runs)
    assert set(pages) == {"benchmarks/index.md", *(f"benchmarks/{bench}.md" for bench in runs)}
    for bench, paths in runs.items():
        page = pages[f"benchmarks/{bench}.md"]
        command = gen_pages._command(paths[0].read_text())
        assert command and f"```bash\n{command}\n```" in page, bench
        for path in paths:
            rows = [line for line in path.read_text().splitlines() if line.startswith("|")]
            assert rows, path.name
            assert all(row in page for row in rows), path.name
        assert f"[{bench}]({bench}.md)" in pages["benchmarks/index.md"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def site_pages(site: Path) -> list[str]:
    """Every page of the built site (its folder URLs), the home page first."""
    pages = sorted(p.parent.relative_to(site).as_posix() + "/" for p in site.rglob("index.html"))
    return ["" if page == "./" else page for page in pages]


@pytest.mark.timeout(400)
@pytest.mark.skipif(CHROMIUM is None, reason="the browser check needs Debian's chromium (apt-get install chromium)")
def test_pages_load_search_finds_a_key_and_home_is_screenshotted(built_site: Path, tmp_path: Path) -> None:
    """Headless Chromium (Debian's chromium driven by Playwright's pip package, which downloads no browser): every
    page loads without console errors, the search finds a config key, and the home page is screenshotted
    (docs/screenshots/home.png is the committed copy of one such screenshot, 1280x900)."""
    from playwright.sync_api import sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(built_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site = f"http://127.0.0.1:{server.server_address[1]}/"

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda msg: errors.append(f"{page.url}: {msg.text}") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))
        paths = site_pages(built_site)
        assert len(paths) > 40 and "guides/zero/" in paths and "benchmarks/inference_bench/" in paths
        for path in paths:
            response = page.goto(site + path, wait_until="networkidle")
            assert response is not None and response.status == 200, path
        assert errors == []
        page.goto(site, wait_until="networkidle")
        shot = tmp_path / "home.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        search = page.locator("input.md-search__input")
        search.click()
        page.keyboard.type("max_seconds", delay=20)  # a key inside autotuning.max_seconds
        result = page.locator(".md-search-result__item").first
        result.wait_for(timeout=60000)
        assert "reference/config" in (result.locator("a").first.get_attribute("href") or "")
        assert errors == []
        browser.close()
    server.shutdown()
