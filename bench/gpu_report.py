"""The report of ``make gpu-check`` (bench/gpu_check.py): ``bench/results/gpu-<UTC date>.md`` and ``.json``.

What a reader needs to act on a GPU run: did it pass, on which GPU, driver, CUDA, NCCL, torch and Python;
each step's status, duration and summary; the failed tests with their first message line; the skip
reasons; the benchmark figures as tables with ratios to zerospeed; what could not be compared and how to
fix that; the last lines of each failed step's output. Imports only the standard library.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import REPO, format_bytes

if TYPE_CHECKING:
    from gpu_check import Step

#: the DeepSpeed the benchmark compares with (built as a wheel by ``gpu_check.py --download-wheels``)
DEEPSPEED = "deepspeed==0.19.8"


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def host_facts() -> dict[str, Any]:
    import common

    return {"cpu_model": common._cpu_model(), "logical_cores": os.cpu_count(), "memory_bytes": common._total_memory_bytes()}


def _gib(value: Any) -> str:
    return format_bytes(value) if isinstance(value, (int, float)) else "-"


def _num(d: dict[str, Any], key: str, spec: str = ".4g") -> str:
    value = d.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def figures(steps: list[Step]) -> tuple[list[str], list[str]]:
    """The Markdown of the benchmark figures, and notes on what could not be compared."""
    md, notes = [], []
    by = {s.name: s for s in steps}
    off = [by[n] for n in ("offload-zerospeed", "offload-deepspeed") if n in by]
    if off:
        base = by["offload-zerospeed"].data.get("tokens_per_s") if "offload-zerospeed" in by else None
        first = next((s.data for s in off if s.data), {})
        md += ["## ZeRO-Offload training", "",
               f"GPT {first.get('size', '?')} ({first.get('params', 0) / 1e9:.2f}B parameters), ZeRO stage 2, bf16, "
               f"optimizer (AdamW) on the CPU, micro-batch {first.get('micro_batch', '?')} x {first.get('seq_len', '?')} "
               "tokens, world size 1; median of the timed steps after warm-up.", "",
               "| system | status | step s | tokens/s | model TFLOP/s | peak GPU | peak host RSS | loss first -> last "
               "| zerospeed / this (tokens/s) |", "|---|---|---|---|---|---|---|---|---|"]
        for s in off:
            d = s.data
            ratio = f"{base / d['tokens_per_s']:.2f}x" if base and d.get("tokens_per_s") else "-"
            losses = d.get("losses") or []
            md.append(f"| {s.name.split('-', 1)[1]} | {s.status} | {_num(d, 'step_s', '.3g')} | {_num(d, 'tokens_per_s')} "
                      f"| {_num(d, 'model_tflops', '.3g')} | {_gib(d.get('peak_gpu_bytes'))} "
                      f"| {_gib(d.get('peak_host_rss_bytes'))} "
                      f"| {f'{losses[0]:.4f} -> {losses[-1]:.4f}' if losses else '-'} | {ratio} |")
        md.append("")
        ds = by.get("offload-deepspeed")
        if ds is not None and ds.status == "skipped" and "not installed" in ds.summary:
            notes.append("DeepSpeed not installed on this machine: make a wheel folder where there is network "
                         "(`.venv/bin/python bench/gpu_check.py --download-wheels .whl --wheel-python 3.12` builds "
                         f"{DEEPSPEED} without ops) and run `make gpu-check WHEELS=.whl` with `.whl` carried along.")
    inf = [by[n] for n in ("inference-zerospeed", "inference-hf", "inference-vllm") if n in by]
    if inf:
        zs = by.get("inference-zerospeed")
        base = zs.data.get("tokens_per_s") if zs else None
        first = next((s.data for s in inf if s.data), {})
        params = by["make-llama"].data.get("params") if "make-llama" in by else None
        md += ["## Inference", "",
               (f"Random Llama ({params / 1e9:.2f}B parameters, bf16), " if params else "Random Llama (bf16), ") +
               f"greedy decoding of {first.get('num_prompts', '?')} prompts x {first.get('prompt_len', '?')} tokens, "
               f"{first.get('new_tokens', '?')} new tokens each (no early stop); generated tokens per second of the "
               "whole batch after a warm-up. Agreement: identical greedy tokens with zerospeed over the first 8 prompts "
               "x 16 tokens (bf16: near-ties may differ).", "",
               "| system | status | tokens/s | wall s | load s | peak GPU | zerospeed / this | agreement |",
               "|---|---|---|---|---|---|---|---|"]
        for s in inf:
            d = s.data
            ratio = f"{base / d['tokens_per_s']:.2f}x" if base and d.get("tokens_per_s") else "-"
            agree = "-"
            if zs and zs.data.get("first_tokens") and d.get("first_tokens") and s is not zs:
                pairs = [(a, b) for x, y in zip(zs.data["first_tokens"], d["first_tokens"]) for a, b in zip(x, y)]
                agree = f"{sum(a == b for a, b in pairs) / max(len(pairs), 1):.0%}"
            md.append(f"| {s.name.split('-', 1)[1]} | {s.status} | {_num(d, 'tokens_per_s')} | {_num(d, 'wall_s', '.3g')} "
                      f"| {_num(d, 'load_s', '.3g')} | {_gib(d.get('peak_gpu_bytes'))} | {ratio} | {agree} |")
        md.append("")
        v = by.get("inference-vllm")
        if v is not None and v.status == "skipped" and "not installed" in v.summary:
            notes.append("vLLM not installed on this machine (its CUDA wheels are far over what a device call "
                         "carries); inference is compared with HF only.")
    return md, notes


def write_report(info: dict[str, Any], steps: list[Step], out_dir: Path, command: str, budget_s: float,
                 started: float, problems: list[str]) -> tuple[Path, Path, bool]:
    """``out_dir/gpu-<UTC stamp>.json`` and ``.md``; returns them and whether the check passed."""
    now = _dt.datetime.now(_dt.timezone.utc)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"gpu-{now.strftime('%Y%m%d-%H%M%S')}"
    failed = [s.name for s in steps if s.fatal and s.status in ("fail", "timeout")]
    ok = not failed and not problems
    host = host_facts()
    record = {"benchmark": "gpu-check", "date_utc": now.isoformat(timespec="seconds"), "command": command,
              "passed": ok, "failed_steps": failed, "problems": problems, "budget_s": budget_s,
              "elapsed_s": time.monotonic() - started, "revision": _git_revision(), "machine": {**host, **info},
              "steps": [asdict(s) for s in steps]}
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    versions = info.get("versions", {})
    gpu = (f"{info.get('gpu', '?')} (compute capability {info.get('capability', '?')}, "
           f"{_gib(info.get('gpu_bytes'))}, {info.get('multiprocessors', '?')} SMs), driver {info.get('driver') or '?'}")
    md = [f"# gpu-check {record['date_utc']}", "",
          f"- result: **{'PASS' if ok else 'FAIL'}**" + (f" (failed: {', '.join(failed + problems)})" if not ok else ""),
          f"- GPU: {gpu}",
          f"- CUDA {info.get('cuda_version')}, NCCL {info.get('nccl', '?')}, torch {info.get('torch')}, "
          f"python {info.get('python')} ({info.get('executable')})",
          f"- host: {host['cpu_model']}, {host['logical_cores']} cores, {_gib(host['memory_bytes'])} memory",
          "- packages: " + ", ".join(f"{m} {versions.get(m) or 'not installed'}"
                                     for m in ("pydantic", "transformers", "deepspeed", "vllm", "fastapi")),
          f"- zerospeed: the working tree (revision {record['revision']})",
          f"- time: {record['elapsed_s']:.0f} s of a {budget_s:.0f} s budget", "- command:", "", "```", command, "```",
          "", "## Steps", "", "| step | kind | status | seconds | summary |", "|---|---|---|---|---|"]
    md += [f"| {s.name} | {s.kind} | {s.status} | {s.duration_s:.0f} | {s.summary.replace('|', '/')} |" for s in steps]
    md.append("")
    if problems:
        md += ["## Problems", "", *[f"- {p}" for p in problems], ""]
    failures = [f for s in steps for f in s.failures]
    if failures:
        md += ["## Failed tests", "", *[f"- `{f}`" for f in failures], ""]
    skips = [f"{s.name}: {r}" for s in steps for r in s.data.get("skips", [])] if steps else []
    if skips:
        md += ["## Skipped tests", "", *[f"- {r}" for r in skips], ""]
    fig_md, notes = figures(steps)
    md += fig_md
    if notes:
        md += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    bad = [s for s in steps if s.status in ("fail", "timeout") and s.tail]
    for s in bad:
        md += [f"## Output of {s.name} (last lines)", "", "```", *s.tail[-25:], "```", ""]
    md_path = stem.with_suffix(".md")
    md_path.write_text("\n".join(md))
    return json_path, md_path, ok
