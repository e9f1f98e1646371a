"""DeepSpeed's ``deepspeed.utils.groups`` accessors that ALST scripts call, read from the one mesh.

``_get_sequence_parallel_group`` / ``_world_size`` / ``_rank`` answer for the current mesh (built by
``UlyssesSPAttentionHF.register_with_transformers`` or by ``initialize`` from ``sequence_parallel_size``): real
``torch.distributed`` groups, None only in a world of one without an initialised process group. The
``sequence data parallel`` names give the dp x sp group ZeRO shards over.
"""

from __future__ import annotations

from typing import Any

from zerospeed.comm.mesh import current_mesh

__all__ = ["_get_data_parallel_group", "_get_data_parallel_rank", "_get_data_parallel_world_size",
           "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_rank",
           "_get_sequence_data_parallel_world_size", "_get_sequence_parallel_group", "_get_sequence_parallel_rank",
           "_get_sequence_parallel_world_size"]


def _get_sequence_parallel_group() -> Any:
    return current_mesh().sp_group


def _get_sequence_parallel_world_size() -> int:
    return current_mesh().sp_size


def _get_sequence_parallel_rank() -> int:
    return current_mesh().sp_rank


def _get_sequence_data_parallel_group() -> Any:
    return current_mesh().sp_dp_group


def _get_sequence_data_parallel_world_size() -> int:
    return current_mesh().sp_dp_size


def _get_sequence_data_parallel_rank() -> int:
    return current_mesh().sp_dp_rank


def _get_data_parallel_group() -> Any:
    return current_mesh().dp_group


def _get_data_parallel_world_size() -> int:
    return current_mesh().dp_size


def _get_data_parallel_rank() -> int:
    return current_mesh().dp_rank
