"""``engine.compile()``: torch.compile of the wrapped module, with what it cost measured.

* :mod:`zerospeed.compile.engine_compile` - :class:`CompiledState`, what ``engine.compile``,
  ``engine.is_compiled``, ``engine.get_compile_time`` and ``engine.compile_report`` delegate to;
* :mod:`zerospeed.compile.stats` - graph breaks, recompiles and compile time read from
  ``torch._dynamo``'s own counters and per-frame compilation metrics;
* :mod:`zerospeed.compile.passes` - the registry behind ``engine.register_compile_pass``;
* :mod:`zerospeed.compile.backend` - :func:`backend_fn`, an ``aot_autograd`` backend running passes
  ``(graph, profile) -> graph`` over the forward and backward graphs (usable as
  ``engine.compile(backend=backend_fn([...]))``);
* :mod:`zerospeed.compile.zero_passes` - the ZeRO graph passes (gather/release, prefetch, selective
  unsharding, reductions in the backward graph), data in, data out;
* :mod:`zerospeed.compile.ops` - the collectives as ``torch.library`` custom ops (through comm/);
* :mod:`zerospeed.compile.deepcompile` - ``compile.deepcompile: true``: the schedule, the profiling
  step and the binding of the passes to an engine's ZeRO strategy.
"""

from .backend import Profile, backend_fn
from .engine_compile import CompiledState, compile_engine
from .passes import PassRegistry
from .stats import CompileStats

__all__ = ["CompileStats", "CompiledState", "PassRegistry", "Profile", "backend_fn", "compile_engine"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
