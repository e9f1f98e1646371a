"""Parameters a module's forward reads from its submodules without calling them.

ZeRO-3 gathers a module's parameters around its own forward. Some forwards read a child's
parameter directly: ``nn.MultiheadAttention`` passes ``self.out_proj.weight`` / ``.bias`` to
``F.multi_head_attention_forward`` and never calls ``out_proj``; ``nn.TransformerEncoderLayer``'s
inference fast path reads every child's weights the same way. Two answers:

* torch's own modules that do this (:data:`READS_CHILD_PARAMETERS`) are detected automatically:
  their plan includes every descendant's parameters, so the parent's forward (and its backward)
  gathers them; the children still gather their own when they are called.
* for any other module, a forward that fails is examined (:func:`explain_forward_error`): the
  innermost module of the failing forward is taken from the traceback, and when parameters of its
  submodules were not gathered at that moment, the error names them and
  ``zerospeed.zero.register_external_parameter``, chaining the original error.
"""

from __future__ import annotations

from types import TracebackType
from typing import Callable

from torch import nn

#: torch modules whose forward reads parameters of their submodules directly
READS_CHILD_PARAMETERS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer)


def implicit_externals(module: nn.Module) -> list[nn.Parameter]:
    """Descendants' parameters ``module``'s forward reads without calling the descendant."""
    if not isinstance(module, READS_CHILD_PARAMETERS):
        return []
    own = {id(p) for p in module.parameters(recurse=False)}
    return [p for p in module.parameters() if id(p) not in own]


def _innermost_module(tb: TracebackType | None, names: dict[int, str]) -> nn.Module | None:
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, nn.Module) and id(candidate) in names:
            found = candidate
        tb = tb.tb_next
    return found


def explain_forward_error(root: nn.Module, error: BaseException, is_gathered: Callable[[nn.Parameter], bool | None],
                          plan_params: Callable[[nn.Module], set[int]]) -> str | None:
    """A message naming the ungathered submodule parameters of the module whose forward raised, or
    None when that is not the likely cause. ``is_gathered(p)`` is None for unmanaged parameters."""
    names = {id(m): n for n, m in root.named_modules()}
    module = _innermost_module(error.__traceback__, names)
    if module is None:
        return None
    prefix = names[id(module)]
    planned = plan_params(module)
    missing = []
    for pname, p in module.named_parameters():
        if "." not in pname or id(p) in planned:  # its own parameters are gathered with it
            continue
        if is_gathered(p) is False:
            missing.append(f"{prefix}.{pname}" if prefix else pname)
    if not missing:
        return None
    shown = ", ".join(repr(m) for m in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    label = prefix or "<root>"
    return (f"ZeRO-3: the forward of module '{label}' ({type(module).__name__}) failed while parameter(s) {shown} "
            f"of its submodules were not gathered: a forward that reads a submodule's parameter without calling "
            f"the submodule must declare it with zerospeed.zero.register_external_parameter(module, parameter) "
            f"(original error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
