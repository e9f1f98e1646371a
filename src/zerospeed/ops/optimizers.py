"""Build the optimizer named in DeepSpeed's ``"optimizer": {"type", "params"}`` from torch pieces.

Types (case-insensitive): ``Adam``, ``AdamW``, ``SGD``, ``Adagrad`` (torch's implementations) and
``Lamb`` (:class:`zerospeed.ops.lamb.Lamb`).

DeepSpeed facts this follows (``deepspeed/runtime/engine.py`` ``_configure_basic_optimizer`` and
``deepspeed/runtime/config.py``, DeepSpeed master, read with the search tool):

* ``Adam`` means **AdamW** unless the config says ``"adam_w_mode": false``: config.py has
  ``ADAM_W_MODE_DEFAULT = True`` ("default to adamw logic for adam/adamw optimizers unless user
  explicitly opts out"), and the engine computes
  ``effective_adam_w_mode = name == "adamw" or adam_w_mode``; so ``AdamW`` is decoupled whatever
  ``adam_w_mode`` says, and only ``Adam`` + ``adam_w_mode: false`` gives L2-coupled Adam.
* ``torch_adam: true`` makes DeepSpeed build ``torch.optim.Adam/AdamW`` with the config params
  as given, so torch's defaults apply (``AdamW`` weight_decay 0.01). Otherwise DeepSpeed builds
  its ``FusedAdam`` / ``DeepSpeedCPUAdam``, whose defaults are ``lr=1e-3, betas=(0.9, 0.999),
  eps=1e-8, weight_decay=0``; zerospeed passes those explicitly, so a config without
  ``weight_decay`` gets 0 here as in DeepSpeed, not torch AdamW's 0.01.
* ``bias_correction`` and ``set_grad_none`` are FusedAdam parameters (default True). Torch's Adam
  always bias-corrects and the engine always sets grads to None, so only ``true`` is accepted.
* ``SGD`` and ``Adagrad`` go to ``torch.optim`` with the params as given (torch's names and
  defaults); ``Lamb`` is DeepSpeed's ``FusedLamb`` (see :mod:`zerospeed.ops.lamb`).
* ``max_grad_norm`` in optimizer params is rejected by DeepSpeed's engine for every optimizer
  ("use gradient_clipping"); zerospeed rejects it the same way, with the same advice.

Beyond DeepSpeed's own names, any keyword of the torch class (``maximize``, ``foreach``, ``fused``,
``lr_decay``...) is accepted, since DeepSpeed passes the params straight to torch in those cases.

Implementation choice, measured on this project's 2-core CPU box (torch 2.13+cpu, 2 threads,
10.5 M fp32 elements in 26 tensors of 1024x1024 / 512x512 / vectors, all grads set, 3 warm-up
steps then the median of 15 ``step()`` calls, machine load ~1.8)::

                  for-loop   foreach   fused
        Adam        28.2       40.5      8.2
        AdamW       34.8       39.7      7.9
        SGD(mom)    10.3       11.9      6.2
        Adagrad     14.7       32.1      5.7

Fused is 1.7-5x faster than both, and foreach is *slower* than the for-loop on CPU (a rerun under
heavy load from other jobs kept the order for Adam, AdamW and Adagrad, fused 3-9x ahead). So for SGD
and Adagrad, when every parameter is a floating tensor on CPU or CUDA the factory passes
``fused=True``; otherwise it leaves the choice to torch. An explicit ``fused`` or ``foreach`` in the
params wins.

Adam and AdamW: which implementation runs is the ``adam_kernel`` fast path (issue #25), taken from
the config's ``fast_paths`` section: a forced family (``forloop``, ``foreach``, ``fused``) is passed
as torch's flags (checked first: one that cannot run on the parameters' device is an error naming
``fast_paths.adam_kernel``; one that contradicts an explicit ``optimizer.params.fused``/``foreach``
is an error naming both); ``auto`` attaches an :class:`~zerospeed.ops.adam.kernel_choice.AdamKernelSwitch`
that times the three on the tensors the optimizer updates - at the first step, or at engine start-up
(the engine settles it once ZeRO has put its shards in the groups). Explicit flags with ``auto`` win.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed.config.errors import ConfigError
from zerospeed.ops.adam.kernel_choice import attach_switch, check_forced, kernel_of_flags, resolve_kernel_setting
from zerospeed.ops.fast_paths import FastPathError
from zerospeed.ops.lamb import Lamb
from zerospeed.ops import muon as _muon
from zerospeed.ops.lion import Lion
from zerospeed.ops.onebit_adam import OneBitAdam
from zerospeed.ops.onebit_lamb import OneBitLamb
from zerospeed.ops.zero_one_adam import ZeroOneAdam
from zerospeed.ops.mup import MU_OPTIMIZERS, mu_param_groups

__all__ = ["build_optimizer", "resolve_client_optimizer", "OPTIMIZERS"]

_FUSED_DEVICE_TYPES = ("cpu", "cuda")

# DeepSpeed's FusedAdam / DeepSpeedCPUAdam defaults (what DeepSpeed builds unless torch_adam).
_DEEPSPEED_ADAM_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@dataclass(frozen=True)
class _OptimizerSpec:
    """One optimizer type: its canonical name and the parameter names it accepts."""

    name: str
    torch_classes: tuple[type[torch.optim.Optimizer], ...]
    deepspeed_only: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()

    def allowed(self) -> list[str]:
        names: list[str] = []
        for cls in self.torch_classes:
            for n in inspect.signature(cls.__init__).parameters:
                if n not in ("self", "params") and n not in self.excluded and n not in names:
                    names.append(n)
        return names + [n for n in self.deepspeed_only if n not in names]


#: registry, keyed by lower-case type name.
OPTIMIZERS: dict[str, _OptimizerSpec] = {
    "adam": _OptimizerSpec(
        "Adam",
        (torch.optim.Adam, torch.optim.AdamW),
        deepspeed_only=("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none"),
        excluded=("decoupled_weight_decay",),  # adam_w_mode is the DeepSpeed spelling
    ),
    "adamw": _OptimizerSpec(
        "AdamW",
        (torch.optim.Adam, torch.optim.AdamW),
        deepspeed_only=("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none"),
        excluded=("decoupled_weight_decay",),
    ),
    "sgd": _OptimizerSpec("SGD", (torch.optim.SGD,)),
    "adagrad": _OptimizerSpec("Adagrad", (torch.optim.Adagrad,)),
    "lamb": _OptimizerSpec("Lamb", (Lamb,), excluded=("max_grad_norm",)),
    "lion": _OptimizerSpec("Lion", (Lion,)),
    "muadam": _OptimizerSpec("MuAdam", (torch.optim.Adam,)),
    "muadamw": _OptimizerSpec("MuAdamW", (torch.optim.AdamW,)),
    "musgd": _OptimizerSpec("MuSGD", (torch.optim.SGD,)),
    "onebitadam": _OptimizerSpec("OneBitAdam", (OneBitAdam,), excluded=("group",)),  # ZeRO-0 only (zero/strategy)
    "zerooneadam": _OptimizerSpec("ZeroOneAdam", (ZeroOneAdam,), excluded=("group", "max_grad_norm")),  # ZeRO-0 only
    "onebitlamb": _OptimizerSpec("OneBitLamb", (OneBitLamb,), excluded=("group", "max_grad_norm")),  # ZeRO-0 only
    "muon": _OptimizerSpec("Muon", (), deepspeed_only=("lr", "momentum", "weight_decay", "ns_method", "muon_lr",
                                                       "adam_lr", "betas", "eps", "adam_w_mode", "variant",
                                                       "ns_dtype")),
}

_ONEBIT = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
_ONEBIT_CLASSES = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}
#: the arguments a 1-bit optimizer's ValueError may name (first match is the config key reported)
_ONEBIT_KEYS = ("freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                "comm_backend_name", "amsgrad", "eps_inside_sqrt", "betas", "min_coeff", "factor_min", "coeff_beta",
                "factor_threshold")

_NON_NEGATIVE = ("lr", "muon_lr", "adam_lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value",
                 "max_coeff", "min_coeff")  # fmt: skip
_BOOLEAN = ("amsgrad", "nesterov", "maximize", "foreach", "fused", "capturable", "differentiable", "adam_w_mode",
            "torch_adam", "bias_correction", "set_grad_none", "eps_inside_sqrt")  # fmt: skip


def _key(name: str) -> str:
    return f"optimizer.params.{name}"


def _check_values(spec: _OptimizerSpec, params: Mapping[str, Any]) -> None:
    """Reject unknown names and bad values, naming ``optimizer.params.<name>``."""
    allowed = spec.allowed()
    for name, value in params.items():
        if name == "max_grad_norm":
            raise ConfigError(
                _key(name), "not supported as an optimizer parameter (as in DeepSpeed); use the top-level "
                "'gradient_clipping' instead",
            )
        if spec.name == "Muon" and name == "per_head_muon" and value:
            raise ConfigError(_key(name), "true is not supported by zerospeed yet (DeepSpeed 0.19's per-attention-"
                              "head Newton-Schulz); leave it false or unset")
        if spec.name == "Muon" and name == "per_head_muon":
            continue
        if name not in allowed:
            raise ConfigError(_key(str(name)), f"unknown parameter for {spec.name}; allowed: {', '.join(allowed)}")
        if name in _BOOLEAN and not (isinstance(value, bool) or (name in ("foreach", "fused") and value is None)):
            raise ConfigError(_key(name), f"{value!r} is not a boolean")
        if name in _NON_NEGATIVE and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
        ):
            raise ConfigError(_key(name), f"{value!r} must be a finite number >= 0")
        if name == "betas":
            ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
                not isinstance(b, bool) and isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in value
            )
            if not ok:
                raise ConfigError(_key(name), f"{value!r} must be two numbers in [0, 1)")
    for name in ("bias_correction", "set_grad_none"):
        if spec.name not in ("Lamb",) + _ONEBIT and params.get(name) is False:
            raise ConfigError(_key(name), f"false is not supported: torch's {spec.name} always does this")
    if spec.name == "Lamb" and params.get("amsgrad") is True:
        raise ConfigError(_key("amsgrad"), "Lamb has no AMSGrad variant (DeepSpeed's FusedLamb refuses it too)")
    _check_choice(params, "ns_method", _muon.NS_METHODS)
    _check_choice(params, "ns_dtype", tuple(_muon.NS_DTYPES))
    _check_choice(params, "variant", _muon.VARIANTS)
    if spec.name == "Muon" and "momentum" in params and not params["momentum"] < 1:
        raise ConfigError(_key("momentum"), f"{params['momentum']!r} must be in [0, 1)")
    if "min_coeff" in params or "max_coeff" in params:
        lo, hi = params.get("min_coeff", 0.01), params.get("max_coeff", 10.0)
        if lo > hi:
            raise ConfigError(_key("min_coeff"), f"{lo} is larger than max_coeff ({hi})")


def _check_choice(params: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> None:
    if name in params and params[name] not in allowed:
        raise ConfigError(_key(name), f"{params[name]!r} is not one of {', '.join(repr(a) for a in allowed)}")


def _muon_groups(groups: list[Any], params: Mapping[str, Any], names: Mapping[int, str] | None,
                 shapes: Mapping[int, tuple[int, ...]] | None = None) -> list[dict[str, Any]]:
    """Split each incoming group into its Muon and Adam halves (DeepSpeed's ``_muon_param_groups``):
    the config's shared values, then ``muon_lr`` / ``adam_lr``, then the group's own keys."""
    if names is None:
        raise ConfigError("optimizer.type", "'Muon' needs the model's parameter names to tag them (embeddings "
                          "and the LM head go to Adam); this entry point does not pass the model")
    dicts: list[dict[str, Any]] = []
    loose: list[Any] = []
    for item in groups:
        (dicts if isinstance(item, dict) else loose).append(item)
    if loose or not dicts:
        dicts.append({"params": [t[1] if isinstance(t, tuple) else t for t in loose]})
    for d in dicts:
        d["params"] = [d["params"]] if isinstance(d["params"], torch.Tensor) else list(d["params"])
    flags = _muon.tag_use_muon(dicts, names, shapes)
    halves = ((True, _muon.MUON_KEYS, "muon_lr", "muon"), (False, _muon.ADAM_KEYS, "adam_lr", "adam"))
    settings_keys = set(_muon.MUON_KEYS) | set(_muon.ADAM_KEYS)
    out: list[dict[str, Any]] = []
    for d, on_muon in zip(dicts, flags):
        own = {k: v for k, v in d.items() if k not in ("params", "use_muon")}
        for use_muon, keys, lr_key, label in halves:
            half = [p for p, f in zip(d["params"], on_muon) if f is use_muon]
            if not half:
                continue
            settings = {k: params[k] for k in keys if k in params}
            if lr_key in params:
                settings["lr"] = params[lr_key]
            # the group's own settings for this half, and its other keys (MoE's "moe", "name") as they are
            settings.update({k: v for k, v in own.items() if k in keys or k not in settings_keys})
            if "name" in own:  # two halves of one named group (MoE regrouping keys by name): DeepSpeed's names
                settings["name"] = f"{own['name']}-{label}-params"
            out.append({"params": half, "use_muon": use_muon, **settings})
    return out


def _tensors(groups: list[Any]) -> list[torch.Tensor]:
    """Every tensor in torch-style param groups (tensors, (name, tensor) pairs, or dicts)."""
    out: list[torch.Tensor] = []
    for item in groups:
        if isinstance(item, dict):
            inner = item.get("params", [])
            items = [inner] if isinstance(inner, torch.Tensor) else list(inner)
            out.extend(t[1] if isinstance(t, tuple) else t for t in items)
        elif isinstance(item, tuple):
            out.append(item[1])
        else:
            out.append(item)
    return out


def _pick_implementation(kwargs: dict[str, Any], groups: list[Any]) -> None:
    """Ask for fused kernels where they exist and were measured fastest (see module docstring)."""
    if "fused" in kwargs or "foreach" in kwargs or kwargs.get("differentiable"):
        return
    tensors = _tensors(groups)
    if tensors and all(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type in _FUSED_DEVICE_TYPES
        for t in tensors
    ):
        kwargs["fused"] = True


def _materialise(param_groups: Iterable[Any]) -> list[Any]:
    # param groups may be a generator (model.parameters()); the dict items are copied so
    # inspecting them never consumes an inner generator the optimizer still needs.
    groups = []
    for item in param_groups:
        if isinstance(item, dict):
            item = dict(item)
            if not isinstance(item.get("params"), torch.Tensor) and "params" in item:
                item["params"] = list(item["params"])
        groups.append(item)
    return groups


_KERNEL_KEY = "fast_paths.adam_kernel"


def _adam_with_kernel(cls: type[torch.optim.Optimizer], groups: list[Any], kwargs: dict[str, Any],
                      fast_paths: Any) -> torch.optim.Optimizer:
    """torch's Adam/AdamW with the ``adam_kernel`` switch applied (see the module docstring)."""
    try:
        setting = resolve_kernel_setting(getattr(fast_paths, "adam_kernel", "auto"), _KERNEL_KEY)
        explicit = kernel_of_flags(kwargs.get("foreach"), kwargs.get("fused"))
        if setting == "auto":
            opt = cls(groups, **kwargs)
            if explicit is None and not kwargs.get("differentiable"):
                attach_switch(opt, "auto", _KERNEL_KEY)
            return opt
        if explicit is not None and explicit != setting:
            flag = "fused" if kwargs.get("fused") else "foreach"
            raise ConfigError(_KERNEL_KEY, f"{setting!r} conflicts with optimizer.params.{flag}: "
                              f"{str(kwargs.get(flag)).lower()}; set one")
        check_forced(setting, _tensors(groups), _KERNEL_KEY)
        opt = cls(groups, **{**kwargs, "fused": setting == "fused" or None, "foreach": setting == "foreach"})
        attach_switch(opt, setting, _KERNEL_KEY)
        return opt
    except FastPathError as exc:
        raise ConfigError(_KERNEL_KEY, str(exc).removeprefix(_KERNEL_KEY + ": ")) from None


def build_optimizer(
    type_name: str, params: Mapping[str, Any], param_groups: Iterable[Any], fast_paths: Any = None,
    names: Mapping[int, str] | None = None, shapes: Mapping[int, tuple[int, ...]] | None = None,
) -> torch.optim.Optimizer:
    """Build ``optimizer.type`` with ``optimizer.params`` over ``param_groups`` (torch convention).

    ``fast_paths`` is the config's :class:`~zerospeed.config.FastPathsConfig` (``adam_kernel``);
    None means ``auto``. ``names`` (``id(param) -> name``) and ``shapes`` (``id(param) -> layer shape``
    where a zero.Init placeholder's own shape is not it) are what Muon's tagging reads.

    Raises:
        ConfigError: ``optimizer.type`` for an unknown type (with the nearest name),
            ``optimizer.params.<name>`` for an unknown or bad parameter.
    """
    if not isinstance(type_name, str):
        raise ConfigError("optimizer.type", f"{type_name!r} is not a string")
    spec = OPTIMIZERS.get(type_name.lower())
    torch_cls = _torch_optimizer(type_name) if spec is None else None
    if torch_cls is not None:
        return _torch_fallback(torch_cls, params, _materialise(param_groups))
    if spec is None:
        known = [s.name for s in OPTIMIZERS.values()]
        close = difflib.get_close_matches(type_name.lower(), list(OPTIMIZERS), n=1, cutoff=0.5)
        hint = f"; did you mean {OPTIMIZERS[close[0]].name!r}?" if close else ""
        raise ConfigError("optimizer.type", f"unknown optimizer {type_name!r}{hint} (allowed: {', '.join(known)})")
    _check_values(spec, params)
    groups = _materialise(param_groups)
    kwargs = dict(params)

    if spec.name in ("Adam", "AdamW"):
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        torch_adam = kwargs.pop("torch_adam", False)
        kwargs.pop("bias_correction", None)
        kwargs.pop("set_grad_none", None)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        if not torch_adam:
            kwargs = {**_DEEPSPEED_ADAM_DEFAULTS, **kwargs}
        cls: type[torch.optim.Optimizer] = (
            torch.optim.AdamW if spec.name == "AdamW" or adam_w_mode else torch.optim.Adam
        )
        return _adam_with_kernel(cls, groups, kwargs, fast_paths)
    if spec.name == "Muon":
        # the auxiliary Adam is Muon's own (DeepSpeed's inline adam_update), not fast_paths.adam_kernel:
        # the same arithmetic on whole tensors and on ZeRO shards
        kwargs.pop("per_head_muon", None)
        return _muon.Muon(_muon_groups(groups, kwargs, names, shapes), adam_w_mode=kwargs.get("adam_w_mode", True),
                          variant=kwargs.get("variant", "deepspeed"))
    if spec.name in MU_OPTIMIZERS:
        cls = MU_OPTIMIZERS[spec.name]
        full = {"lr": inspect.signature(cls.__init__).parameters["lr"].default, **kwargs}
        if "betas" in full:
            full["betas"] = tuple(full["betas"])
        dicts = [g for g in groups if isinstance(g, dict)]
        loose = [g[1] if isinstance(g, tuple) else g for g in groups if not isinstance(g, dict)]
        if loose or not dicts:
            dicts.append({"params": loose})
        return cls(mu_param_groups(spec.name, dicts, full, names), **full)
    if spec.name == "Lion":
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return Lion(groups, **kwargs)
    if spec.name in _ONEBIT:  # issue #28: the 1-bit family, its own communication after its warm-up
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        try:
            return _ONEBIT_CLASSES[spec.name](groups, **kwargs)
        except ValueError as exc:
            found = [(m.start(), k) for k in _ONEBIT_KEYS for m in [re.search(rf"\b{k}\b", str(exc))] if m]
            key = min(found)[1] if found else "type"  # the argument the message names first
            raise ConfigError(_key(key) if key != "type" else "optimizer.type", str(exc)) from None
    if spec.name == "Lamb":
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return Lamb(groups, **kwargs)
    torch_cls = spec.torch_classes[0]
    _pick_implementation(kwargs, groups)
    return torch_cls(groups, **kwargs)


#: torch.optim classes the fallback refuses, with why
_TORCH_REFUSED = {
    "LBFGS": "it needs a closure that re-evaluates the model, and engine.step() has none",
    "SparseAdam": "it needs sparse gradients, and zerospeed's gradient buckets are dense",
}


def _torch_optimizer(name: str) -> type[torch.optim.Optimizer] | None:
    """DeepSpeed's fallback ``getattr(torch.optim, name)`` (matched case-insensitively here)."""
    for attr in dir(torch.optim):
        cls = getattr(torch.optim, attr)
        if attr.lower() == name.lower() and isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) \
                and cls is not torch.optim.Optimizer:
            return cls
    return None


def _torch_fallback(cls: type[torch.optim.Optimizer], params: Mapping[str, Any], groups: list[Any]
                    ) -> torch.optim.Optimizer:
    """``torch.optim.<name>(groups, **params)``, its keywords checked against the class's own signature."""
    name = cls.__name__
    if name in _TORCH_REFUSED:
        raise ConfigError("optimizer.type", f"{name!r}: torch.optim.{name} cannot run under zerospeed's engine: "
                          f"{_TORCH_REFUSED[name]}")
    allowed = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
    for key in params:
        if key == "max_grad_norm":
            raise ConfigError(_key(key), "not supported as an optimizer parameter (as in DeepSpeed); use the "
                              "top-level 'gradient_clipping' instead")
        if key not in allowed:
            raise ConfigError(_key(str(key)), f"unknown parameter for torch.optim.{name}; allowed: "
                              f"{', '.join(allowed)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    try:
        return cls(groups, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError("optimizer.params", f"torch.optim.{name} refused them: {exc}") from None


def resolve_client_optimizer(
    optimizer_or_callable: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer],
    param_groups: Iterable[Any],
) -> torch.optim.Optimizer:
    """The optimizer a user passed to ``initialize(optimizer=...)``.

    An ``Optimizer`` instance is returned as is; a callable (an optimizer class, a
    ``functools.partial``, a factory function) is called with ``param_groups``, as DeepSpeed does
    for ``Callable[[params], Optimizer]``. The result must be a ``torch.optim.Optimizer``.
    """
    if isinstance(optimizer_or_callable, torch.optim.Optimizer):
        return optimizer_or_callable
    if not callable(optimizer_or_callable):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a callable returning one, got "
            f"{type(optimizer_or_callable).__name__}"
        )
    built = optimizer_or_callable(param_groups)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
    return built
