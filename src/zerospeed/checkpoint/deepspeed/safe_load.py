"""Loading DeepSpeed's pickled ``.pt`` files without executing anything from them.

DeepSpeed writes its checkpoints with ``torch.save``: tensors, containers, and a few of its own
objects. They are read here with ``torch.load(weights_only=True, mmap=True)``: torch's restricted
unpickler builds only tensors, containers and the globals allowlisted for the call. DeepSpeed's own
types are allowlisted *under their DeepSpeed names* but map to the plain stand-ins below, so
DeepSpeed need not be installed and no DeepSpeed code runs. The allowlist is what DeepSpeed 0.19.8's
save paths put in a checkpoint (engine ``_save_checkpoint`` / ``_save_zero_checkpoint`` and the
optimizers' ``state_dict``): the loss scaler objects, the ZeRO stage enum, the fragment addresses of
``param_slice_mappings``, and the offload-device enum some configs carry. Anything else (``os.system``,
``builtins.eval``, any other class) is refused with :class:`UnsafePickleError` naming the file and the
global, before it could be called.

``mmap=True`` maps the file instead of reading it: a loader touches only the pages of the tensors it
copies, so a rank never holds a whole source shard in anonymous memory.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedLayoutError, UnsafePickleError


class LossScalerState:
    """Stand-in for DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``: the attributes, nothing else."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(dict(state) if isinstance(state, dict) else {})

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""

    numel: int
    start: int

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(dict(state) if isinstance(state, dict) else {})

    def __repr__(self) -> str:
        return f"FragmentAddress(numel={getattr(self, 'numel', None)}, start={getattr(self, 'start', None)})"


def _enum_value(value: Any) -> Any:
    """Stand-in for DeepSpeed's enums (``ZeroStageEnum(2)``, ``OffloadDeviceEnum('cpu')``): the plain value."""
    if not isinstance(value, (int, str)):
        raise pickle.UnpicklingError(f"an enum built from {type(value).__name__}")
    return value


#: DeepSpeed's global name -> the stand-in the restricted unpickler builds instead.
ALLOWED_DEEPSPEED_GLOBALS: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _enum_value,
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum": _enum_value,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)|unrecognized function (\S+)|got (<[^>]+>)")


def _safe_globals() -> list[tuple[Any, str]]:
    return [(obj, name) for name, obj in ALLOWED_DEEPSPEED_GLOBALS.items()]


def load_pickle(path: str) -> Any:
    """The object in DeepSpeed ``.pt`` file ``path``, tensors memory-mapped; raises a one-line error
    naming ``path`` for a refused type, a truncated or corrupted file, or a file that is not torch's."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        text = str(e)
        match = _GLOBAL_RE.search(text)
        if any(marker in text for marker in ("GLOBAL", "unrecognized function", "allowlisted", "blocked")):
            what = next((g for g in (match.groups() if match else ()) if g), "an unknown type")
            if match is not None and match.group(1) and "." not in what:
                what = f"builtins.{what}"  # torch's message drops the module of builtins
            raise UnsafePickleError(
                f"{path}: refused to unpickle {what}: it is not one of the types DeepSpeed writes in a checkpoint "
                "(tensors, containers, its loss scaler, ZeRO stage and fragment records); nothing from the file "
                "was executed") from None
        raise DeepSpeedLayoutError(f"{path}: not a readable torch checkpoint ({_first_line(text)}): the file is "
                                   "truncated or corrupted") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        raise DeepSpeedLayoutError(f"{path}: not a readable torch checkpoint ({_first_line(str(e))}): the file is "
                                   "truncated or corrupted") from None


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return "no detail"
