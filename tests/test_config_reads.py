"""The config is parsed once, at the edge: nothing below the facade opens a config file or reads a raw config dict
(issue #34; DESIGN.md, principle 1).

The source of src/zerospeed is read with ``ast`` (``source_tree.py``) and four kinds of reads are looked for
outside config/ (the parser, which may do all of them):

1. a top-level config key looked up by a string literal (``cfg["zero_optimization"]``,
   ``raw.get("expert_parallel")``, ``"tensor_parallel" in raw``, ``.pop`` / ``.setdefault``); the keys are the
   schema's own (``ZeroSpeedConfig``'s fields and their aliases), so a new section is covered the day it is added;
2. a call of a parsing function of the config package (anything lowercase imported from ``zerospeed.config*``:
   ``load_config``, ``load_section``, ``read_config_source``...; or ``.model_validate`` of one of its classes);
3. ``json.load`` / ``json.loads`` (how a config file gets opened a second time);
4. ``.raw`` / ``._raw`` (the user's dict kept inside a parsed config).

Each is allowed only where listed below, with the reason. Entry points are the public functions that take a
user's config themselves (DeepSpeed's API has several besides ``initialize``); each hands it to the parser once.
"""

from __future__ import annotations

import ast
import textwrap

from pydantic import AliasChoices

from source_tree import module_path, modules, tree
from zerospeed.config import ZeroSpeedConfig

PARSER = "zerospeed.config"

#: modules (or packages) allowed to *call the parser* on a config a user handed them, and why
ENTRY_POINTS: dict[str, str] = {
    "zerospeed.runtime.initialize": "the facade: zerospeed.initialize reads the config once (prepare_config)",
    "zerospeed.zero.init": "zero.Init(config_dict_or_path=...), DeepSpeed's public entry",
    "zerospeed.checkpointing.settings": "deepspeed.checkpointing.configure(deepspeed_config=...), DeepSpeed's public "
                                        "entry",
    "zerospeed.compression.init": "init_compression(model, deepspeed_config) / redundancy_clean, DeepSpeed's public "
                                  "entries (load_section: the compression_training section)",
    "zerospeed.module_inject.auto_tp": "auto_tp(partition_config=...): a composable transform that takes a section",
    "zerospeed.moe.autoep": "refuse_with_pipeline(config) also takes a whole config (load_section)",
    "zerospeed.inference.v1": "init_inference(model, config=...), DeepSpeed's public entry",
    "zerospeed.inference.v2": "build_engine / pipeline() with a ragged-inference config, the v2 entry",
    "zerospeed.autotuning": "zerospeed --autotuning reads the script's config and validates every candidate it writes",
    "zerospeed.integrations": "the HuggingFace Trainer integration fills HF's \"auto\" values (config.hf_auto) and "
                              "passes the dict to zerospeed.initialize",
}

#: modules (or packages) allowed to read config keys of a raw dict (rule 1), and why
RAW_KEY_READERS: dict[str, str] = {
    "zerospeed.autotuning": "its output is config documents: candidate DeepSpeed configs written for experiments",
    "zerospeed.integrations": "the HF Trainer decides whether HF's optimizer / scheduler are used from the dict it "
                              "filled and hands to zerospeed.initialize (the facade, below it)",
}

#: (module, key) pairs that look like config keys but index other dicts (rule 1), and what they index
NOT_CONFIG_KEYS: dict[tuple[str, str], str] = {
    ("zerospeed.checkpoint.index", "optimizer"): "the checkpoint index's optimizer entry",
    ("zerospeed.checkpoint.loader", "optimizer"): "the checkpoint index's optimizer entry",
    ("zerospeed.inference.v1", "seed"): "generate()'s keyword arguments",
    ("zerospeed.inference.fast_path_choice", "bf16"): "the greedy-head candidates pruned by measurement",
}

#: modules (or packages) that read JSON that is not a DeepSpeed config (rule 3), and what they read
OTHER_JSON: dict[str, str] = {
    "zerospeed.autotuning": "experiment results and metrics files, tuner trial parameters",
    "zerospeed.checkpoint.index": "the checkpoint index (index.json)",
    "zerospeed.checkpoint.tensor_io": "safetensors headers",
    "zerospeed.compression.io": "the metadata of a compressed checkpoint",
    "zerospeed.inference.models.loader": "HF's model.safetensors.index.json",
    "zerospeed.inference.models.spec": "HF's config.json and generation_config.json",
    "zerospeed.inference.serving.app": "HTTP request bodies",
    "zerospeed.inference.serving.chat_template": "HF's tokenizer_config.json and special_tokens_map.json",
    "zerospeed.inference.serving.tools": "tool calls (JSON) in model replies",
    "zerospeed.inference.tokenizer": "HF's tokenizer files",
    "zerospeed.inference.serving.weight_sync": "the weight-sync manifest a trainer sends (tensor names, shapes)",
    "zerospeed.inference.v1": "DeepSpeed's checkpoint-json (init_inference(checkpoint=...)), not a config",
    "zerospeed.zero.stage3.hooks": "ZeRO-3 collective digests exchanged through the store",
    "zerospeed.zero.stage3.watchdog": "ZeRO-3 collective histories exchanged through the store",
}


def _listed(module: str, table: dict[str, str]) -> bool:
    return any(module == unit or module.startswith(unit + ".") for unit in table)


def _config_keys() -> set[str]:
    keys = set()
    for name, info in ZeroSpeedConfig.model_fields.items():
        keys.add(name)
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            keys.update(choice for choice in alias.choices if isinstance(choice, str))
        elif isinstance(alias, str):
            keys.add(alias)
    return keys


def _below_parser() -> list[str]:
    return [m for m in modules() if m != PARSER and not m.startswith(PARSER + ".")]


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _key_reads(source: ast.AST, keys: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(source):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = _literal(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop", "setdefault") and node.args:
            key = _literal(node.args[0])
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            key = _literal(node.left)
        if key in keys:
            found.append((node.lineno, key))
    return found


def _config_names(source: ast.AST) -> tuple[set[str], set[str]]:
    """Names a module binds from the config package: (functions and classes imported by name, module aliases)."""
    names, aliases = set(), set()
    for node in ast.walk(source):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PARSER or node.module.startswith(PARSER + "."):
                names.update(alias.asname or alias.name for alias in node.names)
            elif node.module == "zerospeed":
                aliases.update(alias.asname or alias.name for alias in node.names if alias.name == "config")
        elif isinstance(node, ast.Import):
            aliases.update(alias.asname for alias in node.names
                           if alias.asname and (alias.name == PARSER or alias.name.startswith(PARSER + ".")))
    return names, aliases


def _parser_calls(source: ast.AST) -> list[tuple[int, str]]:
    names, aliases = _config_names(source)
    found = []
    for node in ast.walk(source):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names and func.id[:1].islower():
            found.append((node.lineno, func.id))
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner, attr = func.value.id, func.attr
            if owner in aliases and attr[:1].islower():
                found.append((node.lineno, f"{owner}.{attr}"))
            elif owner in names and attr in ("model_validate", "model_validate_json", "model_construct"):
                found.append((node.lineno, f"{owner}.{attr}"))
    return found


def _json_reads(source: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(source)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "loads")
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"]


def _raw_attributes(source: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(source)
            if isinstance(node, ast.Attribute) and node.attr in ("raw", "_raw")]


def test_no_config_key_is_read_from_a_raw_dict_below_the_parser() -> None:
    keys = _config_keys()
    assert {"zero_optimization", "expert_parallel", "tensor_parallel", "pipeline", "compression_training"} <= keys
    reads = [f"{module_path(m)}:{line}: {key!r}" for m in _below_parser() if not _listed(m, RAW_KEY_READERS)
             for line, key in _key_reads(tree(m), keys) if (m, key) not in NOT_CONFIG_KEYS]
    assert not reads, ("config keys read from a raw dict outside config/ (take the parsed section from "
                       "ZeroSpeedConfig instead):\n" + "\n".join(reads))


def test_only_entry_points_call_the_parser() -> None:
    calls = [f"{module_path(m)}:{line}: {name}()" for m in _below_parser() if not _listed(m, ENTRY_POINTS)
             for line, name in _parser_calls(tree(m))]
    assert not calls, ("the config parser called below the facade (receive the parsed ZeroSpeedConfig or its "
                       "section instead, or list a new public entry point in ENTRY_POINTS):\n" + "\n".join(calls))


def test_no_config_file_is_opened_again() -> None:
    reads = [f"{module_path(m)}:{line}" for m in _below_parser() if not _listed(m, OTHER_JSON)
             for line in _json_reads(tree(m))]
    assert not reads, ("json.load outside config/ (a config is read by config/ only; list other JSON in "
                       "OTHER_JSON):\n" + "\n".join(reads))


def test_the_users_dict_stays_inside_the_parsed_config() -> None:
    reads = [f"{module_path(m)}:{line}" for m in _below_parser() for line in _raw_attributes(tree(m))]
    assert not reads, ("ZeroSpeedConfig.raw read outside config/ (use its typed sections, given(key) or "
                       "json_record()):\n" + "\n".join(reads))


def test_the_checks_see_what_they_are_meant_to() -> None:
    """Each scanner finds its kind of read in a sample, so an empty result above means something."""
    sample = ast.parse(textwrap.dedent("""
        import json
        from zerospeed.config import ConfigError, load_config
        from zerospeed import config as cfgmod

        def f(raw, path, parsed):
            a = raw["zero_optimization"]; b = raw.get("expert_parallel"); c = "pipeline" in raw; d = raw["other"]
            e = json.load(open(path)); g = load_config(raw); h = cfgmod.load_section(raw, "pipeline")
            raise ConfigError("", parsed.raw)
    """))
    assert sorted(k for _, k in _key_reads(sample, _config_keys())) == ["expert_parallel", "pipeline",
                                                                        "zero_optimization"]
    assert sorted(n for _, n in _parser_calls(sample)) == ["cfgmod.load_section", "load_config"]
    assert len(_json_reads(sample)) == 1 and len(_raw_attributes(sample)) == 1
