"""Other projects' DeepSpeed tests under ``zerospeed-as-deepspeed`` (issue 27): how many pass, and why the others do not.

Three suites, each from a checkout of its repository (``--deepspeed-repo``, ``--accelerate-repo``, ``--trl-repo``):

* DeepSpeed's public-API unit tests: the ``tests/unit`` files whose own imports of DeepSpeed are only ``deepspeed``
  and ``deepspeed.accelerator`` (no internals; DeepSpeed's test harness, ``unit/common.py``, still uses
  ``deepspeed.comm``). Each file runs under DeepSpeed itself (``--deepspeed-python``, the .venv-bench interpreter,
  ``DS_ACCELERATOR=cpu``) and under zerospeed-as-deepspeed; a test counts for zerospeed when it passes with DeepSpeed.
* Accelerate's ``tests/deepspeed`` and TRL's ``tests/distributed`` (its DeepSpeed cases are the ``zero2`` / ``zero3``
  parameters) under zerospeed-as-deepspeed, with ``HF_HUB_OFFLINE=1`` (no download).

Per test the outcome comes from pytest's JUnit XML; a skip or failure keeps its first message line, and the table
groups them by reason. ``--junit-dir DIR`` reads XML files an earlier run left there (``<suite>.xml``: ``deepspeed``,
``zerospeed``, ``accelerate``, ``trl``) instead of running pytest again (the suites take tens of minutes on a loaded
2-core machine), except the suites named by ``--run``, which run and write their XML there. ``--deselect-k`` passes
a ``-k`` expression to both DeepSpeed runs. ``--trl-own-package`` puts the TRL checkout's own ``trl`` package first
on ``PYTHONPATH`` (its test tree imports names of its own version: use it when the stored tree is not the installed
version's). ``--accelerate-local-models`` saves a random-weight model, built from a config, at the path of each hub
id in :data:`LOCAL_MODELS` inside the Accelerate checkout (its tests' working directory), so ``from_pretrained(id)``
reads it from disk: those tests then run without a download. Results are written with ``bench.common.write_results`` (date, CPU, load average, command).
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


def run_pytest(python: list[str], cwd: Path, files: list[str], xml: Path, env: dict[str, str], timeout: int,
               extra: tuple[str, ...] = ()) -> int:
    cmd = python + ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    "--continue-on-collection-errors", "--timeout", "180", f"--junitxml={xml}", *extra, *files]
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


#: hub ids Accelerate's tests/deepspeed load in tests that need no GPU -> a tiny config of that architecture
LOCAL_MODELS = {"hf-internal-testing/tiny-random-gpt2": ("GPT2Config", "GPT2Model",
                                                         {"vocab_size": 1000, "n_positions": 512, "n_embd": 32,
                                                          "n_layer": 5, "n_head": 4})}


def save_local_models(root: Path) -> list[str]:
    """Random-weight models at ``root/<hub id>`` (seed 0); returns the ids written."""
    import torch
    import transformers

    for model_id, (config_name, model_name, kwargs) in LOCAL_MODELS.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs))
        model.save_pretrained(root / model_id)
    return list(LOCAL_MODELS)


def _version_of(repo: Path, name: str) -> str:
    """The version a checkout says it is (DeepSpeed's version.txt, TRL's VERSION, Accelerate's setup.py)."""
    path = repo / name
    if not path.exists():
        return "unknown"
    text = path.read_text(errors="ignore")
    found = re.search(r'version="([^"]+)"', text) if name == "setup.py" else None
    return found.group(1) if found else text.strip().splitlines()[0] if text.strip() else "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed-repo", type=Path)
    ap.add_argument("--deepspeed-python", default=str(Path(__file__).resolve().parents[1] / ".venv-bench/bin/python"))
    ap.add_argument("--accelerate-repo", type=Path)
    ap.add_argument("--trl-repo", type=Path)
    ap.add_argument("--junit-dir", type=Path, help="read <suite>.xml from here instead of running pytest")
    ap.add_argument("--run", action="append", default=[], choices=["deepspeed", "zerospeed", "accelerate", "trl"],
                    help="with --junit-dir: run this suite (write its XML there) instead of reading it")
    ap.add_argument("--deselect-k", help="a pytest -k expression for both DeepSpeed runs")
    ap.add_argument("--deepspeed-k", help="a pytest -k expression for the run under DeepSpeed itself only (tests that "
                    "hang there on CPU); with --deselect-k both must hold")
    ap.add_argument("--trl-own-package", action="store_true", help="the TRL checkout's trl package first on the path")
    ap.add_argument("--accelerate-local-models", action="store_true",
                    help="random-weight models at the hub ids Accelerate's CPU-runnable DeepSpeed tests load")
    ap.add_argument("--extra-path", default="", help="PYTHONPATH entries the suites need (pytest plugins)")
    ap.add_argument("--timeout", type=int, default=2400)
    ap.add_argument("--note", action="append", default=[], help="a line for the results' notes (how the XML was made)")
    args = ap.parse_args(argv)
    work = args.junit_dir or Path("/tmp/zerospeed-hf-stack-tests")
    work.mkdir(parents=True, exist_ok=True)
    wrapper = [str(BIN / "zerospeed-as-deepspeed"), sys.executable]
    env = {"PYTHONPATH": args.extra_path, "HF_HUB_OFFLINE": "1"}
    rows, params = [], {}

    def get(name, python, cwd, files, extra_env, extra=()):
        xml = work / f"{name}.xml"
        if args.junit_dir is None or name in args.run:
            run_pytest(python, cwd, files, xml, {**env, **extra_env}, args.timeout, tuple(extra))
        found = outcomes(xml) if xml.exists() else {}
        prefixes = tuple(f.removesuffix(".py").replace("/", ".") for f in files if f.endswith(".py"))
        if not prefixes:
            return found
        return {k: v for k, v in found.items() if k.lstrip(":").startswith(prefixes)}

    if args.deepspeed_repo:
        files = public_api_files(args.deepspeed_repo)
        params["deepspeed_files"] = files
        cwd = args.deepspeed_repo / "tests"
        k = ("-k", args.deselect_k) if args.deselect_k else ()
        both = " and ".join(f"({e})" for e in (args.deselect_k, args.deepspeed_k) if e)
        ds_k = ("-k", both) if both else ()
        params["deepspeed_tree_version"] = _version_of(args.deepspeed_repo, "version.txt")
        runs = {"deepspeed": get("deepspeed", [args.deepspeed_python], cwd, files, {"DS_ACCELERATOR": "cpu"}, ds_k),
                "zerospeed-as-deepspeed": get("zerospeed", wrapper, cwd, files, {}, k)}
        rows += summarise("DeepSpeed tests/unit, public imports only", runs, "deepspeed")
    if args.accelerate_repo:
        params["accelerate_tree_version"] = _version_of(args.accelerate_repo, "setup.py")
        if args.accelerate_local_models:
            params["accelerate_local_models"] = save_local_models(args.accelerate_repo)
        runs = {"zerospeed-as-deepspeed": get("accelerate", wrapper, args.accelerate_repo, ["tests/deepspeed"], {})}
        rows += summarise("Accelerate tests/deepspeed", runs, None)
    if args.trl_repo:
        params["trl_tree_version"] = _version_of(args.trl_repo, "VERSION")
        trl_env = {}
        if args.trl_own_package:
            trl_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.trl_repo), args.extra_path) if p)
            params["trl_package"] = "the checkout's own trl/ (first on PYTHONPATH)"
        runs = {"zerospeed-as-deepspeed": get("trl", wrapper, args.trl_repo, ["tests/distributed"], trl_env)}
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
