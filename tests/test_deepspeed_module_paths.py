"""DeepSpeed's module paths as attribute chains after the top-level import alone (issue #27).

``import deepspeed`` loads most of its module tree, so scripts write ``deepspeed.runtime.utils.set_random_seed(...)``
with nothing but ``import deepspeed`` above (DeepSpeedExamples' pipeline_parallelism/train.py does). zerospeed loads
its submodules on first use (zerospeed._submodules), and every DeepSpeed path that zerospeed builds must resolve the
same way after ``import zerospeed``.

``deepspeed_module_tree.txt`` lists DeepSpeed 0.19.8's tree: the 420 ``deepspeed.*`` modules in ``sys.modules`` after
``import deepspeed`` that are reachable from the package as attribute chains (made in the bench venv: import
deepspeed, then walk ``sys.modules`` and keep the names whose ``getattr`` chain from ``deepspeed`` returns that
module). A path "zerospeed builds" is one whose ``zerospeed.*`` counterpart exists as a module; DeepSpeed internals
zerospeed does not have (``deepspeed.runtime.zero.stage3``...) raise ``AttributeError`` as any unknown name does.

Each path is resolved in an interpreter where its module has not been imported yet, since that is the case the
lazy loading must handle: a worker interpreter resolves every path whose module is still unloaded when its turn
comes and hands back the ones an earlier resolution loaded as a side effect, which the next fresh interpreter takes
first (a few interpreters in all, instead of one per path). A module that its own parent packages import (found
loaded once its parents are) is resolved where it stands: any script that reaches its parent has it loaded too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TREE = Path(__file__).with_name("deepspeed_module_tree.txt")

#: paths whose attribute is, in zerospeed, a public name of the package rather than the module (``import`` of the
#: module path still works: ``from zerospeed.module_inject.auto_tp import AutoTP``)
SHADOWED = {
    "zerospeed.module_inject.auto_tp": "zerospeed.module_inject.auto_tp is the auto_tp() function (issue 20's "
                                       "public AutoTP entry), named like its module",
}

_WORKER = r"""
import functools, importlib.util, json, sys
todo = json.loads(sys.argv[1])
import zerospeed
result = {"ok": [], "failed": {}, "absent": [], "deferred": []}
for path in todo:
    if path in sys.modules:
        result["deferred"].append(path)
        continue
    try:
        exists = importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        exists = False
    if not exists:
        result["absent"].append(path)
        continue
    try:
        obj = functools.reduce(getattr, path.split(".")[1:], zerospeed)
        assert getattr(obj, "__name__", None) == path, f"resolves to {obj!r}"
        result["ok"].append(path)
    except Exception as exc:
        result["failed"][path] = f"{type(exc).__name__}: {exc}"
print(json.dumps(result))
"""


def _zerospeed_paths() -> list[str]:
    lines = [line.strip() for line in TREE.read_text().splitlines()]
    return ["zerospeed" + line[len("deepspeed"):] for line in lines if line.startswith("deepspeed")]


def _resolve_each_fresh(paths: list[str]) -> dict[str, object]:
    todo, outcome = list(paths), {"ok": [], "failed": {}, "absent": []}
    for _ in range(len(paths)):
        if not todo:
            break
        run = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(todo)], capture_output=True, text=True,
                             timeout=240, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        outcome["ok"] += result["ok"]
        outcome["absent"] += result["absent"]
        outcome["failed"].update(result["failed"])
        assert len(result["deferred"]) < len(todo), "no progress"
        todo = result["deferred"]
    return outcome


@pytest.mark.timeout(600)
def test_every_deepspeed_path_zerospeed_builds_resolves_after_import_zerospeed() -> None:
    paths = _zerospeed_paths()
    assert len(paths) == 420
    outcome = _resolve_each_fresh(paths)
    for path in SHADOWED:
        assert path in outcome["failed"], f"{path} resolves now: drop it from SHADOWED"
        del outcome["failed"][path]
    assert not outcome["failed"], "paths that exist but do not resolve as attributes: " + json.dumps(outcome["failed"])
    ok = set(outcome["ok"])
    # the paths the issue names, and the compatibility modules built for it
    for path in ("zerospeed.runtime.utils", "zerospeed.runtime.lr_schedules", "zerospeed.runtime.engine",
                 "zerospeed.runtime.zero", "zerospeed.runtime.zero.partition_parameters", "zerospeed.moe.layer",
                 "zerospeed.ops.adam", "zerospeed.comm", "zerospeed.pipe", "zerospeed.utils.logging"):
        assert path in ok, path
    assert len(ok) + len(outcome["absent"]) + len(SHADOWED) == 420


def test_unknown_names_still_raise_attribute_error() -> None:
    import zerospeed

    for holder, name in ((zerospeed, "no_such_module"), (zerospeed, "_private"), (zerospeed.runtime, "stage3")):
        with pytest.raises(AttributeError, match=repr(name)):
            getattr(holder, name)
    assert not hasattr(zerospeed.runtime.zero, "TiledLinear")  # a DeepSpeed name zerospeed does not build


def test_partition_parameters_names_are_zerospeeds_objects() -> None:
    import torch

    import zerospeed.zero
    from zerospeed.runtime.zero import partition_parameters as pp

    assert pp.Init is zerospeed.zero.Init and pp.GatheredParameters is zerospeed.zero.GatheredParameters
    assert pp.register_external_parameter is zerospeed.zero.register_external_parameter
    assert zerospeed.runtime.zero.Init is zerospeed.zero.Init
    assert pp._orig_torch_arange is torch.arange  # zerospeed never replaces torch's constructors
    make = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, "cpu")
    assert make(2).dtype == torch.bfloat16 and make(2, dtype=torch.int32).dtype == torch.int32
    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, None, None)(3).dtype == torch.int64
