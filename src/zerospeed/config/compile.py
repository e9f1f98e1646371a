"""``compile``: DeepSpeed's compile section (keys as in DeepSpeed 0.19.8's ``CompileConfig``).

Decisions:

* zerospeed compiles with ``engine.compile()`` (:mod:`zerospeed.compile`): ``torch.compile`` of the
  wrapped module in place, the engine's ZeRO machinery outside the graph. That needs no config key.
* DeepCompile (``deepcompile: true``: ZeRO-aware passes over the forward/backward graphs) is not
  built. ``deepcompile: true`` is refused naming the key; so is every DeepCompile-only option set
  away from DeepSpeed's default (``free_activation: true``, ``offload_*: true``, ``double_buffer:
  false``, ...), because each asks for behaviour zerospeed does not have. A section that only
  restates the defaults is accepted.
* ``passes`` (a zerospeed addition: names of graph passes) likewise needs DeepCompile; a non-empty
  list is refused. Passes registered with ``engine.register_compile_pass`` are validated by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from .fields import Bool, NonNegInt, Section, fail

NOT_BUILT = "is an option of DeepCompile, which zerospeed does not build yet; use engine.compile() without it"

#: DeepCompile-only keys and DeepSpeed's default for each (a non-default value is refused)
DEEPCOMPILE_ONLY_DEFAULTS: dict[str, Any] = {
    "free_activation": False,
    "offload_activation": False,
    "offload_opt_states": False,
    "offload_parameters": False,
    "double_buffer": True,
    "symmetric_memory": False,
    "dump_graphs": False,
    "debug_log": False,
    "sync_before_reduce": False,
    "sync_after_reduce": False,
    "sync_before_allgather": False,
    "sync_after_allgather": False,
    "keep_int_input_tensors": True,
    "keep_all_input_tensors": False,
}


class CompileConfig(Section):
    """DeepSpeed's ``compile`` section; only the defaults (no DeepCompile) are accepted."""

    deepcompile: Bool = False
    free_activation: Bool = False
    free_activation_threshold: NonNegInt = 10 * 1024 * 1024
    offload_activation: Bool = False
    offload_opt_states: Bool = False
    offload_parameters: Bool = False
    double_buffer: Bool = True
    symmetric_memory: Bool = False
    dump_graphs: Bool = False
    debug_log: Bool = False
    sync_before_reduce: Bool = False
    sync_after_reduce: Bool = False
    sync_before_allgather: Bool = False
    sync_after_allgather: Bool = False
    keep_int_input_tensors: Bool = True
    keep_all_input_tensors: Bool = False
    passes: list[str] | None = None

    @model_validator(mode="after")
    def _only_what_is_built(self) -> "CompileConfig":
        if self.deepcompile:
            offending = [k for k, d in DEEPCOMPILE_ONLY_DEFAULTS.items() if getattr(self, k) != d]
            extra = f" (nor its options: {', '.join(offending)})" if offending else ""
            raise fail(f"true is not supported by zerospeed yet: DeepCompile's ZeRO graph passes are not built"
                       f"{extra}; use engine.compile() with deepcompile false", key="deepcompile")
        for key, default in DEEPCOMPILE_ONLY_DEFAULTS.items():
            if getattr(self, key) != default:
                raise fail(f"{getattr(self, key)!r} {NOT_BUILT}", key=key)
        if self.passes:
            raise fail(f"{self.passes!r} {NOT_BUILT}", key="passes")
        return self
