"""MkDocs hooks: the generated pages (``docs/gen_pages.py``) join the build as files of their own (the Benchmarks
section of the nav is built from bench/results/), and a page's ``<!-- generated: NAME -->`` marker is replaced by
the generated ``generated/NAME.md`` text."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_spec = importlib.util.spec_from_file_location("zerospeed_docs_gen_pages", Path(__file__).with_name("gen_pages.py"))
gen_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_pages)  # type: ignore[union-attr]

_PAGES: dict[str, str] = {}
_MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")


def on_config(config: Any) -> Any:
    """The Benchmarks section of the nav lists one page per benchmark found in bench/results/ (before Reference)."""
    nav = [entry for entry in config["nav"] if not (isinstance(entry, dict) and "Benchmarks" in entry)]
    at = next((i for i, entry in enumerate(nav) if isinstance(entry, dict) and "Reference" in entry), len(nav))
    nav.insert(at, {"Benchmarks": gen_pages.benchmark_nav()})
    config["nav"] = nav
    return config


def on_files(files: Files, config: Any) -> Files:
    _PAGES.clear()
    _PAGES.update(gen_pages.pages())
    for rel, text in _PAGES.items():
        if not rel.startswith("generated/"):
            files.append(File.generated(config, rel, content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    def insert(match: re.Match[str]) -> str:
        return _PAGES[f"generated/{match.group(1)}.md"]

    return _MARKER.sub(insert, markdown)
