"""A DeepSpeed-style script (tests/scripts/deepspeed_style_train.py, written for the suite) runs with
only ``import zerospeed as deepspeed``, through the launcher at world size 2 (issue 20)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_style_train.py"


@pytest.mark.timeout(150)
def test_deepspeed_style_script_through_the_launcher(tmp_path: Path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 0,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", "2", str(SCRIPT), "--deepspeed",
           "--deepspeed_config", str(cfg), "--out", str(tmp_path)]
    result = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rep in enumerate(reports):
        assert (rep["rank"], rep["local_rank"], rep["world_size"], rep["device"]) == (r, r, 2, "cpu")
        assert (rep["stage"], rep["fp16"], rep["bf16"]) == (3, False, False)
        assert rep["ranks"] == [0.0, 1.0] and rep["accelerator"] == "cpu" and rep["moe_params"] == 0
        assert rep["global_steps"] == 8 and rep["grad_norm"] > 0 and rep["cpu_adam"] == "CPUAdam"
        assert len(rep["losses"]) == 16 and all(x == x for x in rep["losses"])
    assert reports[0]["final_mean"] == pytest.approx(reports[1]["final_mean"], rel=1e-6)
    first = sum(reports[0]["losses"][:2]) / 2
    assert reports[0]["final_mean"] < 0.3 * first, reports[0]["losses"]  # it learns
    assert "stage 3 on 2 ranks" in result.stdout + result.stderr
    assert "end of training" in result.stdout + result.stderr
