"""Other projects' DeepSpeed tests under ``zerospeed-as-deepspeed`` (issue 27): how many pass, and why the others do not.

Three suites, each from a checkout of its repository (``--deepspeed-repo``, ``--accelerate-repo``, ``--trl-repo``):

* DeepSpeed's public-API unit tests: the ``tests/unit`` files whose own imports of DeepSpeed are only ``deepspeed``
  and ``deepspeed.accelerator`` (no internals; DeepSpeed's test harness, ``unit/common.py``, still uses
  ``deepspeed.comm``). Each file runs under DeepSpeed itself (``--deepspeed-python``, the .venv-bench interpreter,
  ``DS_ACCELERATOR=cpu``) and under zerospeed-as-deepspeed; a test counts for zerospeed when it passes with DeepSpeed.
* Accelerate's ``tests/deepspeed`` and TRL's ``tests/distributed`` (its DeepSpeed cases are the ``zero2`` / ``zero3``
  parameters) under zerospeed-as-deepspeed, with ``HF_HUB_OFFLINE=1`` (no download).

Per test the outcome comes from pytest's JUnit XML; a skip or failure keeps its first message line, and the table
groups them by reason. ``--junit-dir DIR`` reads XML files an earlier run left there (``<suite>.xml``) instead of
running pytest again (the suites take tens of minutes on a loaded 2-core machine). Results are written with
``bench.common.write_results`` (date, CPU, load average, command).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_results  # noqa: E402

BIN = Path(sys.executable).parent
PUBLIC = {"deepspeed", "deepspeed.accelerator"}
_IMPORT = re.compile(r"^\s*(?:from (deepspeed[\w.]*) import|import (deepspeed[\w.]*))", re.M)


def public_api_files(repo: Path) -> list[str]:
    """tests/unit files whose DeepSpeed imports are only the public top level (relative to tests/)."""
    out = []
    for f in sorted((repo / "tests" / "unit").rglob("test_*.py")):
        mods = {a or b for a, b in _IMPORT.findall(f.read_text(errors="ignore"))}
        if mods and mods <= PUBLIC:
            out.append(str(f.relative_to(repo / "tests")))
    return out


def run_pytest(python: list[str], cwd: Path, files: list[str], xml: Path, env: dict[str, str], timeout: int) -> int:
    cmd = python + ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                    "--timeout", "180", f"--junitxml={xml}", *files]
    try:
        return subprocess.run(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                              capture_output=True, text=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | error | skipped, first line of the reason)."""
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text = (node.get("message") or node.text or "").strip()
                reason = text.splitlines()[0][:160] if text else ""
                break
        result[name] = (status, reason)
    return result


def summarise(suite: str, runs: dict[str, dict[str, tuple[str, str]]], baseline: str | None) -> list[dict]:
    rows = []
    views = [(runner, runner, cases) for runner, cases in runs.items()]
    if baseline is not None:  # also: the other runners on the tests that pass under the baseline
        views += [(f"{runner} (tests passing under {baseline})", runner,
                   {k: v for k, v in cases.items() if runs[baseline].get(k, ("",))[0] == "passed"})
                  for runner, cases in runs.items() if runner != baseline]
    for runner, _, counted in views:
        by = collections.Counter(status for status, _ in counted.values())
        reasons = collections.Counter(f"{status}: {reason}" for status, reason in counted.values() if status != "passed")
        rows.append({"suite": suite, "runner": runner, "tests": len(counted), "passed": by["passed"],
                     "failed": by["failed"] + by["error"], "skipped": by["skipped"],
                     "reasons": "; ".join(f"{n} x {r}" for r, n in reasons.most_common(6))})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed-repo", type=Path)
    ap.add_argument("--deepspeed-python", default=str(Path(".venv-bench/bin/python")))
    ap.add_argument("--accelerate-repo", type=Path)
    ap.add_argument("--trl-repo", type=Path)
    ap.add_argument("--junit-dir", type=Path, help="read <suite>.xml from here instead of running pytest")
    ap.add_argument("--extra-path", default="", help="PYTHONPATH entries the suites need (pytest plugins)")
    ap.add_argument("--timeout", type=int, default=2400)
    ap.add_argument("--note", action="append", default=[], help="a line for the results' notes (how the XML was made)")
    args = ap.parse_args(argv)
    work = args.junit_dir or Path("/tmp/zerospeed-hf-stack-tests")
    work.mkdir(parents=True, exist_ok=True)
    wrapper = [str(BIN / "zerospeed-as-deepspeed"), sys.executable]
    env = {"PYTHONPATH": args.extra_path, "HF_HUB_OFFLINE": "1"}
    rows, params = [], {}

    def get(name, python, cwd, files, extra_env):
        xml = work / f"{name}.xml"
        if args.junit_dir is None:
            run_pytest(python, cwd, files, xml, {**env, **extra_env}, args.timeout)
        found = outcomes(xml) if xml.exists() else {}
        prefixes = tuple(f.removesuffix(".py").replace("/", ".") for f in files if f.endswith(".py"))
        if not prefixes:
            return found
        return {k: v for k, v in found.items() if k.lstrip(":").startswith(prefixes)}

    if args.deepspeed_repo:
        files = public_api_files(args.deepspeed_repo)
        params["deepspeed_files"] = files
        cwd = args.deepspeed_repo / "tests"
        runs = {"deepspeed": get("deepspeed", [args.deepspeed_python], cwd, files, {"DS_ACCELERATOR": "cpu"}),
                "zerospeed-as-deepspeed": get("zerospeed", wrapper, cwd, files, {})}
        rows += summarise("DeepSpeed tests/unit, public imports only", runs, "deepspeed")
    if args.accelerate_repo:
        runs = {"zerospeed-as-deepspeed": get("accelerate", wrapper, args.accelerate_repo, ["tests/deepspeed"], {})}
        rows += summarise("Accelerate tests/deepspeed", runs, None)
    if args.trl_repo:
        runs = {"zerospeed-as-deepspeed": get("trl", wrapper, args.trl_repo, ["tests/distributed"], {})}
        rows += summarise("TRL tests/distributed", runs, None)
    load = os.getloadavg()
    notes = [f"load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)",
             "The '(tests passing under deepspeed)' row counts only the tests that pass under DeepSpeed itself.",
             *args.note]
    json_path, md_path = write_results("hf_stack_tests", rows, params=params, notes=notes)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
