"""Suite-wide isolation: a test module that initialises torch.distributed in the pytest process (a
world of one, through ``zerospeed.initialize``) must not leave it to the modules after it, whose
single-process code paths (e.g. building a 2-stage PipelineModule without processes) behave
differently when a default process group exists.

The ``numeric`` marker and the instruction-set check of ``make test-isa`` (issue #25): see NUMERIC_MODULES and
check_isa_caps."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterator

import pytest

#: Modules whose results depend on the order of floating-point sums or on which kernel runs: fast paths against their
#: plain twins (int8 and C kernels, Adam kernels, greedy heads), quantization grids, inference outputs against HF,
#: compiled against eager, sharded against one process. Their tests carry the ``numeric`` marker; ``make test-isa``
#: runs them again with torch's kernels, oneDNN, MKL and zerospeed's C kernels held to AVX2 and to no SIMD, so a
#: tolerance that only held for this CPU's kernels fails here and not on a user's machine. A test in another module
#: opts in with ``@pytest.mark.numeric``.
NUMERIC_MODULES = frozenset({
    "test_cpu_adam.py", "test_optimizers.py", "test_loss_scaler.py", "test_compat_precision.py",
    "test_inference_attention.py", "test_inference_cpu_kernels.py", "test_inference_engine.py",
    "test_inference_greedy_head.py", "test_inference_mixtral.py", "test_inference_v1.py",
    "test_inference_scheduling.py", "test_inference_tp.py",
    "test_compression_clean.py", "test_compression_inference.py", "test_compression_tp.py",
    "test_compression_training.py", "test_compression_zero.py",
    "test_compile_passes.py", "test_compile_engine.py",
    "test_engine_parity.py", "test_tp_training.py", "test_pipe_engine.py", "test_sequence_parallel.py",
    "test_sequence_tiling.py", "test_ds_checkpoint.py", "test_ds_convert.py", "test_comm_hierarchical.py",
    "test_zeropp_quant.py", "test_onebit_adam.py", "test_onebit_family.py",
})


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in NUMERIC_MODULES:
            item.add_marker(pytest.mark.numeric)


#: ZEROSPEED_TEST_ISA (set by make test-isa) -> what each library may report at that cap: torch's capability names,
#: and words that mean "above the cap" in oneDNN's and MKL's verbose banners
ISA_CAPS = {
    "avx2": ({"AVX2", "DEFAULT", "NO AVX"}, ("AVX-512", "AVX512", "AMX", "AVX10"), ("AVX-512", "AMX")),
    "default": ({"DEFAULT", "NO AVX"}, ("AVX", "AMX"), ("AVX", "AMX")),
    "avx512-noamx": ({"AVX512", "AVX2", "DEFAULT", "NO AVX"}, ("AMX", "AVX10"), ("AVX-512", "AMX")),
}


def isa_in_effect() -> dict[str, str]:
    """What torch's kernels, oneDNN and MKL dispatch to in a process with this environment: torch's own report, and
    the banners oneDNN and MKL print (from C, once, at first use) with ONEDNN_VERBOSE / MKL_VERBOSE on, read from a
    child process."""
    code = ("import torch\nprint('aten', torch.backends.cpu.get_cpu_capability(), flush=True)\n"
            "a = torch.randn(64, 64)\na @ a\nq = torch.ones(32, 32, dtype=torch.int8)\n"
            "try:\n    torch._int_mm(q, q)\nexcept Exception:\n    pass\n")
    env = dict(os.environ, ONEDNN_VERBOSE="1", MKL_VERBOSE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300).stdout
    found = {"torch": "not seen", "oneDNN": "not seen", "MKL": "not seen"}
    for line in out.splitlines():
        if line.startswith("aten "):
            found["torch"] = line.split(maxsplit=1)[1].strip()
        elif ",info,cpu,isa:" in line:
            found["oneDNN"] = line.split("isa:", 1)[1].strip()
        elif line.startswith("MKL_VERBOSE") and " architecture " in line and found["MKL"] == "not seen":
            found["MKL"] = line.split(" architecture ", 1)[1].split(", Lnx")[0].strip()
    return found


def check_isa_caps(level: str) -> tuple[dict[str, str], list[str]]:
    """The instruction sets in effect under ``ZEROSPEED_TEST_ISA=level`` and what is above that cap (on x86; MKL
    is held only on Intel CPUs, it dispatches on its own elsewhere)."""
    if level not in ISA_CAPS:
        raise pytest.UsageError(f"ZEROSPEED_TEST_ISA: {level!r} is not one of {', '.join(ISA_CAPS)}")
    found = isa_in_effect()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return found, []
    torch_ok, onednn_above, mkl_above = ISA_CAPS[level]
    problems = []
    if found["torch"] not in torch_ok:
        problems.append(f"torch's kernels run at {found['torch']} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')})")
    if any(word in found["oneDNN"] for word in onednn_above):
        problems.append(f"oneDNN runs at {found['oneDNN']} (ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')})")
    try:
        with open("/proc/cpuinfo") as f:
            intel = "GenuineIntel" in f.read(4096)
    except OSError:
        intel = False
    if intel and any(word in found["MKL"] for word in mkl_above):
        problems.append(f"MKL runs at {found['MKL']} (MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS')})")
    return found, problems


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``ZEROSPEED_TEST_ISA`` (make test-isa), say which instruction sets the run uses, and stop before any test
    if a cap did not take effect (the run would silently test this CPU's kernels again)."""
    level = os.environ.get("ZEROSPEED_TEST_ISA", "").strip()
    if not level:
        return
    found, problems = check_isa_caps(level)
    kernels = os.environ.get("ZEROSPEED_KERNEL_ISA", "native")
    line = f"ZEROSPEED_TEST_ISA={level}: torch {found['torch']}; oneDNN {found['oneDNN']}; MKL {found['MKL']}; " \
           f"zerospeed C kernels {kernels}"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    if problems:
        raise pytest.UsageError("instruction-set cap not in effect: " + "; ".join(problems))


@pytest.fixture(autouse=True, scope="module")
def _fresh_process_group_per_module() -> Iterator[None]:
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from zerospeed.comm.lifecycle import shutdown

        shutdown(timeout_s=5.0)
    from zerospeed.comm.mesh import reset_mesh

    reset_mesh()
    try:
        from zerospeed.moe.groups import reset_expert_groups
    except ImportError:
        return
    reset_expert_groups()
