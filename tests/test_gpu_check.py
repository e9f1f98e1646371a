"""``make gpu-check`` (bench/gpu_check.py) on a machine without CUDA: the one line and exit 0, what
``--dry-run`` lists, and - with the CUDA probe and the steps replaced by stand-ins - how steps end (pass,
fail with the failed tests named, skipped for a missing package or the time budget, killed at their
limit), the report it writes and its exit status. The benchmark workers (bench/gpu_bench.py) run on
the CPU at a tiny size, so their code is exercised here too."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402

pytestmark = pytest.mark.timeout(180)
NO_CUDA_LINE = "gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing to run"


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def _make(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: gpu-check would run")
def test_without_cuda_one_line_and_exit_0(tmp_path):
    r = _script("--out-dir", str(tmp_path))
    assert (r.returncode, r.stdout, r.stderr) == (0, NO_CUDA_LINE + "\n", "")
    assert list(tmp_path.iterdir()) == []  # no report: nothing ran
    m = _make("-s", "gpu-check", f"GPU_CHECK_ARGS=--out-dir {tmp_path}")
    assert (m.returncode, m.stdout) == (0, NO_CUDA_LINE + "\n"), m.stderr


def test_dry_run_lists_the_steps_and_runs_none(tmp_path):
    t0 = time.monotonic()
    r = _script("--dry-run", "--out-dir", str(tmp_path), "--wheels", ".whl")
    assert r.returncode == 0 and time.monotonic() - t0 < 30, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("gpu-check --dry-run: would run 8 steps within 1500 s")
    assert "whose torch sees CUDA" in lines[0]
    assert lines[1].startswith("  0. install .whl/*.whl: PYTHON -m pip install --no-index --no-deps --target")
    steps = lines[2:-1]
    assert [s.split("] ")[1].split(" (")[0] for s in steps] == [
        "device_parity", "device_multirank", "offload-zerospeed", "offload-deepspeed", "make-llama",
        "inference-zerospeed", "inference-hf", "inference-vllm"]
    assert "-m pytest" in steps[0] and steps[0].endswith("tests/test_device_parity.py")
    assert steps[1].endswith("tests/test_device_multirank.py")
    assert "bench/gpu_bench.py offload --system zerospeed --size auto" in steps[2]
    assert "only if deepspeed imports, not fatal" in steps[3] and "DS_ACCELERATOR=cuda" in steps[3]
    assert "only if vllm imports, not fatal" in steps[7] and "inference --system hf" in steps[6]
    assert lines[-1].startswith(f"then write {tmp_path}/gpu-<UTC date>.md and .json")
    assert list(tmp_path.iterdir()) == []
    only = _script("--dry-run", "--only", "tests").stdout
    assert "would run 2 steps" in only and "gpu_bench" not in only
    picked = _script("--dry-run", "--steps", "make-llama,inference-hf").stdout.splitlines()
    assert "would run 2 steps" in picked[0] and "make-llama" in picked[1] and "inference --system hf" in picked[2]
    bad = _script("--steps", "offload,make-llama")
    assert bad.returncode == 1 and "--steps: unknown offload; choose from device_parity," in bad.stderr
    # make's own dry run (-n / --dry-run) runs the script's instead of printing the recipe only
    for flag in ("-n", "--dry-run"):
        m = _make(flag, "gpu-check")
        assert m.returncode == 0 and "would run 8 steps" in m.stdout and "tests/test_device_parity.py" in m.stdout


def _fake_steps(tmp_path: Path) -> list:
    tests = tmp_path / "fake_test.py"
    tests.write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("device", ["cpu", "cuda"])
        def test_ok(device):
            pass

        def test_bad():
            assert 1 == 2, "boom"

        @pytest.mark.skip(reason="the server needs fastapi")
        def test_server():
            pass
    """))
    py = sys.executable
    xml = str(tmp_path / "fake.xml")
    figures = {"bench": "offload", "system": "zerospeed", "size": "2.7b", "params": 2.65e9, "micro_batch": 4,
               "seq_len": 1024, "step_s": 4.0, "tokens_per_s": 1024.0, "model_tflops": 16.3,
               "peak_gpu_bytes": 30 * 2**30, "peak_host_rss_bytes": 60 * 2**30, "losses": [10.9, 10.1]}
    out = tmp_path / "offload-zerospeed.json"
    write = f"import json, pathlib; pathlib.Path({str(out)!r}).write_text(json.dumps({figures!r}))"
    S = gpu_check.Step
    return [
        # --rootdir: the junit names are relative to it (else to wherever pytest finds one: a checkout under /tmp
        # made them 'pytest-of-root.pytest-N....fake_test')
        S("device_parity", "test", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}",
                                    f"--junitxml={xml}", str(tests)], 60, True, result_file=xml),
        S("offload-zerospeed", "bench", [py, "-c", write], 60, True, result_file=str(out)),
        S("offload-deepspeed", "bench", [py, "-c", "raise SystemExit(3)"], 60, False, needs="deepspeed"),
        S("inference-hf", "bench", [py, "-c", "import time; time.sleep(60)"], 1, False),
    ]


def test_steps_end_as_they_should_and_the_report_says_so(tmp_path, monkeypatch):
    info = {"cuda": True, "gpu": "Fake GPU 80GB", "gpu_bytes": 80 * 2**30, "capability": "9.0", "torch": "2.11.0",
            "cuda_version": "13.0", "python": "3.12.3", "executable": sys.executable,
            "modules": {m: m not in ("deepspeed", "vllm") for m in (*gpu_check.REQUIRED, *gpu_check.OPTIONAL)},
            "versions": {"deepspeed": None}}
    monkeypatch.setattr(gpu_check, "find_cuda_python", lambda explicit: (sys.executable, dict(info)))
    monkeypatch.setattr(gpu_check, "probe", lambda python, env: dict(info))
    steps = _fake_steps(tmp_path)
    monkeypatch.setattr(gpu_check, "plan", lambda python, work, size, only: steps)
    out = tmp_path / "results"
    assert gpu_check.main(["--out-dir", str(out)]) == 1  # a test step failed
    parity, offload, deepspeed, hf = steps
    assert parity.status == "fail" and parity.data["counts"] == {"passed": 2, "failed": 1, "errors": 0,
                                                                 "skipped": 1, "cuda_passed": 1}
    assert parity.failures == ["fake_test::test_bad: AssertionError: boom"]
    assert parity.data["skips"] == ["1 x the server needs fastapi"]
    assert offload.status == "pass" and offload.data["tokens_per_s"] == 1024.0
    assert (deepspeed.status, deepspeed.summary) == ("skipped", "deepspeed not installed on this machine")
    assert hf.status == "timeout" and hf.summary == "killed after 1 s" and hf.duration_s < 30
    [md] = out.glob("gpu-*.md")
    [js] = out.glob("gpu-*.json")
    text = md.read_text()
    assert "- result: **FAIL** (failed: device_parity)" in text and "Fake GPU 80GB" in text
    assert "- `fake_test::test_bad: AssertionError: boom`" in text
    assert "| zerospeed | pass | 4 | 1024 | 16.3 |" in text and "10.9000 -> 10.1000" in text
    assert "DeepSpeed not installed on this machine" in text and "--download-wheels" in text
    assert "## Output of device_parity (last lines)" in text
    record = json.loads(js.read_text())
    assert record["passed"] is False and record["failed_steps"] == ["device_parity"]
    assert [s["status"] for s in record["steps"]] == ["fail", "pass", "skipped", "timeout"]


def test_a_passing_run_exits_0_and_the_budget_skips_what_would_not_fit(tmp_path, monkeypatch):
    info = {"cuda": True, "gpu": "Fake GPU", "modules": {m: True for m in gpu_check.REQUIRED}}
    monkeypatch.setattr(gpu_check, "find_cuda_python", lambda explicit: (sys.executable, dict(info)))
    monkeypatch.setattr(gpu_check, "probe", lambda python, env: dict(info))
    steps = [gpu_check.Step("quick", "bench", [sys.executable, "-c", "pass"], 60, True),
             gpu_check.Step("slow", "bench", [sys.executable, "-c", "import time; time.sleep(3)"], 60, True),
             gpu_check.Step("late", "bench", [sys.executable, "-c", "pass"], 60, True)]
    monkeypatch.setattr(gpu_check, "plan", lambda python, work, size, only: steps)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 2.0)
    assert gpu_check.main(["--out-dir", str(tmp_path), "--budget-s", "4"]) == 0
    assert [s.status for s in steps] == ["pass", "pass", "skipped"]
    assert steps[2].summary.startswith("out of time budget")
    # a missing required package: nothing runs, the report names it, exit 1
    info["modules"]["pydantic"] = False
    fresh = [gpu_check.Step("quick", "bench", [sys.executable, "-c", "pass"], 60, True)]
    monkeypatch.setattr(gpu_check, "plan", lambda python, work, size, only: fresh)
    assert gpu_check.main(["--out-dir", str(tmp_path / "missing")]) == 1
    assert fresh[0].status == "skipped"
    [md] = (tmp_path / "missing").glob("gpu-*.md")
    assert "lacks pydantic: carry wheels" in md.read_text()


def test_offload_size_is_the_largest_that_fits():
    from gpt_cases import GPT, GPTConfig

    gib = 2**30
    assert gpu_bench.choose_offload_size(128 * gib, 80 * gib) == "2.7b"  # host memory decides: 16 B/param
    assert gpu_bench.choose_offload_size(1024 * gib, 140 * gib) == "13b"
    assert gpu_bench.choose_offload_size(16 * gib, 80 * gib) == "350m"
    assert gpu_bench.choose_offload_size(128 * gib, 8 * gib) == "125m"  # the GPU decides: activations, logits
    assert gpu_bench.choose_offload_size(1 * gib, 80 * gib) is None
    n_layer, d, heads = gpu_bench.SIZES["tiny"]
    model = GPT(GPTConfig(vocab_size=gpu_bench.VOCAB, n_layer=n_layer, n_head=heads, d_model=d, seq_len=64))
    assert gpu_bench.num_params("tiny", seq=64) == model.num_parameters()


def test_benchmark_workers_run_on_cpu_at_a_tiny_size(tmp_path):
    env = gpu_check.step_env(None)
    env["OMP_NUM_THREADS"] = "1"

    def worker(*args: str) -> dict:
        out = tmp_path / "result.json"
        r = subprocess.run([sys.executable, "bench/gpu_bench.py", *args, "--device", "cpu", "--result", str(out)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(out.read_text())

    off = worker("offload", "--system", "zerospeed", "--size", "tiny", "--seq", "32", "--micro-batch", "2",
                 "--steps", "2", "--warmup", "1")
    assert off["params"] == gpu_bench.num_params("tiny", seq=32) and len(off["losses"]) == 3
    assert off["tokens_per_s"] > 0 and off["peak_gpu_bytes"] is None
    llama = worker("make-llama", "--shape", "tiny", "--out", str(tmp_path / "llama"))
    assert llama["params"] > 0 and (tmp_path / "llama" / "config.json").is_file()
    runs = {s: worker("inference", "--system", s, "--model-dir", str(tmp_path / "llama"), "--num-prompts", "3",
                      "--prompt-len", "8", "--new-tokens", "6") for s in ("zerospeed", "hf")}
    for r in runs.values():
        assert r["generated_tokens"] == 18 and r["tokens_per_s"] > 0 and len(r["first_tokens"]) == 3
