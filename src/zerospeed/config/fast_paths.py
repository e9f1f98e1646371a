"""``fast_paths``: zerospeed's switches for hardware-specific fast paths (issue #25; not a DeepSpeed key).

Each fast path is one of several implementations of the same operation; ``auto`` (the default of
every switch) lets zerospeed time the candidates once per process on the shapes they serve and keep
the plain one unless another is clearly faster (:mod:`zerospeed.ops.fast_paths`); any other value
forces that candidate, and a forced candidate that cannot run on the machine is an error naming the
key. The environment variable ``ZEROSPEED_FAST_PATHS`` (``"adam_kernel=fused,direct_io=off"``) sets
the switches a config leaves at ``auto``.

* ``adam_kernel`` - ``forloop`` | ``foreach`` | ``fused``: which of torch's Adam/AdamW
  implementations runs the optimizer built from the config, the offloaded optimizer step and CPU Adam;
* ``direct_io`` - ``off`` | ``on``: O_DIRECT for the NVMe offload files (``on`` fails, naming the
  folder, where the file system refuses O_DIRECT);
* ``block_quant`` - ``torch`` | ``c``: ZeRO++'s block quantizer (qwZ / qgZ), torch or its bit-identical C twin;
* ``cpu_kernels`` - ``off`` | ``on``: zerospeed's C decode kernels (inference);
* ``greedy_head`` - ``float32`` | ``bf16`` | ``int8``: the LM head of greedy decoding (inference);
* ``packed_linear`` - ``off`` | ``on``: float32 linears and LM head through oneDNN on weights packed once (inference).

The last three are read by the inference engine when a training config is also used for generation;
here they are validated only.

The allowed values are the chooser's (:data:`zerospeed.ops.fast_paths.PATHS`; a test keeps the two
lists equal, since config/ imports nothing above it). Values are case-sensitive strings, as the
``ZEROSPEED_FAST_PATHS`` variable and the ``zerospeed serve`` flags take them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from .fields import Section, fail

#: every switch and its values, ``auto`` first, then the reference (plain) candidate
SETTINGS: dict[str, tuple[str, ...]] = {
    "adam_kernel": ("auto", "forloop", "foreach", "fused"),
    "direct_io": ("auto", "off", "on"),
    "block_quant": ("auto", "torch", "c"),
    "cpu_kernels": ("auto", "off", "on"),
    "greedy_head": ("auto", "float32", "bf16", "int8"),
    "packed_linear": ("auto", "off", "on"),
}


def _setting(name: str) -> Any:
    allowed = SETTINGS[name]

    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise fail(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return Annotated[str, BeforeValidator(check)]


class FastPathsConfig(Section):
    """``fast_paths``: one switch per hardware-specific fast path (see the module docstring)."""

    adam_kernel: _setting("adam_kernel") = "auto"  # type: ignore[valid-type]
    direct_io: _setting("direct_io") = "auto"  # type: ignore[valid-type]
    block_quant: _setting("block_quant") = "auto"  # type: ignore[valid-type]
    cpu_kernels: _setting("cpu_kernels") = "auto"  # type: ignore[valid-type]
    greedy_head: _setting("greedy_head") = "auto"  # type: ignore[valid-type]
    packed_linear: _setting("packed_linear") = "auto"  # type: ignore[valid-type]

    def settings(self) -> dict[str, str]:
        """``{switch: value}`` as written (``auto`` where unset)."""
        return {name: getattr(self, name) for name in SETTINGS}
