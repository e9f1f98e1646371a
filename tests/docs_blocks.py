"""The Markdown code-block harness (issue #33): every fenced block in README.md and docs/**/*.md is run or checked.

The convention (docs/CONTRIBUTING-docs.md says the same for writers). A page's blocks run in order, in one fresh
temporary folder per page, each in its own process (``OMP_NUM_THREADS=1``, the suite's Python first on PATH, so
``python`` and ``zerospeed`` are this checkout's; tests/ on PYTHONPATH, so hidden setup may reuse the suite's
helpers, e.g. ``from serve_cases import build_model_dir``). What a block's language means:

- ``python``: run as a script (a world of one), after the page's hidden setup for that block, if any;
- ``json``: parsed (a fragment such as ``"zero_optimization": {...}`` is wrapped in braces) and, unless marked
  ``json``, loaded with ``zerospeed.load_config`` (``train_batch_size: 1`` added when the block has no batch key);
- ``bash`` / ``sh``: run with ``bash -e`` in the page's folder;
- ``text``: output shown to the reader, not run. A block without a language is an error (say which it is).

A block's ``--8<-- "path"`` line (pymdownx.snippets) is the file it includes, as on the site.

HTML comments right before a block change that (they do not render, on the site or on GitHub):

- ``<!-- test: setup`` newline, lines, ``-->``: hidden glue run before the next block, in its language and process
  (define the model, the dataset, ... a ``python`` block assumes; write the config file a ``bash`` block reads). It
  goes into the file a ``file`` directive writes. Several setups before one block add up.
- ``<!-- test: launch 2 -->``: run the next ``python`` block (with its setup) under the launcher on 2 processes.
- ``<!-- test: file NAME -->``: write the next block to ``NAME`` in the page's folder (a script or config that a
  later ``bash`` block runs) instead of running it.
- ``<!-- test: json -->``: the next ``json`` block is only parsed (not a whole zerospeed config, e.g. an autotuning
  grid).
- ``<!-- test: output -->``: the next ``text`` block is what the previous ``python`` / ``bash`` block prints (its
  standard output, compared line by line without trailing spaces).
- ``<!-- test: skip REASON -->``: the next block is not run. REASON starts with one of ``SKIP_REASONS`` below: what a
  user would accept (it needs the network, a second machine, a GPU, or minutes of the whole suite).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_REASONS = ("network:", "multi-machine:", "gpu:", "long:")
LANGUAGES = ("python", "json", "bash", "sh", "text")
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*$")
_DIRECTIVE = re.compile(r"^<!-- test: (\w+)(.*?)(-->)?\s*$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    setup: list[str] = field(default_factory=list)
    launch: int = 0
    file: str = ""
    json_only: bool = False
    output: bool = False
    skip: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page of the site (generated pages hold no blocks of their own)."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "CONTRIBUTING-docs.md")]


def parse(path: Path) -> list[Block]:
    """The page's fenced blocks with the directives that precede each; a malformed directive is a ValueError."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    pending: dict[str, object] = {"setup": []}
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        fence = _FENCE.match(line)
        if directive:
            name, rest, closed = directive.group(1), directive.group(2).strip(), directive.group(3)
            if name == "setup":
                if closed:
                    raise ValueError(f"{rel}:{i + 1}: '<!-- test: setup' takes Python lines up to a '-->' line")
                end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
                if end is None:
                    raise ValueError(f"{rel}:{i + 1}: '<!-- test: setup' is never closed by a '-->' line")
                pending["setup"].append("\n".join(lines[i + 1:end]))  # type: ignore[union-attr]
                i = end + 1
                continue
            if not closed:
                raise ValueError(f"{rel}:{i + 1}: a '<!-- test: {name}' directive ends on its own line with '-->'")
            if name == "launch":
                if not rest.isdigit() or int(rest) < 1:
                    raise ValueError(f"{rel}:{i + 1}: '<!-- test: launch N -->' needs a process count, got {rest!r}")
                pending["launch"] = int(rest)
            elif name == "file":
                if not rest or "/" in rest or rest.startswith("."):
                    raise ValueError(f"{rel}:{i + 1}: '<!-- test: file NAME -->' needs a plain file name, got {rest!r}")
                pending["file"] = rest
            elif name == "json":
                pending["json_only"] = True
            elif name == "output":
                pending["output"] = True
            elif name == "skip":
                if not rest.startswith(SKIP_REASONS) or len(rest.split(":", 1)[1].strip()) < 8:
                    raise ValueError(f"{rel}:{i + 1}: a skip says why, starting with one of {SKIP_REASONS}: got "
                                     f"{rest!r}")
                pending["skip"] = rest
            else:
                raise ValueError(f"{rel}:{i + 1}: unknown directive 'test: {name}' (setup, launch, file, json, output, skip)")
            i += 1
            continue
        if fence:
            marker, lang = fence.group(1), fence.group(2)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(marker)
                        and lines[j].strip().strip(marker[0]) == ""), None)
            if end is None:
                raise ValueError(f"{rel}:{i + 1}: the code block is never closed")
            code = "".join(_included(line) for line in lines[i + 1:end])
            blocks.append(Block(rel, i + 1, lang, code, **pending))  # type: ignore[arg-type]
            pending = {"setup": []}
            i = end + 1
            continue
        i += 1
    return blocks


def _included(line: str) -> str:
    """A block's line, or the file a ``--8<-- "path"`` line (pymdownx.snippets, from the repository root) includes."""
    match = re.fullmatch(r'\s*--8<-- "([^"]+)"\s*', line)
    if not match:
        return line + "\n"
    return (ROOT / match.group(1)).read_text()


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def _run(cmd: list[str], cwd: Path, block: Block, timeout: float) -> None:
    """Run the block's command; its standard output is kept in cwd/.last_output for an ``output`` block."""
    try:
        out = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{block.where}: the {block.lang} block ran past {timeout:.0f} s") from exc
    if out.returncode != 0:
        raise AssertionError(f"{block.where}: the {block.lang} block failed (exit {out.returncode}):\n"
                             f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    (cwd / ".last_output").write_text(out.stdout)


def check_json(block: Block) -> None:
    text = block.code.strip()
    if text.startswith('"'):
        text = "{" + text.rstrip(",") + "}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{block.where}: the json block does not parse: {exc}") from exc
    if block.json_only:
        return
    from zerospeed.config.errors import ConfigError
    from zerospeed.config.loader import load_config

    if not any(k in data for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        data = {"train_batch_size": 1, **data}
    try:
        load_config(data)
    except ConfigError as exc:
        raise AssertionError(f"{block.where}: the json block is not a config zerospeed accepts: {exc}") from exc


def run_block(block: Block, workdir: Path, timeout: float = 240) -> str:
    """Run or check one block; returns what was done ('ran', 'checked', 'wrote NAME', 'skipped: ...', 'shown')."""
    if block.skip:
        return f"skipped: {block.skip}"
    if block.lang not in LANGUAGES:
        raise AssertionError(f"{block.where}: a code block needs one of the languages {LANGUAGES} "
                             f"(got {block.lang or 'none'}); 'text' for output")
    if block.file:
        (workdir / block.file).write_text("\n".join([*block.setup, block.code]))
        return f"wrote {block.file}"
    if block.lang == "text" and block.output:
        last = workdir / ".last_output"
        if not last.is_file():
            raise AssertionError(f"{block.where}: an output block follows no block that ran")
        got = [line.rstrip() for line in last.read_text().strip("\n").splitlines()]
        want = [line.rstrip() for line in block.code.strip("\n").splitlines()]
        if got != want:
            raise AssertionError(f"{block.where}: the previous block printed\n" + "\n".join(got)
                                 + "\nnot what the page shows:\n" + "\n".join(want))
        return "output matched"
    if block.lang == "text":
        return "shown"
    if block.lang == "json":
        check_json(block)
        return "checked"
    if block.lang in ("bash", "sh"):
        _run(["bash", "-e", "-c", "\n".join([*block.setup, block.code])], workdir, block, timeout)
        return "ran"
    script = workdir / f"block_{block.line}.py"
    script.write_text("\n".join([*block.setup, block.code]))
    if block.launch:
        cmd = [sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", str(block.launch), str(script)]
    else:
        cmd = [sys.executable, str(script)]
    _run(cmd, workdir, block, timeout)
    return "ran"
