"""``engine.compile()``: torch.compile of the wrapped module, with what it cost measured.

* :mod:`zerospeed.compile.engine_compile` - :class:`CompiledState`, what ``engine.compile``,
  ``engine.is_compiled``, ``engine.get_compile_time`` and ``engine.compile_report`` delegate to;
* :mod:`zerospeed.compile.stats` - graph breaks, recompiles and compile time read from
  ``torch._dynamo``'s own counters and per-frame compilation metrics;
* :mod:`zerospeed.compile.passes` - the registry behind ``engine.register_compile_pass``;
* :mod:`zerospeed.compile.backend` - :func:`backend_fn`, an ``aot_autograd`` backend running passes
  ``(graph, profile) -> graph`` over the forward and backward graphs (usable as
  ``engine.compile(backend=backend_fn([...]))``);
* :mod:`zerospeed.compile.zero_passes` - gather/release insertion and selective unsharding, tested
  on small graphs, not yet bound to the ZeRO-3 runtime.

DeepCompile (ZeRO-aware passes over the forward/backward graphs, ``compile.deepcompile``) is not
built; its config keys are refused by name (:mod:`zerospeed.config.compile`).
"""

from .backend import Profile, backend_fn
from .engine_compile import CompiledState, compile_engine
from .passes import PassRegistry
from .stats import CompileStats

__all__ = ["CompileStats", "CompiledState", "PassRegistry", "Profile", "backend_fn", "compile_engine"]
