"""HuggingFace transformers on zerospeed: saving for ``from_pretrained`` and the ``Trainer``.

* :func:`save_pretrained` - ``save_pretrained(engine, save_dir)`` writes an HF folder (config and
  consolidated safetensors) that ``AutoModel.from_pretrained(save_dir)`` loads; every rank calls it
  (stage 3 gathers the partitioned weights, one bucket at a time), rank 0 writes.
* :func:`resize_token_embeddings` - HF's resize on a ``zero.Init`` model (before the engine).
* :class:`ZeroSpeedTrainer` - see :mod:`zerospeed.integrations.hf_trainer`.

Decision: at ZeRO-3, ``engine.module.save_pretrained(dir)`` without a state dict raises (the
module's state-dict hook, :mod:`zerospeed.zero.stage3.state_dict_guard`) rather than gathering:
HF code calls it on rank 0 only, where a gather would wait for the other ranks forever.
"""

from __future__ import annotations

import os
from typing import Any

from zerospeed import comm


def _module_of(engine: Any) -> Any:
    module = getattr(engine, "module", None)
    if module is None or not hasattr(engine, "consolidated_state_dict"):
        raise TypeError(f"save_pretrained: expected a zerospeed engine (from zerospeed.initialize), "
                        f"got {type(engine).__name__}")
    if not callable(getattr(module, "save_pretrained", None)):
        raise TypeError(f"save_pretrained: engine.module is a {type(module).__name__}, not a HuggingFace "
                        "PreTrainedModel; use engine.save_16bit_model(save_dir) for plain modules")
    return module


def save_pretrained(engine: Any, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """Write ``engine.module`` as a HuggingFace folder loadable by ``from_pretrained`` (safetensors).

    A collective over the engine's data-parallel group: every rank calls it; rank 0 writes.
    ``kwargs`` go to ``PreTrainedModel.save_pretrained`` (``max_shard_size``, ``variant``...).
    """
    module = _module_of(engine)
    if not isinstance(save_directory, (str, os.PathLike)) or not str(save_directory):
        raise ValueError(f"save_pretrained: save_directory must be a directory path, got {save_directory!r}")
    if os.path.isfile(save_directory):
        raise ValueError(f"save_pretrained: {save_directory!r} is a file, not a directory")
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise ValueError(f"save_pretrained: {key}= is chosen by zerospeed (consolidated weights, rank 0 "
                             "writes); leave it out")
    state_dict = engine.consolidated_state_dict()
    error: str | None = None
    if comm.get_rank() == 0:
        try:
            module.save_pretrained(save_directory, state_dict=state_dict, is_main_process=True, **kwargs)
        except Exception as exc:  # every rank learns of it instead of waiting for rank 0
            error = f"{type(exc).__name__}: {exc}"
    errors = comm.all_gather_object(error) if comm.get_world_size() > 1 else [error]
    failed = next((e for e in errors if e), None)
    if failed:
        raise RuntimeError(f"save_pretrained: writing {save_directory} failed on rank 0: {failed}")


__all__ = ["ZeroSpeedTrainer", "resize_token_embeddings", "save_pretrained"]


def resize_token_embeddings(model: Any, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True) -> Any:
    """HF's ``model.resize_token_embeddings`` for a model whose parameters ``zero.Init`` partitioned.

    The embedding and LM-head parameters are gathered around HF's own resize (rank 0's new values
    win) and re-partitioned with their new shapes. Call it on every rank, *before*
    ``zerospeed.initialize`` (an engine's optimizer state is laid out for the old vocabulary, and a
    shape change under an engine raises). On a model that is not partitioned it is HF's call.
    """
    from zerospeed import zero

    if hasattr(model, "consolidated_state_dict") and hasattr(model, "module"):
        raise ValueError("resize_token_embeddings: resize the model before zerospeed.initialize (the engine's "
                         "optimizer state is laid out for the old vocabulary); call it on the zero.Init model")
    if not callable(getattr(model, "resize_token_embeddings", None)):
        raise TypeError(f"resize_token_embeddings: {type(model).__name__} is not a HuggingFace PreTrainedModel")
    from zerospeed.zero.stage3 import registry

    modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    params = [p for m in modules if m is not None for p in m.parameters()]
    found = next((f for p in params if (f := registry.lookup(p)) is not None), None)
    with zero.GatheredParameters(params, modifier_rank=0):
        out = model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of=pad_to_multiple_of,
                                            mean_resizing=mean_resizing)
    if found is not None:  # HF replaces the LM head by a new module: partition it like the rest
        bucket = found[0]
        for module in model.modules():
            fresh = [p for p in module.parameters(recurse=False) if registry.lookup(p) is None]
            if fresh:
                zero.Init(module=module, data_parallel_group=bucket.group, dtype=bucket.dtype,
                          remote_device="cpu" if bucket.device.type == "cpu" and comm.device_for_backend().type != "cpu"
                          else None)
    return out


def __getattr__(name: str) -> Any:
    if name == "ZeroSpeedTrainer":  # imported on use: it needs transformers' Trainer (and accelerate)
        from zerospeed.integrations.hf_trainer import ZeroSpeedTrainer

        return ZeroSpeedTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
