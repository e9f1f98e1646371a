"""CPU Adam for offloaded optimizer states (DeepSpeed's ``DeepSpeedCPUAdam``).

* :class:`CPUAdam` (alias :data:`DeepSpeedCPUAdam`) - a ``torch.optim.Optimizer`` with torch's
  Adam/AdamW semantics, run as chunks of torch's fused CPU kernel on a worker pool.
* :class:`SubGroup` + :func:`run_subgroup_pipeline` - the offload pipeline (d2h of the next
  sub-group / CPU update / h2d of the previous), driven by ``CPUAdam.step_subgroups``.
* :class:`FusedAdam` - DeepSpeed's GPU Adam name: torch's Adam with DeepSpeed's defaults.
* :func:`adam_update` / :class:`AdamHyperParams` - the bare update over flat buffers.
"""

from zerospeed.ops.adam.cpu_adam import DEFAULT_SUB_GROUP_SIZE, CPUAdam, DeepSpeedCPUAdam
from zerospeed.ops.adam.fused_adam import FusedAdam
from zerospeed.ops.adam.kernel import (
    DEFAULT_CHUNK_NUMEL,
    AdamHyperParams,
    AdamThreadPool,
    adam_update,
    plan_chunks,
)
from zerospeed.ops.adam.subgroup_pipeline import (
    CudaStreamCopies,
    SubGroup,
    SyncCopies,
    copies_for,
    run_subgroup_pipeline,
)

__all__ = [
    "AdamHyperParams",
    "AdamThreadPool",
    "CPUAdam",
    "CudaStreamCopies",
    "DEFAULT_CHUNK_NUMEL",
    "DEFAULT_SUB_GROUP_SIZE",
    "DeepSpeedCPUAdam",
    "FusedAdam",
    "SubGroup",
    "SyncCopies",
    "adam_update",
    "copies_for",
    "plan_chunks",
    "run_subgroup_pipeline",
]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
