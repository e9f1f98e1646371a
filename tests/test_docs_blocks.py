"""Issue #33: every code block in README.md and docs/ runs as written (or is checked, or says why not).

The convention a page follows is in tests/docs_blocks.py's docstring and docs/CONTRIBUTING-docs.md. One test per
page: its blocks run in order in one temporary folder, so a block may write a file a later block runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import docs_blocks
from docs_blocks import ROOT, Block, parse, run_block

PAGES = [p.relative_to(ROOT).as_posix() for p in docs_blocks.pages()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs(page: str, tmp_path: Path) -> None:
    blocks = parse(ROOT / page)
    done = []
    for block in blocks:
        done.append(f"{block.where} {block.lang}: {run_block(block, tmp_path)}")
    print("\n".join(done))


def test_the_readme_runs_its_quickstart_under_the_launcher() -> None:
    """The README's complete script is written to a file and launched on 2 processes by its own bash block."""
    blocks = parse(ROOT / "README.md")
    files = {b.file for b in blocks if b.file}
    assert {"quickstart.py", "ds.json"} <= files
    assert any(b.lang == "bash" and not b.skip and "--num_procs 2 quickstart.py" in b.code for b in blocks)
    quickstart = next(b for b in blocks if b.file == "quickstart.py")
    assert quickstart.code == (ROOT / "docs" / "examples" / "quickstart.py").read_text()


def _page(tmp_path: Path, text: str) -> list[Block]:
    page = tmp_path / "case.md"
    page.write_text(text)
    return parse(page)


def test_directives_attach_to_the_next_block(tmp_path: Path) -> None:
    blocks = _page(tmp_path, "<!-- test: setup\nx = 1\n-->\n<!-- test: setup\ny = 2\n-->\n<!-- test: launch 2 -->\n"
                             "```python\nprint(x + y)\n```\n\n<!-- test: file ds.json -->\n```json\n{}\n```\n"
                             "```text\nout\n```\n")
    assert [(b.lang, b.setup, b.launch, b.file) for b in blocks] == [
        ("python", ["x = 1", "y = 2"], 2, ""), ("json", [], 0, "ds.json"), ("text", [], 0, "")]


@pytest.mark.parametrize("text, message", [
    ("<!-- test: skip because -->\n```bash\nls\n```\n", "a skip says why"),
    ("<!-- test: skip gpu: x -->\n```bash\nls\n```\n", "a skip says why"),
    ("<!-- test: launch two -->\n```python\n1\n```\n", "needs a process count"),
    ("<!-- test: setup\nx = 1\n", "never closed"),
    ("<!-- test: run -->\n```python\n1\n```\n", "unknown directive"),
    ("```python\n1\n", "never closed"),
])
def test_malformed_directives_are_one_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _page(tmp_path, text)


def test_blocks_fail_when_they_should(tmp_path: Path) -> None:
    """The harness can fail: a block without a language, a config zerospeed refuses, a failing script."""
    cases = [Block("p.md", 1, "", "ls\n"), Block("p.md", 2, "json", '"zero_optimization": {"stage": 7}\n'),
             Block("p.md", 3, "json", "{not json}\n"), Block("p.md", 4, "python", "raise SystemExit(3)\n"),
             Block("p.md", 5, "bash", "false\n")]
    for block in cases:
        with pytest.raises(AssertionError, match=f"p.md:{block.line}"):
            run_block(block, tmp_path)
    assert run_block(Block("p.md", 6, "json", '"zero_optimization": {"stage": 3}\n'), tmp_path) == "checked"
    assert run_block(Block("p.md", 7, "json", '{"stage": [1, 2]}\n', json_only=True), tmp_path) == "checked"
    assert run_block(Block("p.md", 8, "python", "import sys; assert x == 1\n", setup=["x = 1"]), tmp_path) == "ran"
    assert run_block(Block("p.md", 9, "python", "print('a  ')\nprint('b')\n"), tmp_path) == "ran"
    assert run_block(Block("p.md", 10, "text", "a\nb\n", output=True), tmp_path) == "output matched"
    with pytest.raises(AssertionError, match="p.md:11: the previous block printed"):
        run_block(Block("p.md", 11, "text", "a\nc\n", output=True), tmp_path)
