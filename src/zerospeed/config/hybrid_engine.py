"""``hybrid_engine``: rollouts on the live training weights (DeepSpeed-Chat's Hybrid Engine keys; issue #32).

DeepSpeed 0.19.8's keys and defaults (``deepspeed/runtime/hybrid_engine`` config): ``enabled`` (false),
``max_out_tokens`` (512), ``inference_tp_size`` (1), ``release_inference_cache`` (false), ``pin_parameters``
(true), ``tp_gather_partition_size`` (8).

What zerospeed does with them (:mod:`zerospeed.rl`):

* ``enabled`` - ``engine.generate(...)`` runs zerospeed's inference engine (paged KV, ragged batching) over
  the live training weights instead of handing the call to the module's own ``generate``;
* ``max_out_tokens`` - the longest prompt + completion a rollout may ask for (the KV cache's context);
* ``inference_tp_size`` - the training TP degree (``tensor_parallel.autotp_size``; 1 without TP): rollouts run
  on the training TP layout without resharding (:mod:`zerospeed.rl.tp_layout`); another value is an error
  naming the key when the engine is built;
* ``release_inference_cache`` - true frees the KV cache after every ``generate`` call, false keeps it for the
  next one (DeepSpeed's meaning);
* ``pin_parameters`` - true keeps the rollout copy's weight buffers allocated between calls (refilled from the
  shards at every call, never stale), false frees them after each call;
* ``tp_gather_partition_size`` - accepted and validated; it sizes DeepSpeed's CUDA-kernel TP gathers, which
  zerospeed does not have (no effect).

zerospeed additions (not DeepSpeed keys):

* ``max_resident_layers`` - 0 (default): the whole model is gathered once per rollout batch (one pass over
  the ZeRO-3 buckets) into the rollout copy; N >= 1: the model is streamed, at most N transformer layers of
  the rollout copy are resident at any time, each layer gathered again for every forward (for models whose
  whole copy does not fit);
* ``kv_cache_memory`` - bytes of KV cache (default: enough for ``max_num_seqs`` sequences of
  ``max_out_tokens``);
* ``max_num_seqs`` - sequences decoded together (default 64);
* ``alias_weights`` - true (default): in whole-model mode, the rollout weights that are contiguous ranges of the
  ZeRO-3 buckets are views of one kept arena each bucket is all-gathered straight into (no per-call copy or
  allocation, :mod:`zerospeed.rl.arena`); false: every weight is copied from the gathered buckets into the
  rollout copy (the plain path, block linears kept in the transposed CPU layout).
"""

from __future__ import annotations

from .fields import Bool, NonNegInt, PosInt, Section


class HybridEngineConfig(Section):
    """``hybrid_engine``: DeepSpeed's keys, plus zerospeed's ``max_resident_layers`` / ``kv_cache_memory`` /
    ``max_num_seqs`` / ``alias_weights``."""

    enabled: Bool = False
    max_out_tokens: PosInt = 512
    inference_tp_size: PosInt = 1
    release_inference_cache: Bool = False
    pin_parameters: Bool = True
    tp_gather_partition_size: PosInt = 8
    max_resident_layers: NonNegInt = 0
    kv_cache_memory: PosInt | None = None
    max_num_seqs: PosInt = 64
    alias_weights: Bool = True
