"""zerospeed under DeepSpeed's package name, for libraries that import ``deepspeed`` themselves (issue 27).

HuggingFace Transformers, Accelerate, PEFT and TRL find DeepSpeed by its package name
(``importlib.util.find_spec("deepspeed")`` plus the ``deepspeed`` distribution's metadata) and import its
module paths. This package makes those resolve to zerospeed, by explicit opt-in only:

* ``zerospeed-as-deepspeed COMMAND ARGS...`` (:mod:`zerospeed.deepspeed_alias.cli`) runs the command with a
  generated directory first on ``PYTHONPATH``;
* ``import zerospeed.as_deepspeed`` at the top of a script does the same in-process (and for its children).

The generated directory (:mod:`~zerospeed.deepspeed_alias.layout`) holds a ``deepspeed`` package of two lines
and a ``deepspeed-<version>.dist-info`` whose version, ``0.19.8+zerospeed.<zerospeed version>``, says it is
zerospeed and passes the version checks those libraries make (DeepSpeed 0.19.8 is the release whose config
and API zerospeed follows). Importing ``deepspeed`` installs a module finder
(:mod:`~zerospeed.deepspeed_alias.finder`): ``deepspeed.a.b`` *is* the module ``zerospeed.a.b`` (the same
object, so classes and isinstance checks agree), and a module path zerospeed does not build is refused with
one line naming it. Nothing is stubbed and no other library's code is patched.

It refuses, with one line, when a real DeepSpeed is importable (:mod:`~zerospeed.deepspeed_alias.guard`),
unless forced (``--force`` / ``ZEROSPEED_AS_DEEPSPEED_FORCE=1``): then zerospeed shadows it.
"""

from __future__ import annotations

from zerospeed.deepspeed_alias.names import DEEPSPEED_COMPAT_VERSION, FORCE_ENV, alias_version

__all__ = ["DEEPSPEED_COMPAT_VERSION", "FORCE_ENV", "alias_version"]
