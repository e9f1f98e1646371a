"""``zerospeed --autotuning tune|run [launcher flags] script.py --deepspeed_config ds.json ...``.

``tune`` searches and writes the results; ``run`` searches, then trains with the winner through
the same launcher flags (the script gets ``ds_config_optimal.json`` where it named its config).

Decisions:

* Tuning runs on one node: experiments are started through the launcher with the flags given
  (``--num_procs``, or a hostfile naming this machine). A hostfile with several nodes is refused
  with a line saying how to proceed (tune on one node, train across nodes with the optimal
  config), because the experiments would have to be started in lockstep on every node.
* The memory budget defaults to what this machine has per local process: host RAM available on a
  CPU run, the first GPU's memory on a GPU run.
* Every problem (unreadable config, bad ``autotuning`` key, impossible space, failed model-info
  run, nothing runnable) is one ``zerospeed: autotuning: ...`` line and exit status 2 (bad input)
  or 1 (the search found nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from zerospeed.autotuning.autotuner import Autotuner, AutotuneError
from zerospeed.autotuning.experiment import CONFIG_FLAGS, ExperimentRunner, replace_config_arg
from zerospeed.autotuning.space import SpaceError, split_space
from zerospeed.autotuning.tuners import TUNER_PACKAGES
from zerospeed.config.autotuning import AutotuningConfig
from zerospeed.config import extras

EXIT_USAGE = 2
EXIT_NOTHING_FOUND = 1


class AutotuningUsageError(ValueError):
    pass


def config_path_of(user_args: list[str]) -> str:
    for i, arg in enumerate(user_args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(user_args):
                return user_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    raise AutotuningUsageError("the script's arguments name no DeepSpeed config: pass --deepspeed_config PATH "
                               "(or --deepspeed PATH / --config PATH) after the script")


def parse_autotuning(raw: dict[str, Any]) -> AutotuningConfig:
    """The ``autotuning`` section, validated alone (errors name ``autotuning.<key>``)."""
    from zerospeed.config import load_section

    return load_section(raw, "autotuning")


def launcher_args_of(argv: list[str], args: argparse.Namespace) -> list[str]:
    """The launcher flags the experiments reuse: everything before the script, minus ``--autotuning``."""
    head = argv[: len(argv) - len(args.user_args) - 1]
    out: list[str] = []
    skip = False
    for token in head:
        if skip:
            skip = False
            continue
        if token == "--autotuning":
            skip = True
            continue
        if token.startswith("--autotuning="):
            continue
        out.append(token)
    return out


def _plan_sizes(torchrun_argv: list[str]) -> tuple[int, int]:
    def value(flag: str, default: str) -> str:
        return torchrun_argv[torchrun_argv.index(flag) + 1] if flag in torchrun_argv else default

    return int(value("--nnodes", "1").split(":")[-1]), int(value("--nproc_per_node", "1"))


def default_budget(nproc: int) -> tuple[int, bool]:
    import psutil
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory), True
    return int(psutil.virtual_memory().available // max(1, nproc)), False


def main(args: argparse.Namespace, argv: list[str], torchrun_argv: list[str]) -> int:
    """Run the tuner for parsed launcher ``args`` (see the module docstring)."""
    from zerospeed.config import ConfigError, read_config_source

    try:
        config_path = config_path_of(args.user_args)
        raw = read_config_source(Path(config_path).expanduser())
        if not isinstance(raw, dict):
            raise AutotuningUsageError(f"{config_path}: the top level must be a JSON object")
        at = parse_autotuning(raw)
        nnodes, nproc = _plan_sizes(torchrun_argv)
        if nnodes > 1:
            raise AutotuningUsageError(
                f"--autotuning runs its experiments on one node, but this launch has {nnodes} nodes: tune with "
                "--num_procs on one node, then train across nodes with ds_config_optimal.json")
        space = split_space(raw, at.fast)
        # the tuner's package and the plot's, before the first experiment rather than after the last
        extras.check(*TUNER_PACKAGES.get(at.tuner_type, ()), feature=f"autotuning.tuner_type {at.tuner_type!r}")
        extras.check("matplotlib", feature="autotuning's plot (metric.png)")
    except (ConfigError, SpaceError, AutotuningUsageError, extras.MissingExtraError) as err:
        print(f"zerospeed: autotuning: {err}", file=sys.stderr)
        return EXIT_USAGE
    budget, on_gpu = (at.memory_budget, False) if at.memory_budget else default_budget(nproc)
    if at.memory_budget:
        on_gpu = default_budget(nproc)[1]
    world = nnodes * nproc
    runner = ExperimentRunner(exps_dir=Path(at.exps_dir).resolve(), launcher_args=launcher_args_of(argv, args),
                              script=args.user_script, user_args=list(args.user_args),
                              arg_mappings=at.arg_mappings, timeout=at.exp_timeout,
                              memory_budget=at.memory_budget)
    tuner = Autotuner(space=space, at=at, runner=runner, world_size=world,
                      results_dir=Path(at.results_dir).resolve(), memory_budget=budget, on_gpu=on_gpu,
                      log=lambda line: print(line, flush=True))
    print(f"[autotuning] {args.autotuning}: {world} processes, metric {at.metric}, tuner {at.tuner_type}"
          f"{' (fast)' if at.fast else ''}, stages {list(space.stages)}, memory budget "
          f"{budget / 2**30:.2f} GiB per rank; experiments in {runner.exps_dir}", flush=True)
    try:
        tuner.tune()
    except AutotuneError as err:
        print(f"zerospeed: autotuning: {err}", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    if args.autotuning != "run":
        return 0
    optimal = str(tuner.results_dir / "ds_config_optimal.json")
    from zerospeed.launcher.runner import LaunchPlan, run_torchrun

    script_at = len(torchrun_argv) - len(args.user_args)
    train_argv = torchrun_argv[:script_at] + runner.script_args(Path(optimal), tuner.best().candidate)
    # the program starts at the script (or its --module flag); a --no_python binary cannot be wrapped
    program_at = None if args.no_python else script_at - 1 - (1 if args.module else 0)
    print(f"[autotuning] training with {optimal}", flush=True)
    return run_torchrun(LaunchPlan(train_argv, program_at=program_at).worker_argv(), program=args.user_script)


__all__ = ["main", "config_path_of", "launcher_args_of", "parse_autotuning", "replace_config_arg"]
