"""Issue #33: importing torchao (as transformers' model code does) after zerospeed prints nothing on a CPU torch,
and the filters keep every message they are not about."""

from __future__ import annotations

import enum
import logging
import os
import subprocess
import sys

import pytest
import torch

from zerospeed._import_noise import TorchaoEnumRegistrationFilter, TorchaoKernelLoadFilter


@pytest.mark.timeout(120)
def test_transformers_models_import_quietly_after_zerospeed() -> None:
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: torchao's library load failures are real errors there and are kept")
    code = "import zerospeed\nfrom transformers import GPT2LMHeadModel\nimport torchao\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr == "", out.stderr


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("x", logging.WARNING, __file__, 1, msg, args, None)


def test_kernel_load_filter_drops_only_torchao_libraries_on_cpu_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    f = TorchaoKernelLoadFilter()
    ours = "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not f.filter(_record(ours))
    assert f.filter(_record("Failed to load /venv/site-packages/other/_C_x.so: Could not load"))
    assert f.filter(_record("Skipping import of cpp extensions due to incompatible torch version."))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert f.filter(_record(ours))  # with CUDA, a real failure


def test_enum_filter_drops_only_torchao_enums() -> None:
    f = TorchaoEnumRegistrationFilter()
    msg = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    theirs = enum.Enum("KernelPreference", "A B")
    theirs.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    mine = enum.Enum("Mode", "A B")
    assert not f.filter(_record(msg, theirs))
    assert f.filter(_record(msg, mine))
    assert f.filter(_record("%s something else", theirs))
