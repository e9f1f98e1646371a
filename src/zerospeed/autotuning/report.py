"""The tuner's results folder: summary table, machine-readable results, optimal config, plot.

Every file is written to a temporary name and renamed, so an interrupted tuner never leaves a
half-written ``ds_config_optimal.json``. The plot (``metric.png``, matplotlib's Agg backend) shows
the metric per experiment in the order they finished, failed ones as red marks at zero, and the
best one highlighted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zerospeed.autotuning.experiment import Result
from zerospeed.config import extras


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary_table(results: dict[str, Result], best: Result | None, metric: str,
                  skipped: list[dict[str, Any]]) -> str:
    width = max([len(n) for n in results] + [len("experiment")])
    lines = [f"{'experiment':<{width}}  {'status':<11}  {metric:>12}  {'peak MiB':>9}  {'time s':>7}  note"]
    for name, r in results.items():
        value = r.metric(metric)
        peak = r.metrics.get("peak_memory_bytes")
        lines.append(f"{name:<{width}}  {r.status:<11}  {'' if value is None else f'{value:.4g}':>12}  "
                     f"{'' if peak is None else f'{peak / 2**20:.0f}':>9}  {r.elapsed:7.1f}  "
                     f"{'<- best' if best is not None and name == best.name else r.reason[:160]}")
    if skipped:
        lines += ["", f"skipped before running ({len(skipped)}):"]
        lines += [f"  {s['name']}: {s['reason']}" for s in skipped]
    return "\n".join(lines) + "\n"


def plot(path: Path, results: dict[str, Result], best: Result | None, metric: str) -> None:
    matplotlib = extras.require("matplotlib", feature="autotuning's plot (metric.png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    values = [results[n].metric(metric) for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(names) + 2), 4.0), dpi=100)
    colors = ["tab:green" if best is not None and n == best.name else "tab:blue" for n in names]
    ax.bar(range(len(names)), [v or 0.0 for v in values], color=colors)
    failed = [i for i, v in enumerate(values) if v is None]
    if failed:
        ax.scatter(failed, [0.0] * len(failed), marker="x", color="tab:red", label="failed", zorder=3)
        ax.legend()
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=75, ha="right", fontsize=6)
    ax.set_ylabel({"throughput": "throughput (samples/s)", "latency": "latency (s/step)",
                   "flops": "FLOP/s per rank"}.get(metric, metric))
    ax.set_title(f"autotuning: {metric} per experiment (best in green)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def write_results(results_dir: Path, results: dict[str, Result], best: Result | None, metric: str,
                  skipped: list[dict[str, Any]], optimal_config: dict[str, Any] | None,
                  optimal_command: str | None) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    _atomic(results_dir / "summary.txt", summary_table(results, best, metric, skipped))
    _atomic(results_dir / "results.json", json.dumps({
        "metric": metric, "best": best.name if best else None,
        "experiments": [r.to_json() for r in results.values()], "skipped": skipped}, indent=2, default=str))
    if optimal_config is not None and optimal_command is not None:
        _atomic(results_dir / "ds_config_optimal.json", json.dumps(optimal_config, indent=2))
        _atomic(results_dir / "cmd_optimal.txt", optimal_command + "\n")
    if results:
        plot(results_dir / "metric.png", results, best, metric)
