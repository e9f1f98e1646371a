"""``compile``: DeepSpeed's compile section (keys as in DeepSpeed 0.19.8's ``CompileConfig``).

Decisions:

* ``engine.compile()`` without ``deepcompile``: ``torch.compile`` of the wrapped module in place, the
  engine's ZeRO machinery outside the graph (:mod:`zerospeed.compile.engine_compile`).
* ``deepcompile: true``: ``engine.compile()`` moves the ZeRO gathers, releases and reductions into the
  forward/backward graphs (:mod:`zerospeed.compile.deepcompile`).
* ``offload_activation: true`` (needs ``deepcompile: true``): the forward graph's saved tensors of at
  least ``free_activation_threshold`` bytes wait in host memory until the backward graph needs them.
* The DeepCompile options zerospeed does not build (optimizer-state / parameter offload by the
  graph, ``free_activation``, ``double_buffer: false``, the sync and debug switches...) are
  refused by name when set away from DeepSpeed's default: each asks for behaviour zerospeed does not
  have. A section that only restates the defaults is accepted.
* ``passes`` takes DeepSpeed 0.19.8's values (``PassName`` in ``deepspeed/compile/config.py``): ``z1`` and ``z3``
  name DeepSpeed's ZeRO graph passes, which DeepSpeed's DeepCompile runs for the configured ZeRO stage whether they
  are listed or not, and so does zerospeed's (listing them changes nothing; they are dropped from the parsed list);
  ``autosp`` (AutoSP sequence parallelism) and ``autotp`` (AutoTP as a graph pass) are refused by name: zerospeed
  does not build them as compile passes. Any other name is one of zerospeed's own graph passes of DeepCompile's
  optimized phase (after the profiling step), which need ``deepcompile: true``; they are checked when
  ``engine.compile()`` runs (built-in passes and those registered with ``engine.register_compile_pass``). No
  zerospeed pass is named like one of DeepSpeed's (a test keeps it so).
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from .fields import Bool, NonNegInt, Section, fail

NOT_BUILT = "is a DeepCompile option zerospeed does not build; leave it at its default"

#: DeepCompile-only keys and DeepSpeed's default for each (a non-default value is refused)
DEEPCOMPILE_ONLY_DEFAULTS: dict[str, Any] = {
    "free_activation": False,
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


#: DeepSpeed 0.19.8's ``compile.passes`` values: the ZeRO passes (run for the configured stage anyway) ...
DEEPSPEED_ZERO_PASSES = ("z1", "z3")
#: ... and the parallelization passes zerospeed does not build as graph passes
DEEPSPEED_PASSES_NOT_BUILT = {"autosp": "AutoSP (sequence parallelism)", "autotp": "AutoTP (tensor parallelism)"}
DEEPSPEED_PASS_NAMES = DEEPSPEED_ZERO_PASSES + tuple(DEEPSPEED_PASSES_NOT_BUILT)


class CompileConfig(Section):
    """DeepSpeed's ``compile`` section (see the module docstring for what is built)."""

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

    @field_validator("passes")
    @classmethod
    def _deepspeed_pass_names(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        for name in value:
            if name in DEEPSPEED_PASSES_NOT_BUILT:
                raise fail(f"{name!r} is DeepSpeed's {DEEPSPEED_PASSES_NOT_BUILT[name]} compile pass, which zerospeed "
                           "does not build; remove it")
        own = [name for name in value if name not in DEEPSPEED_ZERO_PASSES]
        return own or None

    @model_validator(mode="after")
    def _only_what_is_built(self) -> "CompileConfig":
        for key, default in DEEPCOMPILE_ONLY_DEFAULTS.items():
            if getattr(self, key) != default:
                raise fail(f"{getattr(self, key)!r} {NOT_BUILT}", key=key)
        if self.offload_activation and not self.deepcompile:
            raise fail("true offloads activations from DeepCompile's graphs; set compile.deepcompile: true",
                       key="offload_activation")
        if self.passes and not self.deepcompile:
            raise fail(f"{self.passes!r} names DeepCompile graph passes; set compile.deepcompile: true", key="passes")
        return self
