"""The alias's constants: the version it reports and the environment variables it reads."""

from __future__ import annotations

from zerospeed._version import __version__

#: the DeepSpeed release whose configuration and public API zerospeed follows
DEEPSPEED_COMPAT_VERSION = "0.19.8"
#: set to 1 to shadow a real DeepSpeed that is importable (``zerospeed-as-deepspeed --force``)
FORCE_ENV = "ZEROSPEED_AS_DEEPSPEED_FORCE"
#: the generated directory, for children to check that their ``deepspeed`` is the alias
DIR_ENV = "ZEROSPEED_AS_DEEPSPEED_DIR"
#: the one file of the generated package; the guard recognises the alias by this marker
MARKER = "zerospeed-as-deepspeed"


def alias_version() -> str:
    """``0.19.8+zerospeed.<version>``: PEP 440 local version, so ``>= 0.19.8`` checks pass and it reads as zerospeed."""
    local = "".join(c if c.isalnum() or c == "." else "." for c in __version__)
    return f"{DEEPSPEED_COMPAT_VERSION}+zerospeed.{local}"


__all__ = ["DEEPSPEED_COMPAT_VERSION", "DIR_ENV", "FORCE_ENV", "MARKER", "alias_version"]
