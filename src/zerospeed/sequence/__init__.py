"""Sequence parallelism (DeepSpeed's ``deepspeed.sequence``): Ulysses attention, the SP loss average, and ALST's
tiled compute (TiledMLP, sequence_tiled_compute, the tiled fused logits+loss).

The HuggingFace integration with DeepSpeed's names (``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``)
is :mod:`zerospeed.runtime.sequence_parallel.ulysses_sp`.
"""

from zerospeed.sequence.layer import DistributedAttention, SequenceParallelError

__all__ = ["DistributedAttention", "SequenceParallelError"]
