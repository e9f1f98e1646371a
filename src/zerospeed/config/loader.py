"""``load_config``: DeepSpeed JSON (dict or file) in, one frozen :class:`ZeroSpeedConfig` out.

Pipeline, each step on a private deep copy (the caller's dict is never mutated):

1. read: dict as is; a path is read as strict JSON (duplicate keys refused, as DeepSpeed does);
2. :func:`~zerospeed.config.removed.reject_removed` - keys DeepSpeed itself removed;
3. :func:`~zerospeed.config.removed.drop_disabled_or_reject_unsupported` - features not built yet;
4. :mod:`~zerospeed.config.normalize` - legacy forms, alias clashes, ``"auto"``;
5. schema validation (batch triple resolved for ``dp_world_size``), then cross-section rules.

Every failure is a single :class:`ConfigError` whose one-line message names the dotted key path.
Pydantic's ``ValidationError`` never escapes: the first error is translated (``raise ... from
None`` so no pydantic traceback is chained either).

The facade (``zerospeed.initialize``) reads a config once with :func:`prepare_config`: the mesh needs the
tensor-parallel degree before the batch triple can be resolved (it depends on the data-parallel degree, world /
(pp * sp * tp)), so the ``tensor_parallel`` section is validated first, alone, and
:meth:`PreparedConfig.resolve` then builds the one :class:`ZeroSpeedConfig` of the call from the same dict.
Public entry points that take a whole DeepSpeed config but need one section of it (``init_compression``,
``zerospeed --autotuning``, AutoEP's pipeline check) use :func:`load_section`. Nothing outside config/ opens a
config file or reads a raw config dict (tests/test_config_reads.py).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import types
import typing
import warnings
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

from .batch import MBS, TBS
from .errors import ConfigError
from .fields import ZS_ERROR, ZS_KEY
from .normalize import apply_legacy_forms, merge_aliases, resolve_auto
from .removed import drop_disabled_or_reject_unsupported, reject_removed
from .schema import ZeroSpeedConfig
from .tensor_parallel import PartitionConfig, TensorParallelConfig

ConfigSource = dict[str, Any] | str | os.PathLike[str] | ZeroSpeedConfig


def load_config(config: ConfigSource, *, dp_world_size: int = 1, batch_optional: bool = False) -> ZeroSpeedConfig:
    """Parse, validate and resolve a DeepSpeed-format config for ``dp_world_size`` DP ranks.

    ``config`` is a dict, a path to a JSON file, or a :class:`ZeroSpeedConfig` (re-resolved from
    the dict it was built from, e.g. for another data-parallel world size).
    ``batch_optional``: a dict that names neither ``train_batch_size`` nor
    ``train_micro_batch_size_per_gpu`` gets a micro-batch of 1 (for callers the batch sizes do not
    matter to, e.g. ``zero.Init``).
    Raises :class:`ConfigError` (one line, naming the key path) for any problem.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError("", f"dp_world_size={dp_world_size!r} is not a positive integer")
    if batch_optional and isinstance(config, dict) and not any(k in config for k in (TBS, MBS)):
        config = {**copy.deepcopy(config), MBS: 1}
    raw = read_config_source(config)
    if not isinstance(raw, dict):
        raise ConfigError("", f"the top level must be a JSON object, got {type(raw).__name__}")

    work = copy.deepcopy(raw)
    _drop_dotted_section_keys(work)
    reject_removed(work)
    drop_disabled_or_reject_unsupported(work)
    apply_legacy_forms(work)
    merge_aliases(work)
    auto_batch_keys = resolve_auto(work)
    context = {"dp_world_size": dp_world_size, "auto_keys": auto_batch_keys}
    try:
        resolved = ZeroSpeedConfig.model_validate(work, context=context)
    except ValidationError as exc:
        raise translate_validation_error(exc) from None
    resolved._raw = raw
    resolved._dp_world_size = dp_world_size
    return resolved


def _drop_dotted_section_keys(work: dict[str, Any]) -> None:
    """Top-level keys written as a dotted path into a section (``"zero_optimization.reduce_bucket_size"``): TRL's
    ``prepare_deepspeed`` passes them to ``deepspeed.initialize`` for its reference and reward models. DeepSpeed
    0.19.8 reads only its top-level names, so it never sees them and they change nothing; zerospeed drops them the
    same way, with a warning naming them (any other unknown key stays an error)."""
    sections = ZeroSpeedConfig.model_fields
    dotted = [k for k in work if isinstance(k, str) and "." in k and k.split(".", 1)[0] in sections]
    for key in dotted:
        del work[key]
    if dotted:
        warnings.warn(f"zerospeed config: top-level key(s) {', '.join(map(repr, dotted))} ignored, as DeepSpeed "
                      f"ignores them: a dotted name is not a path into a section (write it inside the section to "
                      f"set it)", UserWarning, stacklevel=3)


def read_config_source(config: ConfigSource) -> Any:
    """The user's config as a fresh dict: a dict is deep-copied, a path read as strict JSON (duplicate keys
    refused), a :class:`ZeroSpeedConfig` gives the dict it was built from. The top level is not checked here."""
    if isinstance(config, ZeroSpeedConfig):
        return config.raw
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        return _read_json(Path(config).expanduser())
    raise ConfigError("", f"expected a dict, a JSON file path or a ZeroSpeedConfig, got {type(config).__name__}")


def load_section(config: ConfigSource, name: str) -> Any:
    """One top-level section of a DeepSpeed config, validated by the whole parser (removed keys, aliases,
    ``"auto"``) without resolving the batch triple; the schema's default when the config has no such key.

    For public entry points that take a whole config but use one section of it (``init_compression``,
    ``zerospeed --autotuning``, AutoEP's pipeline check). Errors name ``<name>.<key>``.
    """
    if name not in ZeroSpeedConfig.model_fields:
        raise ValueError(f"load_section: {name!r} is not a section of ZeroSpeedConfig")
    if isinstance(config, ZeroSpeedConfig):
        return getattr(config, name)
    raw = read_config_source(config)
    if not isinstance(raw, dict):
        raise ConfigError("", f"the top level must be a JSON object, got {type(raw).__name__}")
    alone: dict[str, Any] = {TBS: 1}
    if name in raw:
        alone[name] = raw[name]
    return getattr(load_config(alone), name)


class PreparedConfig:
    """A DeepSpeed config read once by the facade, before the mesh exists.

    :attr:`tensor_parallel` is validated now (the mesh needs its degree); :meth:`resolve` builds the call's one
    :class:`ZeroSpeedConfig` for the data-parallel degree the mesh gives. The dict never leaves config/.
    """

    def __init__(self, config: ConfigSource) -> None:
        self._source: Any = config if isinstance(config, ZeroSpeedConfig) else read_config_source(config)
        if not isinstance(self._source, (dict, ZeroSpeedConfig)):
            raise ConfigError("", f"the top level must be a JSON object, got {type(self._source).__name__}")
        self.tensor_parallel: TensorParallelConfig = tensor_parallel_of(self._source)

    def section(self, name: str) -> Any:
        """One more section before :meth:`resolve` (see :func:`load_section`)."""
        return load_section(self._source, name)

    def resolve(self, dp_world_size: int) -> ZeroSpeedConfig:
        """The whole config, validated and resolved for ``dp_world_size`` data-parallel ranks."""
        return load_config(self._source, dp_world_size=dp_world_size)


def prepare_config(config: ConfigSource) -> PreparedConfig:
    """Read the user's config (dict, JSON path or :class:`ZeroSpeedConfig`) once; see :class:`PreparedConfig`."""
    return PreparedConfig(config)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r} in one JSON object")
        result[key] = value
    return result


def _read_json(path: Path) -> Any:
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(where, "no such file") from None
    except IsADirectoryError:
        raise ConfigError(where, "is a directory, expected a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(where, f"cannot read: {_one_line(str(exc))}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        problem = f"invalid JSON at line {exc.lineno}:{exc.colno}: {exc.msg}"
        raise ConfigError(where, problem) from None
    except ValueError as exc:
        raise ConfigError(where, f"invalid JSON: {exc}") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _show(value: Any, limit: int = 80) -> str:
    shown = _one_line(repr(value))
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (unwrapping Optional/Union/Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def _field_keys(model: type[BaseModel]) -> dict[str, str]:
    """Every accepted key of ``model`` (names and aliases) -> field name."""
    keys: dict[str, str] = {}
    for name, info in model.model_fields.items():
        keys[name] = name
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            keys.update({choice: name for choice in alias.choices if isinstance(choice, str)})
        elif isinstance(alias, str):
            keys[alias] = name
    return keys


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = ZeroSpeedConfig
    for part in loc:
        if model is None:
            return None
        field = _field_keys(model).get(part)
        if field is None:
            return None
        model = _section_model(model.model_fields[field].annotation)
    return model


def _unknown_key_problem(loc: list[str]) -> str:
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown key"
    close = difflib.get_close_matches(loc[-1], list(_field_keys(model)), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    where = f"in '{'.'.join(loc[:-1])}'" if len(loc) > 1 else "at the top level"
    return f"unknown key (not a DeepSpeed or zerospeed key {where})"


def translate_validation_error(exc: ValidationError) -> ConfigError:
    """The first error of a pydantic ``ValidationError`` as one :class:`ConfigError`."""
    error = exc.errors(include_url=False)[0]
    # pydantic inserts union-member tags such as "function-before[...]" into loc; drop them
    loc = [str(part) for part in error["loc"] if "[" not in str(part)]
    ctx = error.get("ctx") or {}
    kind = error["type"]
    value = error.get("input")
    if kind == "value_error" and isinstance(ctx.get("error"), ConfigError):
        return ctx["error"]
    if kind == ZS_ERROR:
        if ctx.get(ZS_KEY):
            loc += str(ctx[ZS_KEY]).split(".")
        problem = error["msg"]
    elif kind == "extra_forbidden":
        problem = _unknown_key_problem(loc)
    elif kind == "missing":
        problem = "required key is missing"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        problem = f"{_show(value)} is not a JSON object"
    elif kind in ("tuple_type", "list_type", "iterable_type"):
        problem = f"{_show(value)} is not a JSON list"
    elif kind == "literal_error":
        problem = f"{_show(value)} is not one of {ctx.get('expected', '')}"
    else:
        problem = f"{_show(value)} is not valid: {error['msg']}"
    return ConfigError(".".join(loc), _one_line(problem))


def parse_tensor_parallel(section: Any) -> TensorParallelConfig:
    """A ``tensor_parallel`` section given outside a full config (``auto_tp(partition_config=...)``).

    Accepts a :class:`TensorParallelConfig`, a :class:`PartitionConfig` (wrapped), or a dict that is
    either a whole ``tensor_parallel`` section or just its ``partition_config`` (it has
    ``layer_specs``). Errors are :class:`ConfigError` naming ``tensor_parallel.<key>``.
    """
    if section is None:
        return TensorParallelConfig()
    if isinstance(section, TensorParallelConfig):
        return section
    if isinstance(section, PartitionConfig):
        return TensorParallelConfig(partition_config=section)
    if not isinstance(section, dict):
        raise ConfigError("tensor_parallel.partition_config", f"{type(section).__name__} is not a JSON object")
    if "layer_specs" in section or "use_default_specs" in section or "lm_head_patterns" in section:
        section = {"partition_config": section}
    try:
        return TensorParallelConfig.model_validate(section)
    except ValidationError as exc:
        err = translate_validation_error(exc)
        raise ConfigError(f"tensor_parallel.{err.key_path}".rstrip("."), err.problem) from None


def tensor_parallel_of(config: Any) -> TensorParallelConfig:
    """Only the ``tensor_parallel`` section of a config (dict, JSON path or parsed config).

    ``initialize`` needs the tp degree *before* the batch sizes can be resolved (they depend on the
    data-parallel degree, which is world / (pp * tp)), so this reads that one section alone.
    """
    if isinstance(config, ZeroSpeedConfig):
        return config.tensor_parallel
    if isinstance(config, (str, Path)):
        config = _read_json(Path(config))
    if not isinstance(config, dict):
        return TensorParallelConfig()
    return parse_tensor_parallel(config.get("tensor_parallel") or {})
