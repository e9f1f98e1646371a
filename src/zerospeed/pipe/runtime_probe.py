"""The start-up handshake: one probing forward that agrees activation shapes and turns any failure
into the same clear error on every rank, before the first step changes anything.

Why: in a pipeline, an exception on one rank (a layer that cannot take the activation the previous
stage produces, a loss function that rejects the labels, a rank without a data iterator) leaves
its peers blocked in a receive. The handshake runs micro-batch 0 through every stage in stage order
with ``torch.no_grad()``, modules in eval mode and the RNG state forked (so training is unaffected:
no dropout draws, no batch-norm statistics), and:

* each stage sends its successor a header (``P2P.send_header``) with the activation's metadata
  followed by the tensors, or, if it or any stage before it failed, an error report instead; so
  every rank receives exactly what it expects and nobody waits forever;
* the receiver records the metadata: from then on it allocates receive buffers from it, and the
  sender checks every later activation against it (``PipelineExecutor``);
* finally every rank contributes its error (or None) to one ``all_gather_object`` over the world,
  and all ranks raise :class:`PipelineSetupError` with the first report, or all go on.

The micro-batch it reads stays in the step's :class:`MicroBatchSource`, so the first step trains
on it as usual: the handshake consumes no data.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any

import torch

from zerospeed import comm
from zerospeed.pipe.p2p import ActivationMeta, as_tensors, pack_activation
from zerospeed.pipe.runtime import MicroBatchSource, PipelineExecutor

__all__ = ["PipelineSetupError", "handshake"]


class PipelineSetupError(ValueError):
    """The pipeline cannot run (raised on every rank by the start-up handshake)."""


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


@contextlib.contextmanager
def _probing(modules: list[torch.nn.Module], device: torch.device):
    modes = [m.training for m in modules]
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for m in modules:
                m.eval()
            yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def handshake(executor: PipelineExecutor, source: MicroBatchSource, *, rank: int, needs_loss: bool,
              device: torch.device) -> None:
    """Probe micro-batch 0 through the pipeline; fill ``executor.meta`` or raise on every rank."""
    error: str | None = None
    outputs: dict[int, Any] = {}
    sent: dict[int, ActivationMeta] = {}
    last = executor.num_stages - 1
    with _probing(list(executor.chunks.values()), device):
        for s in sorted(executor.chunks):
            x: Any = None
            received: ActivationMeta | None = None
            if s == 0:
                if error is None:
                    try:
                        x = source.inputs(0)
                    except Exception as exc:  # noqa: BLE001 - reported on every rank below
                        error = f"stage 0 (rank {rank}) could not read its first micro-batch: {_describe(exc)}"
            elif executor.is_local(s - 1):
                x = outputs.pop(s - 1, None)
            else:
                header = executor.p2p.recv_header(executor.rank_of_stage(s - 1))
                if isinstance(header, str):
                    error = error or header
                else:
                    received = header
                    tensors = executor.p2p.recv_tensors(header.tensors, executor.rank_of_stage(s - 1))
                    executor.meta[s] = header
                    x = pack_activation(tensors, header)
            out: Any = None
            if error is None:
                out, meta, error = _probe_stage(executor, s, x, received, source, rank, needs_loss)
                if meta is not None:
                    sent[s] = meta
            if s < last:
                if executor.is_local(s + 1):
                    outputs[s] = out
                else:
                    dst = executor.rank_of_stage(s + 1)
                    if error is None:
                        executor.p2p.send_header(dst, sent[s])
                        executor.p2p.send_tensors(as_tensors(out), dst)
                    else:
                        executor.p2p.send_header(dst, None, error=error)
        executor.p2p.wait_sends()
    reports = comm.all_gather_object(error)
    failures = [r for r in reports if r is not None]
    if failures:
        raise PipelineSetupError(f"the pipeline cannot run: {failures[0]}")
    executor.set_sent_meta(sent)


def _probe_stage(executor: PipelineExecutor, s: int, x: Any, received: ActivationMeta | None,
                 source: MicroBatchSource, rank: int, needs_loss: bool
                 ) -> tuple[Any, ActivationMeta | None, str | None]:
    """Run stage ``s`` on ``x``: (output, its metadata for a non-last stage, error report or None)."""
    where = f"pipeline stage {s} (rank {rank})"
    try:
        out = executor.chunks[s](x)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        came = "" if received is None else f" on the activation it receives from stage {s - 1}, {received}"
        return None, None, f"{where} failed{came}: {_describe(exc)}"
    if s < executor.num_stages - 1:
        try:
            return out, ActivationMeta.of(out), None
        except TypeError as exc:
            return None, None, f"{where}: {exc}"
    if not needs_loss:
        return out, None, None
    try:
        labels = source.labels(0)
    except Exception as exc:  # noqa: BLE001
        return None, None, f"{where} could not read labels: {_describe(exc)}"
    try:
        loss = executor.loss_fn(out, labels) if executor.loss_fn is not None else out
    except Exception as exc:  # noqa: BLE001
        return None, None, (f"{where}: loss_fn failed on the stage output {_shapes(out)} and labels "
                            f"{_shapes(labels)}: {_describe(exc)}")
    if not torch.is_tensor(loss) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if torch.is_tensor(loss) else type(loss).__name__
        return None, None, (f"{where}: the last stage must produce a scalar loss (loss_fn(outputs, labels), or "
                            f"the output itself without loss_fn), got {got}")
    return out, None, None


def _shapes(value: Any) -> str:
    try:
        return str(ActivationMeta.of(value))
    except TypeError:
        return type(value).__name__
