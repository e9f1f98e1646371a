"""Pages generated from the code, so they cannot drift from it (issue #33).

* ``reference/config.md``: every key the config schema accepts (:class:`zerospeed.config.schema.ZeroSpeedConfig`,
  walked recursively through its sections), with its type, default, allowed range or values, the other spellings
  DeepSpeed accepts (aliases) and, for the whole section, the DeepSpeed equivalent;
* ``reference/cli.md``: the help of every command-line parser (the launcher, ``zerospeed serve``,
  ``zerospeed-consolidate``);
* ``migration.md``'s tables: the keys DeepSpeed removed, the features not built yet (``config/removed.py``) and the
  optimizer / LR-schedule names (``config/names.py``).

``python docs/gen_pages.py OUT_DIR`` writes them; ``docs/hooks.py`` adds them to the MkDocs build. Everything
here reads the code's own tables; nothing is typed by hand.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel
from pydantic_core import PydanticUndefined

# DeepSpeed's documentation of each top-level section (deepspeed.ai/docs/config-json); zerospeed's own sections
# say so. Keys inside a section keep DeepSpeed's names.
DEEPSPEED_SECTIONS = {
    "fast_paths": "none (zerospeed's own)",
    "pipeline": "`pipeline` (zerospeed adds `schedule`, `virtual_stages`)",
    "torch_autocast": "`torch_autocast`",
}


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is dict:
        return None  # a table of named sections: see _named_sections
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _named_sections(annotation: Any) -> type[BaseModel] | None:
    """``dict[str, Section]`` (compression's ``different_groups``): the section each named entry is."""
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[-1]
        return value if inspect.isclass(value) and issubclass(value, BaseModel) else None
    for arg in typing.get_args(annotation):
        found = _named_sections(arg)
        if found is not None:
            return found
    return None


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(dict.fromkeys(type(v).__name__ for v in typing.get_args(annotation)))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [_type_name(a) for a in typing.get_args(annotation)]
        return " | ".join(dict.fromkeys(parts))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def _validators(annotation: Any, metadata: list[Any]) -> Iterator[Any]:
    for item in metadata:
        yield item
    for arg in typing.get_args(annotation):
        if typing.get_origin(annotation) is typing.Annotated:
            yield from typing.get_args(annotation)[1:]
            break
        yield from _validators(arg, [])


def _range(annotation: Any, metadata: list[Any]) -> str:
    """The allowed values, read from the field's Literal choices and its validators' own bounds."""
    literals = _literals(annotation)
    if literals:
        return ", ".join(f"`{v}`" for v in literals)
    for item in _validators(annotation, metadata):
        func = getattr(item, "func", item)
        if not callable(func):
            continue
        try:
            names = inspect.getclosurevars(func).nonlocals
        except TypeError:
            continue
        if "low" in names and "high" in names:
            low, high = names["low"], names["high"]
            left = "(" if names.get("low_open") else "["
            lo = "-inf" if low is None else f"{low:g}"
            hi = "inf" if high is None else f"{high:g}"
            return f"{left}{lo}, {hi}]"
        if "bound" in names:
            return f">= {names['bound']}"
        if "interval" in names:
            return names["interval"]
        if getattr(func, "__name__", "") == "_positive_float":
            return "> 0"
        if "allowed" in names and isinstance(names["allowed"], (tuple, list, set, frozenset)):
            return ", ".join(f"`{v}`" for v in names["allowed"])
    return ""


def _literals(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    out: list[Any] = []
    for arg in typing.get_args(annotation):
        out += _literals(arg)
    return out


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        try:
            value = info.default_factory()
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(section defaults)"
        return f"`{value!r}`"
    if info.default is PydanticUndefined:
        return ""
    return f"`{info.default!r}`"


def _aliases(info: Any) -> list[str]:
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str)]
    return [alias] if isinstance(alias, str) else []


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[dict[str, str]]:
    """One row per accepted key (dotted path), in the schema's order, sections before their keys."""
    from zerospeed.config.normalize import ALIASES
    from zerospeed.config.schema import ZeroSpeedConfig

    model = model or ZeroSpeedConfig
    rows: list[dict[str, str]] = []
    extra_aliases = ALIASES.get(prefix.rstrip("."), {})
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        section = _section_model(info.annotation)
        aliases = list(dict.fromkeys([a for a in _aliases(info) if a != name] + list(extra_aliases.get(name, ()))))
        doc = (info.description or "").strip()
        rows.append({"key": path, "type": _type_name(info.annotation), "default": _default(info),
                     "range": _range(info.annotation, list(info.metadata)),
                     "aliases": ", ".join(f"`{a}`" for a in aliases), "doc": doc,
                     "section": "yes" if section is not None else ""})
        if section is not None:
            rows += config_keys(section, f"{path}.")
        named = _named_sections(info.annotation) if section is None else None
        if named is not None:  # {"<name>": {...}, ...}: each entry's keys under <name>
            rows += config_keys(named, f"{path}.<name>.")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_page() -> str:
    rows = config_keys()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema (`zerospeed.config.schema.ZeroSpeedConfig`) by `docs/gen_pages.py`; every key "
        "zerospeed accepts is here. Keys keep DeepSpeed's names: the DeepSpeed equivalent of a key is the key "
        "itself, in the section of the same name of DeepSpeed's config (deepspeed.ai/docs/config-json), unless "
        "the section's row says otherwise. Keys DeepSpeed removed and features not built are in "
        "[Migrating from DeepSpeed](../migration.md).",
        "",
    ]
    top = None
    for row in rows:
        head = row["key"].split(".")[0]
        if head != top:
            top = head
            if "." not in row["key"] and row["section"]:
                lines += ["", f"## `{head}`", "", f"DeepSpeed: {DEEPSPEED_SECTIONS.get(head, f'`{head}`')}", ""]
                lines += ["| key | type | default | allowed | DeepSpeed also accepts |", "|---|---|---|---|---|"]
            if len(lines) < 8 or not lines[-1].startswith("|"):
                lines += ["", "## Top-level keys", "", "| key | type | default | allowed | DeepSpeed also accepts |",
                          "|---|---|---|---|---|"]
        lines.append(f"| `{row['key']}` | {_cell(row['type'])} | {_cell(row['default'])} | {_cell(row['range'])} | "
                     f"{_cell(row['aliases'])} |")
    return "\n".join(lines) + "\n"


def console_scripts() -> dict[str, str]:
    """The package's commands (pyproject.toml's [project.scripts], as installed): name -> "module:function"."""
    from importlib.metadata import distribution

    return {ep.name: ep.value for ep in distribution("zerospeed").entry_points if ep.group == "console_scripts"}


def _help(target: str, argv: list[str]) -> str:
    """What ``COMMAND --help`` prints: the command's own main() run with --help (argparse's help, from its parser)."""
    import contextlib
    import importlib
    import io

    module, func = target.split(":")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            getattr(importlib.import_module(module), func)(argv)
        except SystemExit:
            pass
    return out.getvalue().rstrip()


def cli_helps() -> list[tuple[str, str]]:
    """(command, its --help) for every console script, and ``zerospeed serve`` (a subcommand of the launcher)."""
    out = []
    for name, target in console_scripts().items():
        out.append((name, _help(target, ["--help"])))
        if name == "zerospeed":
            out.append(("zerospeed serve", _help(target, ["serve", "--help"])))
    return out


def cli_page() -> str:
    lines = ["# Command-line reference", "",
             "Generated by `docs/gen_pages.py` from every command `pyproject.toml` installs: what `--help` prints "
             "(the commands' argparse parsers).", ""]
    for name, text in cli_helps():
        lines += [f"## `{name}`", "", "```text", text, "```", ""]
    return "\n".join(lines)


def migration_tables() -> str:
    from zerospeed.config import compile as compile_config
    from zerospeed.config import expert_parallel, names, removed
    from zerospeed.runtime import engine_api

    keys = config_keys()
    lines = ["## At a glance", "",
             "| | supported | behaves differently | refused, by name |", "|---|---|---|---|",
             f"| config keys | {len(keys)} keys, DeepSpeed's names ([reference](reference/config.md)) | "
             f"{len(compile_config.DEEPCOMPILE_ONLY_DEFAULTS) + len(expert_parallel.DEFAULT_ONLY)} accepted at "
             f"DeepSpeed's default only (below) | {len(removed.REMOVED_KEYS)} removed by DeepSpeed, "
             f"{len(removed.NOT_YET)} features not built (below) |",
             f"| engine methods (DeepSpeed 0.19.8 has {len(engine_api.DEEPSPEED_ENGINE_METHODS)}) | "
             f"{len(engine_api.HAS) + len(engine_api.ADDS)} | `loss_scale` (a property), `memory_breakdown()` "
             f"(bytes per rank) | {len(engine_api.LACKS)}, each a `NotImplementedError` saying why (below) |",
             f"| optimizer and LR-schedule names | "
             f"{len(names.OPTIMIZER_NAMES) + len(names.TORCH_OPTIMIZER_NAMES) + len(names.SCHEDULER_NAMES)} | "
             "see the [Optimizers guide](guides/optimizers.md) | "
             f"{len(names.OPTIMIZER_NAMES_NOT_YET) + len(names.SCHEDULER_NAMES_NOT_YET)} |", "",
             "## Keys DeepSpeed removed", "",
             f"Refused by name, whatever their value ({removed.REMOVED_PROBLEM}).", "",
             "| key | hint |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(hint)} |" for key, hint in sorted(removed.REMOVED_KEYS.items())]
    lines += ["", "## DeepSpeed features not built", "",
              f"Refused only when the config turns them on ({removed.NOT_YET_PROBLEM}); a section that is present "
              "but off is accepted.", "", "| key | feature |", "|---|---|"]
    lines += [f"| `{path}` | {_cell(what)} |" for path, _, what in removed.NOT_YET]
    lines += ["", "## Optimizer and LR-schedule names", "", "| names | status |", "|---|---|",
              f"| {', '.join(f'`{n}`' for n in names.OPTIMIZER_NAMES)} | built |",
              f"| {', '.join(f'`{n}`' for n in names.TORCH_OPTIMIZER_NAMES)} | built (torch.optim, as DeepSpeed's "
              "fallback) |",
              f"| {', '.join(f'`{n}`' for n in names.OPTIMIZER_NAMES_NOT_YET)} | not built |",
              f"| {', '.join(f'`{n}`' for n in names.OPTIMIZER_NAMES_REMOVED)} | removed in DeepSpeed |",
              f"| {', '.join(f'`{n}`' for n in names.SCHEDULER_NAMES)} | built (LR schedules) |",
              f"| {', '.join(f'`{n}`' for n in names.SCHEDULER_NAMES_NOT_YET)} | not built (LR schedules) |", ""]
    lines += ["## Accepted at DeepSpeed's default only", "",
              "Options of features zerospeed builds differently: the key is accepted at the value DeepSpeed "
              "defaults to, any other value is a `ConfigError` naming it.", "", "| key | DeepSpeed's default |",
              "|---|---|"]
    lines += [f"| `compile.{key}` | `{json.dumps(value)}` |"
              for key, value in compile_config.DEEPCOMPILE_ONLY_DEFAULTS.items()]
    lines += [f"| `expert_parallel.{key}` | `{json.dumps(value)}` |" for key, value in expert_parallel.DEFAULT_ONLY.items()]
    lines += ["", "Also refused by name: `compile.passes` "
              + ", ".join(f"`{k}` ({_cell(v)})" for k, v in compile_config.DEEPSPEED_PASSES_NOT_BUILT.items())
              + "; `expert_parallel.preset_model` " + ", ".join(f"`{k}`" for k in expert_parallel.DEEPSPEED_ONLY_PRESETS)
              + f" (built: {', '.join(f'`{k}`' for k in expert_parallel.PRESETS)}).", ""]
    lines += ["## Engine methods", "",
              f"Of DeepSpeed 0.19.8's {len(engine_api.DEEPSPEED_ENGINE_METHODS)} public engine methods, a zerospeed "
              f"engine has {len(engine_api.HAS) + len(engine_api.ADDS)}:", "",
              ", ".join(f"`{n}`" for n in sorted((*engine_api.HAS, *engine_api.ADDS))), "",
              "These raise `NotImplementedError: engine.<name>() is not supported by zerospeed: <why>`:", "",
              "| method | why, or what instead |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(why)} |" for name, why in sorted(engine_api.LACKS.items())]
    from zerospeed.deepspeed_alias import behaviours

    lines += ["", "## DeepSpeed 0.19.8 behaviours a switching script relies on", "",
              "Each row was read in DeepSpeed 0.19.8's source (the file is named) and is tested "
              "(`tests/test_deepspeed_behaviours.py`, the HuggingFace rows in `tests/test_as_deepspeed*.py` and "
              "`tests/test_ds_param_view.py`); the rows are `zerospeed/deepspeed_alias/behaviours.py`.", "",
              behaviours.markdown_table()]
    return "\n".join(lines) + "\n"


#: what each optional extra is for (the install table of Getting started; a new extra needs its line here)
EXTRA_USES = {
    "hf": "HuggingFace models, tokenizers, Accelerate, Trainer",
    "serve": "`zerospeed serve` (structured output included)",
    "monitor": "TensorBoard, Weights & Biases, the demo's plots",
    "autotune": "`zerospeed --autotuning` with the `model_based` / `cost_model` tuners",
    "quant": "the torchao quantization backend",
    "docs": "building this site (`make docs`) and its browser check",
    "test": "the test suite (`make test`): every extra above and the comparison clients",
}


def extras() -> dict[str, list[str]]:
    """pyproject.toml's optional extras: name -> the distributions it installs (version bounds dropped)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the docs are built with 3.11+ (tomllib)
        raise RuntimeError("docs/gen_pages.py needs Python 3.11+ (tomllib) to read pyproject.toml") from None
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return {name: [re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0] for req in reqs]
            for name, reqs in pyproject["project"]["optional-dependencies"].items()}


def extras_table() -> str:
    lines = ["| extra | for | installs |", "|---|---|---|"]
    for name, dists in extras().items():
        lines.append(f"| `{name}` | {EXTRA_USES[name]} | {', '.join(dists)} |")
    return "\n".join(lines) + "\n"


RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
_RUN = re.compile(r"^(?P<bench>.+?)-(?P<date>\d{8})-(?P<time>\d{4,6})$")


def benchmark_runs() -> dict[str, list[Path]]:
    """bench/results/*.md grouped by benchmark (the file name before its date), newest run first."""
    runs: dict[str, list[Path]] = {}
    for path in sorted(RESULTS.glob("*.md")):
        match = _RUN.match(path.stem)
        if match:
            runs.setdefault(match["bench"], []).append(path)
    return {bench: sorted(paths, key=lambda p: p.stem[len(bench):], reverse=True) for bench, paths in sorted(runs.items())}


def _command(text: str) -> str:
    """The command a results file records (the first line of the block after '- command:')."""
    match = re.search(r"^- command:\s*(`([^`]+)`)?\s*\n+```\w*\n(?P<block>.*?)\n```", text, re.M | re.S)
    if match:
        return match["block"].strip()
    match = re.search(r"^- command:\s*`([^`]+)`", text, re.M)
    return match.group(1) if match else ""


def _demoted(text: str) -> str:
    """A results file inside a page: its title dropped, other headings one level down, fences kept as text."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith(("```", "~~~")):
            fence = not fence
            out.append("```text" if fence and line.strip() in ("```", "~~~") else line)
            continue
        if not fence and line.startswith("#"):
            if line.startswith("# "):
                continue
            line = "#" + line
        out.append(line)
    return "\n".join(out).strip() + "\n"


def benchmark_pages() -> dict[str, str]:
    """One page per benchmark holding its results files as they are (newest first), and an overview."""
    runs = benchmark_runs()
    overview = ["# Benchmarks", "",
                "Each page shows a benchmark's result files from `bench/results/` as the benchmark wrote them (the "
                "machine, its load, the versions, the exact command, the tables), newest run first; nothing here is "
                "retyped. The guides say what the figures mean and which targets are and are not met. Reproduce a "
                "run with its command, after `make bench-env` for the DeepSpeed / vLLM comparisons.", "",
                "| benchmark | runs | latest | reproduce (latest run) |", "|---|---|---|---|"]
    pages: dict[str, str] = {}
    for bench, paths in runs.items():
        latest = paths[0].read_text()
        command = _command(latest)
        overview.append(f"| [{bench}]({bench}.md) | {len(paths)} | `{paths[0].name}` | `{_cell(command)}` |")
        body = [f"# {bench}", "", f"{len(paths)} run(s) in `bench/results/`, newest first. Reproduce the latest:", "",
                "```bash", command, "```", ""]
        for path in paths:
            body += [f"## `{path.name}`", "", _demoted(path.read_text()), ""]
        pages[f"benchmarks/{bench}.md"] = "\n".join(body)
    pages["benchmarks/index.md"] = "\n".join(overview) + "\n"
    return pages


def benchmark_nav() -> list[dict[str, str]]:
    return [{"Overview": "benchmarks/index.md"}, *({bench: f"benchmarks/{bench}.md"} for bench in benchmark_runs())]


def pages() -> dict[str, str]:
    """Generated page path (relative to docs/) -> Markdown."""
    return {"reference/config.md": config_page(), "reference/cli.md": cli_page(),
            "generated/migration_tables.md": migration_tables(), "generated/extras.md": extras_table(),
            **benchmark_pages()}


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:] or ["docs-generated"])[0])
    for rel, text in pages().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
