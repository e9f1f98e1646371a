"""Tensor parallelism by module replacement (DeepSpeed's ``module_inject``): AutoTP and its layers.

Only this package knows how a layer is split over tensor-parallel ranks. Entry points:
:func:`auto_tp` (split a model in place over a tp group), :class:`AutoTP` (plan, then apply),
:func:`tp_model_init` (DeepSpeed's training entry: build the mesh, cast, split) and
:func:`tp_param_splits` (which parameters are sharded, and how).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.module_inject.auto_tp import AutoTP, TPError, auto_tp, tp_param_splits
from zerospeed.module_inject.expert_tp import ExpertTPError, split_expert_ffn
from zerospeed.module_inject.layers import LinearAllreduce, LinearLayer, LmHeadLayer, TPLayer, VocabParallelEmbedding
from zerospeed.module_inject.policy import LayerPlan, plan_model
from zerospeed.module_inject.tp_shard import TPSplit, assemble, local_piece

__all__ = ["AutoTP", "ExpertTPError", "LayerPlan", "LinearAllreduce", "LinearLayer", "LmHeadLayer", "TPError",
           "TPLayer", "TPSplit", "VocabParallelEmbedding", "assemble", "auto_tp", "local_piece", "plan_model", "split_expert_ffn",
           "tp_model_init", "tp_param_splits"]


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None, config: Any = None,
                  **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: split ``model`` over ``tp_size`` ranks before ``initialize``.

    Uses the current mesh when its tp degree is ``tp_size``, else builds the (1, world/tp, tp) mesh
    (collective). ``dtype`` casts the model first; ``config`` may be a ``tensor_parallel`` section
    (or its ``partition_config``); ``injection_policy`` may be passed as a keyword.
    """
    from zerospeed import comm

    unknown = set(kwargs) - {"injection_policy"}
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword argument(s) {sorted(unknown)}")
    mesh = comm.get_mesh()
    if mesh is None or mesh.tp_size != tp_size:
        comm.init_distributed()
        mesh = comm.build_mesh(tp=tp_size)
    if dtype is not None:
        model.to(dtype)
    return auto_tp(model, mesh.tp_group, partition_config=config, injection_policy=kwargs.get("injection_policy"))


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
