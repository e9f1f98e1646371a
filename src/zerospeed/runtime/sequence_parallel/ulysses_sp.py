"""Arctic Long Sequence Training (ALST) for HuggingFace models, with DeepSpeed's public names
(``deepspeed.runtime.sequence_parallel.ulysses_sp``): a DeepSpeed ALST script runs with its imports changed.

* :meth:`UlyssesSPAttentionHF.register_with_transformers` builds the (dp, sp) mesh, and replaces the entry of
  ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` for ``core_attn_implementation`` (e.g. ``"sdpa"``) with a Ulysses
  wrapper around the original, as DeepSpeed does, so every branch of the model that tests the implementation's
  name still runs. It returns the mesh, which answers DeepSpeed's mpu methods; pass it to
  ``zerospeed.initialize(..., mpu=mpu)``. :meth:`UlyssesSPAttentionHF.unregister_from_transformers` (a zerospeed
  addition) puts the original back.
* The wrapper: HF's ``[batch, heads, seq/sp, head_dim]`` q/k/v go through one packed all-to-all (head-sharded,
  whole sequence; KV heads fewer than sp sent to the ranks that share them, not repeated first), the original
  attention runs, and one all-to-all returns ``[batch, seq/sp, heads, head_dim]`` (:mod:`zerospeed.sequence.
  exchange`, counted; two all-to-alls forward and two backward per layer). The local shard's attention mask is discarded (it describes the
  shard, not the sequence; the attention is causal over the gathered sequence, as in DeepSpeed), so padding must
  be at the end of a sample (right padding) with -100 labels.
* :class:`UlyssesSPDataLoaderAdapter` shards each batch's sequence over the sp group, labels pre-shifted into
  ``shift_labels`` so the token at a shard boundary keeps its label, position ids global (they must be in the
  batch, as DeepSpeed requires).

Decisions: "eager" attention is refused as DeepSpeed does (it needs the full 4D mask); a model whose attention
does not dispatch through ``ALL_ATTENTION_FUNCTIONS`` (nothing to hook) and head counts sp cannot split are one
line naming them; the mesh is the one mesh (sequence parallelism with tensor or pipeline parallelism is refused
by ``initialize``).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Callable, Iterator

import torch
from torch import nn

from zerospeed import comm
from zerospeed.sequence.exchange import heads_to_seq, seq_to_heads
from zerospeed.sequence.layer import SequenceParallelError, check_heads, kv_replication
from zerospeed.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]

_ORIGINALS: dict[str, Callable] = {}  # attention implementation name -> the function it had before registration


class UlyssesSPAttentionHF(nn.Module):
    """Ulysses attention around one of transformers' attention functions (``attn(module, q, k, v, mask, ...)``).

    ``attn_head_count`` / ``kv_head_count`` are the model's totals; the wrapper runs ``attn`` on
    ``attn_head_count / sp`` query heads and the KV heads they use (repeated when there are fewer than sp).
    """

    def __init__(self, attn: Callable, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group) if comm.is_initialized() else 1
        self.sp_rank = comm.get_rank(process_group) if comm.is_initialized() else 0
        check_heads(attn_head_count, kv_head_count, self.world_size)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = attn_head_count, attn_head_size, \
            kv_head_count
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.kv_replication_factor = kv_replication(kv_head_count, self.world_size)
        self.local_q_head_count = attn_head_count // self.world_size
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)
        self.core_attn_implementation: str | None = None

    def _check(self, query: torch.Tensor, key: torch.Tensor) -> None:
        if query.shape[1] != self.attn_head_count or key.shape[1] != self.global_kv_head_count:
            raise SequenceParallelError(f"UlyssesSPAttentionHF: got {query.shape[1]} query / {key.shape[1]} key heads, "
                                        f"registered for {self.attn_head_count} / {self.global_kv_head_count}")
        if not self.seq_length_is_variable and query.shape[2] != self.local_seq_length:
            raise SequenceParallelError(f"UlyssesSPAttentionHF: local sequence length {query.shape[2]} but "
                                        f"seq_length={self.global_seq_length} at sp {self.world_size} gives "
                                        f"{self.local_seq_length} (use seq_length_is_variable=True)")

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """``[batch, heads, seq/sp, head_dim]`` q/k/v in, ``([batch, seq/sp, heads, head_dim], weights)`` out."""
        if self.world_size == 1 or (self.disable_in_eval and not module.training):
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check(query, key)
        group, rep = self.process_group, self.kv_replication_factor
        q, k, v = heads_to_seq((query, key, value), group, head_dim=1, seq_dim=2, reps=(1, rep, rep))
        if "position_ids" in kwargs and self.core_attn_implementation not in (None, "sdpa"):
            # flash-attention varlen detection reads them: the whole sequence's, in order
            kwargs["position_ids"] = _gather_seq(kwargs["position_ids"], group)
        saved = getattr(module, "num_key_value_groups", None)
        if saved is not None:  # the local head ratio (changes only when KV heads were repeated)
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            out, weights = self.attn(module, q, k, v, None, *args, **kwargs)
        finally:
            if saved is not None:
                module.num_key_value_groups = saved
        # out: [batch, seq, heads/sp, head_dim] -> [batch, seq/sp, heads, head_dim]
        return seq_to_heads((out,), group, head_dim=2, seq_dim=1)[0], weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Hook Ulysses into transformers' ``core_attn_implementation`` and return the mesh (an mpu), or None when
        ``sequence_parallel_size`` is 1. ``model_name_or_path``: a model (or anything with ``.config``), a hub
        name or a local path (its config is read with ``AutoConfig``)."""
        if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
                or sequence_parallel_size < 1:
            raise SequenceParallelError(f"register_with_transformers: sequence_parallel_size must be a positive int, "
                                        f"got {sequence_parallel_size!r}")
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise SequenceParallelError("register_with_transformers: seq_length is required when "
                                        "seq_length_is_variable=False")
        config = _hf_config(model_name_or_path)
        _check_implementation(config, core_attn_implementation)
        if hasattr(model_name_or_path, "modules"):
            _check_hookable(model_name_or_path)
        if not comm.is_initialized():
            raise SequenceParallelError("register_with_transformers: torch.distributed is not initialised (call "
                                        "zerospeed.init_distributed() first)")
        mesh = comm.build_mesh(sp=sequence_parallel_size)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads, kv_heads = _heads(text)
        if not seq_length_is_variable and seq_length % sequence_parallel_size:
            raise SequenceParallelError(f"register_with_transformers: seq_length {seq_length} is not divisible by "
                                        f"sequence_parallel_size {sequence_parallel_size}")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        original = _ORIGINALS.setdefault(core_attn_implementation, ALL_ATTENTION_FUNCTIONS[core_attn_implementation])
        uattn = cls(attn=original, batch_size=micro_batch_size, attn_head_count=heads,
                    attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                    kv_head_count=kv_heads, num_hidden_layers=text.num_hidden_layers, process_group=mesh.sp_group,
                    seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=None if seq_length is None else seq_length // sequence_parallel_size,
                    global_seq_length=seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        ulysses_attention.ulysses = uattn  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return mesh

    @staticmethod
    def unregister_from_transformers(core_attn_implementation: str | None = None) -> None:
        """Put back the original attention function(s) replaced by :meth:`register_with_transformers`."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        names = [core_attn_implementation] if core_attn_implementation else list(_ORIGINALS)
        for name in names:
            if name in _ORIGINALS:
                ALL_ATTENTION_FUNCTIONS[name] = _ORIGINALS.pop(name)


def _gather_stacked(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``t`` (same shape everywhere) as ``[world, *t.shape]`` (one all-gather of the flat tensor)."""
    world = comm.get_world_size(group)
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    comm.all_gather(out, t.reshape(-1).contiguous(), group=group)
    return out.view(world, *t.shape)


def _gather_seq(t: torch.Tensor, group: Any) -> torch.Tensor:
    return torch.cat(_gather_stacked(t, group).unbind(0), dim=1)


def _hf_config(model_name_or_path: Any) -> Any:
    if hasattr(model_name_or_path, "config"):
        return model_name_or_path.config
    if not isinstance(model_name_or_path, (str,)):
        raise SequenceParallelError(f"register_with_transformers: model_name_or_path must be a model, a hub name or "
                                    f"a path, got {type(model_name_or_path).__name__}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_name_or_path)


def _heads(text_config: Any) -> tuple[int, int]:
    heads = getattr(text_config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise SequenceParallelError(f"register_with_transformers: {type(text_config).__name__} has no "
                                    f"num_attention_heads; its attention cannot be split over heads")
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    return heads, int(kv_heads)


def _check_implementation(config: Any, name: str) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ("eager", "paged|eager"):
        raise SequenceParallelError(f"register_with_transformers: core_attn_implementation {name!r} cannot be hooked "
                                    "(it needs the whole 4D attention mask); use 'sdpa', 'flex_attention' or a flash "
                                    "attention")
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise SequenceParallelError(f"register_with_transformers: core_attn_implementation {name!r} is not one of "
                                    f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
    current = getattr(config, "_attn_implementation", None)
    if current is not None and current != name:
        raise SequenceParallelError(f"register_with_transformers: core_attn_implementation {name!r} but the model's "
                                    f"config uses {current!r}; build the model with attn_implementation={name!r}")


def _check_hookable(model: nn.Module) -> None:
    """Raise unless some module of ``model`` reads its attention from transformers' ``ALL_ATTENTION_FUNCTIONS``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for module in model.modules():
        source = sys.modules.get(type(module).__module__)
        if "Attention" in type(module).__name__ and getattr(source, "ALL_ATTENTION_FUNCTIONS", None) is \
                ALL_ATTENTION_FUNCTIONS:
            return
    raise SequenceParallelError(f"register_with_transformers: {type(model).__name__} has no attention module that "
                                "dispatches through transformers' ALL_ATTENTION_FUNCTIONS, so Ulysses cannot hook it")


class UlyssesSPDataLoaderAdapter:
    """Wrap a data loader so that each sp rank receives its shard of the sequence of one sample at a time.

    As DeepSpeed's: the ranks of the sp group exchange the batch each of them read, and then all process rank 0's
    batch (each rank its ``seq/sp`` slice), then rank 1's, and so on (``sp`` micro-batches per wrapped batch).
    With zerospeed's own loader from ``initialize`` (every sp rank of a group reads the same samples, marked by
    its ``sp_shared_samples``) there is nothing to exchange: each batch is sharded directly (one micro-batch per
    wrapped batch). Each batch must hold ``input_ids``, ``position_ids`` and ``labels`` (``[batch, seq, ...]``
    tensors); ``labels`` is replaced by ``shift_labels`` (the next token's label, -100 after the last), and every
    tensor is cut to this rank's slice of dimension 1. A sequence length sp does not divide is refused.
    """

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, int(sp_rank), sp_group, int(sp_world_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.shared = bool(getattr(dl, "sp_shared_samples", False))
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * (1 if self.shared else self.sp_world_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next pass starts again, as DeepSpeed's adapter does
            raise
        if not isinstance(batch, dict):
            raise SequenceParallelError(f"UlyssesSPDataLoaderAdapter: a batch must be a dict with input_ids, "
                                        f"position_ids and labels, got {type(batch).__name__}")
        for key in ("input_ids", "position_ids", "labels"):
            if key not in batch:
                raise SequenceParallelError(f"UlyssesSPDataLoaderAdapter: the batch has no {key!r} (keys: "
                                            f"{sorted(batch)}); position ids must come from the data so they are "
                                            "global after sharding")
        batches = [batch] if self.shared else self._exchange(batch)
        for one in batches:
            self.micro_batches.append(self._shard(one))

    def _exchange(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Every sp rank's batch, in rank order (tensors padded to the longest sequence, gathered, then cut)."""
        meta = {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in batch.items()}
        metas = comm.all_gather_object(meta, group=self.sp_group)
        out: list[dict[str, Any]] = [{} for _ in metas]
        for key, value in batch.items():
            if not torch.is_tensor(value):
                for r, m in enumerate(metas):
                    out[r][key] = m[key]
                continue
            shapes = [m[key][0] for m in metas]
            if any(s[:1] + s[2:] != shapes[0][:1] + shapes[0][2:] for s in shapes):
                raise SequenceParallelError(f"UlyssesSPDataLoaderAdapter: {key!r} shapes differ across sp ranks "
                                            f"beyond the sequence dimension: {shapes}")
            longest = max(s[1] for s in shapes)
            padded = torch.zeros((value.shape[0], longest, *value.shape[2:]), dtype=value.dtype)
            padded[:, :value.shape[1]] = value.cpu()
            gathered = _gather_stacked(padded, self.sp_group)
            for r, s in enumerate(shapes):
                out[r][key] = gathered[r, :, :s[1]].clone()
        return out

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        seq = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != seq):
                raise SequenceParallelError(f"UlyssesSPDataLoaderAdapter: {key!r} has shape {tuple(value.shape)}, "
                                            f"input_ids {tuple(batch['input_ids'].shape)} (dimension 1 must match)")
        if seq % self.sp_world_size:
            raise SequenceParallelError(f"UlyssesSPDataLoaderAdapter: sequence length {seq} is not divisible by "
                                        f"sequence_parallel_size {self.sp_world_size}; pad the batch to a multiple")
        batch = dict(batch)
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        chunk = seq // self.sp_world_size
        start = chunk * self.sp_rank
        return {k: (v[:, start:start + chunk].contiguous().to(self.device) if torch.is_tensor(v) else v)
                for k, v in batch.items()}


