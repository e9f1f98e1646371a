"""The demo script (examples/train_gpt.py, what `make demo` runs) on real text: a short run on one
process writes its summary and a valid PNG of the loss curves and tokens/s."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_demo_trains_on_stdlib_text_and_writes_a_png(tmp_path):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "steps_per_print": 0}
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(config))
    plot = tmp_path / "out" / "demo.png"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--config", str(cfg_path),
                           "--steps", "3", "--eval_every", "2", "--plot", str(plot), "--sample_bytes", "8"],
                          capture_output=True, text=True, timeout=170, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "stdlib source" in out and "== summary ==" in out and "model state per rank" in out
    assert f"plot: {plot}" in out and "sample (temperature 0.8" in out
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"  # PNG signature
    import matplotlib.image

    image = matplotlib.image.imread(str(plot))  # decodes the whole file
    assert image.shape[0] > 400 and image.shape[1] > 600 and image.std() > 0.05  # not a blank canvas


def test_stdlib_corpus_split_is_by_file_and_deterministic():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from data import ByteTextDataset, stdlib_corpus

    train, held = stdlib_corpus()  # the demo's split: 2 MB, about 5% held out
    assert (train, held) == stdlib_corpus()
    assert len(train) + len(held) >= 2_000_000 and 0.03 < len(held) / (len(train) + len(held)) < 0.2
    assert held not in train and b"def " in train and b"import" in held
    data = ByteTextDataset(train, 64)
    x, y = data[3]
    assert x.shape == (64,) and y.shape == (64,) and (x[1:] == y[:-1]).all()
    with pytest.raises(ValueError, match="need at least seq_len"):
        ByteTextDataset(b"abc", 64)
