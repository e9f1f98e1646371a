"""Building zerospeed's plain-C kernels on first use: instruction-set level, compiler flags, a cached build.

Shared by the inference C kernels (:mod:`zerospeed.inference.cpu_kernel`) and ZeRO++'s quantizer
(:mod:`zerospeed.ops.block_quant_kernel`), which differ only in their source, their base flags and their
function signatures.

* Level: ``$ZEROSPEED_KERNEL_ISA`` (:func:`kernel_isa`): ``native`` (default: what the building CPU has),
  ``avx2`` (x86-64-v3: AVX2 and FMA, no AVX-512, as on a CPU without AVX-512) or ``scalar`` (the
  architecture's baseline, SSE2 on x86-64, with the auto-vectoriser off: a build that runs on any CPU of the
  architecture). ``make test-isa`` runs the tests at each level.
* Flags (:func:`isa_flags`): the kernel's base flags with the level's inserted after the optimisation level. Off
  x86, ``native`` is ``-mcpu=native`` on ARM64 (GCC's and Clang's spelling there) and nothing elsewhere, and
  ``scalar`` only turns the vectoriser off.
* Build (:func:`build`): ``$CC`` (default ``cc``) into ``$ZEROSPEED_KERNEL_CACHE`` (default
  ``~/.cache/zerospeed/kernels``), named by a hash of the source, the flags, the compiler and the CPU's flags
  (a cache shared by machines, an NFS home, never hands one CPU a build made for another), published with an
  atomic rename (ranks building at once never load half a file), loaded with ``ctypes``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ISA_ENV", "ISA_FLAGS", "build", "cpu_tag", "is_x86", "isa_flags", "kernel_isa"]

ISA_ENV = "ZEROSPEED_KERNEL_ISA"

#: Level -> instruction-set flags on x86-64 (see :func:`isa_flags` for other architectures).
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3"],
             "scalar": ["-march=x86-64", "-mtune=generic", "-fno-tree-vectorize", "-fno-tree-slp-vectorize"]}
_NO_VECTORISER = ["-fno-tree-vectorize", "-fno-tree-slp-vectorize"]


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def kernel_isa(environ: Mapping[str, str] | None = None) -> str:
    """The level of this process's C kernels (``$ZEROSPEED_KERNEL_ISA``, default ``native``); a ValueError naming
    the variable for an unknown value, or for ``avx2`` on a CPU that is not x86."""
    value = (os.environ if environ is None else environ).get(ISA_ENV, "").strip() or "native"
    if value not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}: {value!r} is not one of {', '.join(ISA_FLAGS)}")
    if value == "avx2" and not is_x86():
        raise ValueError(f"{ISA_ENV}: 'avx2' applies to x86-64 CPUs only (this one is {platform.machine()}); "
                         "use native or scalar")
    return value


def isa_flags(isa: str, base: Sequence[str]) -> list[str]:
    """``base`` (optimisation level first) with the flags of level ``isa`` after the optimisation level."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}: {isa!r} is not one of {', '.join(ISA_FLAGS)}")
    if isa == "avx2" and not is_x86():
        raise ValueError(f"{ISA_ENV}: 'avx2' applies to x86-64 CPUs only (this one is {platform.machine()}); "
                         "use native or scalar")
    if is_x86():
        extra = ISA_FLAGS[isa]
    elif isa == "scalar":
        extra = _NO_VECTORISER
    else:
        extra = ["-mcpu=native"] if platform.machine().lower() in ("aarch64", "arm64") else []
    return list(base[:1]) + extra + list(base[1:])


def cpu_tag() -> str:
    """The machine and its CPU flags, part of every build's cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build(name: str, source: str, flags: Sequence[str],
          signatures: Mapping[str, tuple[list[Any], Any]]) -> ctypes.CDLL:
    """Compile ``source`` with ``flags`` (or reuse the cached build) and load it, each function of
    ``signatures`` (``name -> (argtypes, restype)``) typed. RuntimeError with the compiler's message on failure."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256((source + " ".join(flags) + cc + cpu_tag()).encode()).hexdigest()[:16]
    cache = os.environ.get("ZEROSPEED_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zerospeed",
                                                                       "kernels")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"{name}_{key}.so")
    if not os.path.exists(lib):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, f"{name}.c")
            with open(src, "w") as f:
                f.write(source)
            out = os.path.join(tmp, "k.so")
            proc = subprocess.run([cc, *flags, src, "-o", out, "-lm"], capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} {' '.join(flags)} failed: {proc.stderr.strip()[-500:]}")
            os.replace(out, lib)  # atomic
    dll = ctypes.CDLL(lib)
    for fn_name, (args, res) in signatures.items():
        fn = getattr(dll, fn_name)
        fn.argtypes, fn.restype = args, res
    return dll
