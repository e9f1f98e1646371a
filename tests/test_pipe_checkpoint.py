"""PipelineEngine checkpoints (pp x dp): one checkpoint folder for the whole world.

Every rank of every stage writes ``rank<global rank>.safetensors`` into one staging folder; after a
world-wide agreement global rank 0 alone writes ``index.json`` (all stages' parameters, the weight
tied between the first and last stage stored once) and publishes the folder (before the fix each
stage's first rank published the same folder and one rename removed the other's staging folder).

* 2 stages (world 2), sync and async save: a fresh engine loads and resumes with the continued
  run's losses bit for bit; the folder holds both rank files and nothing is left in staging;
* the same folder loads at 2 stages x 2 replicas with ZeRO-1 (world 4) and at 4 stages (world 4),
  both resuming with the continued losses to 1e-5 (float reduction order differs).
"""
import json
import os

import pytest

from pipe_ckpt_cases import resume_only, save_and_resume
from zerospeed.testing import run_distributed

TOL = 1e-5


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def _check_folder(save_dir: str, runs: list[dict]) -> None:
    for r in runs:
        assert r["resumed"] == r["continued"], r  # same world: bit for bit
        assert r["global_steps"] == 2
        assert r["client"] == {"stage": 0}  # client_state is global rank 0's
    assert runs[0]["listing"] == ["global_step2", "latest"]  # no staging folder left behind
    assert runs[0]["tag_files"] == ["index.json", "rank00000.safetensors", "rank00001.safetensors"]
    with open(os.path.join(save_dir, "global_step2", "index.json")) as f:
        index = json.load(f)
    assert index["world_size"] == 2 and len(index["rng"]) == 2
    names = set(index["params"])
    assert any(n.startswith("tied_modules.embed.") for n in names)
    assert {n.split(".")[0] for n in names if not n.startswith("tied_modules.")} == {str(i) for i in range(1, 7)}
    for name, p in index["params"].items():  # every parameter covered exactly once (the tied one too)
        numel = 1
        for d in p["shape"]:
            numel *= d
        assert sum(piece[3] for piece in p["pieces"]) == numel, name


@pytest.mark.timeout(300)
def test_two_stage_save_load_resume_and_reshard(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    runs = run_distributed(save_and_resume, 2, save_dir, timeout=100)
    _check_folder(save_dir, runs)
    continued = runs[0]["continued"]
    # 2 stages x 2 replicas with ZeRO-1, and 4 stages, load the 2 x 1 folder
    for stages, zero in ((2, 1), (4, 0)):
        for r in run_distributed(resume_only, 4, save_dir, stages, zero, timeout=100):
            assert r["global_steps"] == 2
            assert _close(r["resumed"], continued, TOL), (stages, zero, r["resumed"], continued)


@pytest.mark.timeout(180)
def test_two_stage_async_save(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    _check_folder(save_dir, run_distributed(save_and_resume, 2, save_dir, 0, True, timeout=100))
