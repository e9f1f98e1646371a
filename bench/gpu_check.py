"""``make gpu-check``: the GPU path of zerospeed in one command (issue #25).

Runs, on a machine whose torch sees CUDA, within ``--budget-s`` (25 minutes) in all:

1. the device-parametrized parity tests (``tests/test_device_parity.py``: ZeRO stages 0-3, CPU and NVMe
   offload, bf16/fp16 with loss scaling, compile and DeepCompile, the inference engine and server against
   HF, quantized kernels, flops profiler, on ``cuda`` at world size 1 over NCCL) and the two-rank tests on
   one GPU (``tests/test_device_multirank.py``: gloo with CUDA tensors, since NCCL needs a GPU per rank);
2. a short benchmark (``bench/gpu_bench.py``): ZeRO-Offload training of the largest GPT that fits this
   machine (stage 2, bf16, optimizer on the CPU) against DeepSpeed on the same GPU when DeepSpeed imports,
   and greedy-decoding tokens/s of zerospeed's inference engine against HF ``generate`` (and vLLM when it
   imports) on a random 1.1B Llama;

then writes ``bench/results/gpu-<UTC date>.md`` and ``.json`` (GPU, driver, CUDA and torch versions, each
step's status and duration, the failed tests, the figures) and exits 1 if a test step or one of
zerospeed's own benchmark steps failed (DeepSpeed's, HF's or vLLM's failing is reported, not fatal).

Without CUDA it prints one line and exits 0. ``--dry-run`` lists the steps without running any.

The GPU machine has no network: nothing is installed from an index. The steps run on the first
interpreter (``--python``, ``$GPU_PYTHON``, this one, ``python3``, ``.venv/bin/python``) whose torch sees
CUDA, with the working tree's ``src`` on ``PYTHONPATH`` (zerospeed needs no install). What that
interpreter lacks (pydantic, fastapi/uvicorn for the server test, DeepSpeed) comes from a folder of wheels,
``--wheels DIR`` (``make gpu-check WHEELS=DIR``), installed with ``pip --no-index --no-deps --target``.
Make that folder on a machine with network, with the GPU machine's Python version::

    .venv/bin/python bench/gpu_check.py --download-wheels .whl --wheel-python 3.12

(DeepSpeed 0.19.8 is built there as a pure-Python wheel, ``DS_BUILD_OPS=0``: its CPU Adam compiles on the
GPU machine on first use.) Where one command may run 10 minutes at most (this workplace's device tool), split the check: e.g.
``GPU_CHECK_ARGS="--only tests --budget-s 540"``, then ``--steps offload-zerospeed,offload-deepspeed``, then
``--steps make-llama,inference-zerospeed,inference-hf`` (each run writes its own report; ``--budget-s`` below
the command's limit leaves time to write it), or start ``make gpu-check`` detached (``setsid``) and read
its report when it is done.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402  (these three import only the standard library: safe under any interpreter)
from common import RESULTS_DIR, format_bytes  # noqa: E402
from gpu_report import DEEPSPEED, driver_version, host_facts, write_report  # noqa: E402

NO_CUDA_LINE = "gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing to run"
BUDGET_S = 25 * 60
MIN_STEP_S = 45  # a step that would get less than this of the budget is skipped, not started
TEST_FILES = ("tests/test_device_parity.py", "tests/test_device_multirank.py")
DEFAULT_SITE = Path(tempfile.gettempdir()) / "zerospeed-gpu-site"
#: what zerospeed and its tests import (checked before any step); and what only some steps need
REQUIRED = ("torch", "pydantic", "numpy", "safetensors", "tqdm", "psutil", "transformers", "tokenizers",
            "pytest", "pytest_timeout")
OPTIONAL = ("fastapi", "uvicorn", "httpx", "deepspeed", "vllm")
#: the wheels ``--download-wheels`` fetches: what the GPU image lacks (pydantic and its parts, the server's
#: fastapi/starlette/uvicorn, DeepSpeed's hjson), at the versions of the interpreter running the download
DOWNLOAD = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
            "fastapi", "starlette", "annotated-doc", "uvicorn", "hjson")

PROBE = r"""
import importlib.util, json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable, "cuda": False}
try:
    import torch
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
else:
    out.update(torch=torch.__version__, cuda_version=torch.version.cuda, cuda=torch.cuda.is_available())
    if out["cuda"]:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_bytes=p.total_memory, gpu_count=torch.cuda.device_count(),
                   capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count)
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
mods = sys.argv[1:]
out["modules"] = {m: importlib.util.find_spec(m) is not None for m in mods}
vers = {}
for m in mods:
    try:
        import importlib.metadata as md
        vers[m] = md.version({"pytest_timeout": "pytest-timeout"}.get(m, m))
    except Exception:
        vers[m] = None
out["versions"] = vers
print("PROBE " + json.dumps(out))
"""


@dataclass
class Step:
    """One command of the check, and (once run) how it ended."""

    name: str
    kind: str  # "test" or "bench"
    argv: list[str]
    limit_s: float
    fatal: bool  # does a failure make the exit status 1?
    needs: str | None = None  # a module that must import, else the step is skipped
    needs_path: str | None = None  # a file or folder an earlier step makes, else the step is skipped
    result_file: str | None = None  # bench: the worker's JSON result; test: pytest's junit XML
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"  # pass, fail, timeout, skipped
    duration_s: float = 0.0
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    tail: list[str] = field(default_factory=list)

    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


# --------------------------------------------------------------------------- interpreters and packages


def step_env(site: Path | None) -> dict[str, str]:
    """The environment of every step: the working tree's ``src`` (and the wheel site) importable, no hub
    access, cuBLAS's deterministic workspace, and a CUDA check that does not initialise the driver (so
    the test harness's forkserver can still start CUDA ranks)."""
    env = dict(os.environ)
    paths = ([str(site)] if site else []) + [str(REPO / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTORCH_NVML_BASED_CUDA_CHECK="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def probe(python: str, env: dict[str, str], timeout_s: float = 180) -> dict[str, Any] | None:
    """What ``python`` has: torch and CUDA facts, and which of the needed modules import; None if it
    cannot run."""
    try:
        proc = subprocess.run([python, "-c", PROBE, *REQUIRED, *OPTIONAL], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return None


def candidates(explicit: str | None) -> list[str]:
    found, seen = [], set()
    for c in (explicit, os.environ.get("GPU_PYTHON"), sys.executable, shutil.which("python3"),
              str(REPO / ".venv" / "bin" / "python")):
        if not c or not (os.path.exists(c) or shutil.which(c)):
            continue
        key = os.path.realpath(shutil.which(c) or c)
        if key not in seen:
            seen.add(key)
            found.append(c)
    return found


def find_cuda_python(explicit: str | None) -> tuple[str, dict[str, Any]] | None:
    env = step_env(None)
    for python in candidates(explicit):
        info = probe(python, env)
        if info and info.get("cuda"):
            return python, info
    return None


def install_wheels(python: str, wheels: Path, site: Path) -> str | None:
    """``pip install --no-index --no-deps --target site`` of every wheel in ``wheels``; an error line or None."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        return f"--wheels {wheels}: no .whl files there"
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *files],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return "pip install of the wheels failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


def download_wheels(dest: Path, py_version: str) -> int:
    """On a machine with network: the wheels the GPU image lacks, for CPython ``py_version`` on x86-64
    Linux, plus DeepSpeed built as a pure-Python wheel (needs torch and setuptools here)."""
    import importlib.metadata as md

    dest.mkdir(parents=True, exist_ok=True)
    tag = py_version.replace(".", "")
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)] + ["manylinux2014_x86_64"]
    failed = []
    for name in DOWNLOAD:
        try:
            spec = f"{name}=={md.version(name)}"
        except md.PackageNotFoundError:
            spec = name
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               py_version, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
               *[a for p in platforms for a in ("--platform", p)], "--platform", "any", "-d", str(dest), spec]
        print(f"gpu-check: {spec}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(spec)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"gpu-check: {DEEPSPEED} (sdist, built here as a wheel without ops)", flush=True)
        env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
        ok = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                             "-d", tmp, DEEPSPEED]).returncode == 0
        sdists = list(Path(tmp).glob("deepspeed-*.tar.gz"))
        ok = ok and bool(sdists) and subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
             str(sdists[0])], env=env).returncode == 0
        if not ok:
            failed.append(DEEPSPEED)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"gpu-check: {len(list(dest.glob('*.whl')))} wheels, {format_bytes(size)} in {dest}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# --------------------------------------------------------------------------- the plan


def plan(python: str, work: Path, offload_size: str, only: str | None = None) -> list[Step]:
    """The steps, in order. ``work`` holds the junit files, worker results and the benchmark's model."""
    steps: list[Step] = []
    if only in (None, "tests"):
        for path, limit in zip(TEST_FILES, (660, 300)):
            name = Path(path).stem.replace("test_", "")
            xml = str(work / f"{name}.xml")
            steps.append(Step(name, "test", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                             f"--junitxml={xml}", path], limit, True, result_file=xml))
    if only in (None, "bench"):
        bench = [python, str(Path("bench") / "gpu_bench.py")]
        for system, limit, fatal in (("zerospeed", 420, True), ("deepspeed", 600, False)):
            out = str(work / f"offload-{system}.json")
            steps.append(Step(f"offload-{system}", "bench", [*bench, "offload", "--system", system, "--size",
                                                               offload_size, "--result", out], limit, fatal,
                              needs="deepspeed" if system == "deepspeed" else None, result_file=out,
                              env={"DS_ACCELERATOR": "cuda"} if system == "deepspeed" else {}))
        llama = str(work / "llama-1.1b")
        out = str(work / "make-llama.json")
        steps.append(Step("make-llama", "bench", [*bench, "make-llama", "--out", llama, "--result", out], 240, True,
                          result_file=out))
        for system, fatal in (("zerospeed", True), ("hf", False), ("vllm", False)):
            out = str(work / f"inference-{system}.json")
            steps.append(Step(f"inference-{system}", "bench", [*bench, "inference", "--system", system,
                                                                 "--model-dir", llama, "--result", out], 300, fatal,
                              needs="vllm" if system == "vllm" else None, needs_path=llama, result_file=out))
    return steps


# --------------------------------------------------------------------------- running


def parse_junit(path: str) -> tuple[dict[str, int], list[str], list[str]]:
    """Counts (passed, failed, errors, skipped, and ``cuda_passed``: passed tests with ``cuda`` in their id),
    the failed tests with their message's first line, and the skip reasons with how many tests each skipped."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cuda_passed": 0}
    failures, skips = [], {}
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                counts["failed" if bad.tag == "failure" else "errors"] += 1
                message = (bad.get("message") or (bad.text or "").strip() or "?").strip().splitlines()
                failures.append(f"{name}: {(message[0] if message else '?')[:300]}")
            elif skip is not None:
                counts["skipped"] += 1
                reason = (skip.get("message") or "?").strip()
                skips[reason] = skips.get(reason, 0) + 1
            else:
                counts["passed"] += 1
                counts["cuda_passed"] += "cuda" in name
    return counts, failures, [f"{n} x {r}" for r, n in skips.items()]


def run_command(argv: list[str], env: dict[str, str], timeout_s: float, log: Path) -> tuple[int, list[str]]:
    """Run ``argv`` in the repository root, output to ``log``; its whole process group is killed at
    ``timeout_s`` (exit status 124). Returns the status and the last 40 lines."""
    tail: deque[str] = deque(maxlen=40)
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                tail.append(line.rstrip("\n"))
            code = proc.wait()
        finally:
            timer.cancel()
    return (124 if timed_out.is_set() else code), list(tail)


def run_step(step: Step, env: dict[str, str], modules: dict[str, bool], deadline: float, logs: Path) -> None:
    if step.needs and not modules.get(step.needs):
        step.status, step.summary = "skipped", f"{step.needs} not installed on this machine"
        return
    if step.needs_path and not Path(step.needs_path).exists():
        step.status, step.summary = "skipped", f"no {Path(step.needs_path).name} (an earlier step did not make it)"
        return
    budget = deadline - time.monotonic()
    if budget < MIN_STEP_S:
        step.status, step.summary = "skipped", f"out of time budget ({max(budget, 0):.0f} s left)"
        return
    limit = min(step.limit_s, budget)
    print(f"gpu-check: {step.name} (limit {limit:.0f} s): {step.command()}", flush=True)
    t0 = time.monotonic()
    code, step.tail = run_command(step.argv, {**env, **step.env}, limit, logs / f"{step.name}.log")
    step.duration_s = time.monotonic() - t0
    step.status = "pass" if code == 0 else "timeout" if code == 124 else "fail"
    if step.kind == "test" and step.result_file and Path(step.result_file).is_file():
        counts, step.failures, skips = parse_junit(step.result_file)
        step.data = {"counts": counts, "skips": skips}
        step.summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n and k != "cuda_passed")
        step.summary += f" ({counts['cuda_passed']} passed on CUDA)"
        if code == 0 and not counts["cuda_passed"]:
            step.status = "fail"
            step.summary += ": none on CUDA"
    elif step.kind == "bench" and step.result_file and Path(step.result_file).is_file() and code == 0:
        step.data = json.loads(Path(step.result_file).read_text())
        if "tokens_per_s" in step.data:
            step.summary = f"{step.data['tokens_per_s']:.4g} tokens/s"
    if step.status == "timeout":
        step.summary = (step.summary + "; " if step.summary else "") + f"killed after {limit:.0f} s"
    elif step.status == "fail" and not step.summary:
        step.summary = next((line for line in reversed(step.tail) if "Error" in line or "error" in line),
                            step.tail[-1] if step.tail else f"exit status {code}")[:300]
    print(f"gpu-check: {step.name}: {step.status} in {step.duration_s:.0f} s {step.summary}", flush=True)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    p.add_argument("--only", choices=("tests", "bench"), help="run only the test steps or only the benchmark")
    p.add_argument("--steps", help="comma-separated step names to run (see --dry-run), e.g. to split the check over "
                                   "several commands of at most 10 minutes; inference-* need make-llama in the same run")
    p.add_argument("--python", help="interpreter of the steps (default: the first whose torch sees CUDA)")
    p.add_argument("--wheels", help="folder of wheels to install (no index) before the steps; WHEELS= in make")
    p.add_argument("--site", default=str(DEFAULT_SITE), help="where --wheels are installed (on PYTHONPATH)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="time for all steps together")
    p.add_argument("--offload-size", choices=("auto", *[s for s in gpu_bench.SIZES if s != "tiny"]), default="auto",
                   help="GPT size of the ZeRO-Offload benchmark (auto: the largest that fits this machine)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="where gpu-<date>.md/.json go")
    p.add_argument("--logs-dir", help="keep each step's full output here (default: a temporary folder)")
    p.add_argument("--download-wheels", metavar="DIR", help="(with network) fetch the wheels the GPU image lacks into DIR")
    p.add_argument("--wheel-python", default="3.12", help="Python version of the GPU machine, for --download-wheels")
    return p.parse_args(argv)


def select(steps: list[Step], names: str | None) -> list[Step]:
    """The steps named in ``--steps`` (all without it); an unknown name ends the program with the choices."""
    if not names:
        return steps
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {s.name for s in steps}]
    if unknown or not wanted:
        sys.exit(f"gpu-check: --steps: unknown {', '.join(unknown) or '(none given)'}; choose from "
                 f"{', '.join(s.name for s in steps)}")
    return [s for s in steps if s.name in wanted]


def dry_run(args: argparse.Namespace) -> int:
    python = args.python or "PYTHON"
    work = Path(tempfile.gettempdir()) / "gpu-check-WORK"
    steps = select(plan(python, work, args.offload_size, args.only), args.steps)
    print(f"gpu-check --dry-run: would run {len(steps)} steps within {args.budget_s:.0f} s, where PYTHON is "
          f"{args.python or 'the first of ' + ', '.join(candidates(None)) + ' whose torch sees CUDA'}:")
    if args.wheels:
        print(f"  0. install {args.wheels}/*.whl: PYTHON -m pip install --no-index --no-deps --target {args.site}")
    for i, s in enumerate(steps, 1):
        extra = f", only if {s.needs} imports" if s.needs else ""
        print(f"  {i}. [{s.kind}] {s.name} (limit {s.limit_s:.0f} s{extra}{'' if s.fatal else ', not fatal'}): "
              f"{s.command()}")
    print(f"then write {args.out_dir}/gpu-<UTC date>.md and .json; exit 1 if a step marked fatal fails")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.download_wheels:
        return download_wheels(Path(args.download_wheels), args.wheel_python)
    if args.dry_run:
        return dry_run(args)
    select(plan("PYTHON", Path("WORK"), "auto", args.only), args.steps)  # a bad --steps fails before any probe
    found = find_cuda_python(args.python)
    if found is None:
        print(NO_CUDA_LINE)
        return 0
    started = time.monotonic()
    python, info = found
    site = Path(args.site) if args.wheels else None
    problems: list[str] = []
    if args.wheels:
        error = install_wheels(python, Path(args.wheels), site)
        if error:
            problems.append(error)
    env = step_env(site)
    info = probe(python, env) or info
    info["driver"] = driver_version()
    missing = [m for m in REQUIRED if not info.get("modules", {}).get(m)]
    if missing:
        problems.append(f"{python} lacks {', '.join(missing)}: carry wheels (bench/gpu_check.py --download-wheels "
                        "DIR on a machine with network, then make gpu-check WHEELS=DIR)")
    size = args.offload_size
    if size == "auto":
        size = gpu_bench.choose_offload_size(host_facts()["memory_bytes"] or 0, info.get("gpu_bytes", 0)) or "125m"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs = Path(args.logs_dir) if args.logs_dir else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    steps = select(plan(python, work, size, args.only), args.steps)
    print(f"gpu-check: {info.get('gpu')} with torch {info.get('torch')} (CUDA {info.get('cuda_version')}) through "
          f"{python}; logs in {logs}", flush=True)
    deadline = started + args.budget_s
    try:
        for step in steps:
            if missing:
                step.status, step.summary = "skipped", "required packages missing"
                continue
            run_step(step, env, info.get("modules", {}), deadline, logs)
    finally:
        shutil.rmtree(work / "llama-1.1b", ignore_errors=True)  # 2.2 GB
    command = shlex.join([os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..")
                          else sys.executable, *sys.argv])
    json_path, md_path, ok = write_report(info, steps, Path(args.out_dir), command, args.budget_s, started, problems)
    print(f"gpu-check: {'PASS' if ok else 'FAIL'}; report {md_path.relative_to(REPO) if md_path.is_relative_to(REPO) else md_path}"
          f" and {json_path.name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
