"""Asynchronous tensor <-> file I/O for NVMe offload and fast checkpoint I/O (DeepSpeed's ``aio``).

Public API::

    from zerospeed.ops.aio import AsyncIOHandle, AIOError

    handle = AsyncIOHandle(block_size=1 << 20, queue_depth=8, thread_count=1)  # or .from_config(cfg.aio)
    buf = handle.new_aligned_tensor(n, torch.float32)        # O_DIRECT-ready (pinned with CUDA)
    req = handle.async_pwrite(buf, "/nvme/x.swp")            # returns at once
    handle.wait()                                            # -> number of requests completed
    handle.sync_pread(buf, "/nvme/x.swp", file_offset=0)     # -> bytes read

``aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)`` has
DeepSpeed's constructor order and defaults; the handle answers DeepSpeed's method names too
(``get_block_size``..., ``pread``/``pwrite`` with ``validate`` and ``async_op``,
``new_cpu_locked_tensor``). See :mod:`zerospeed.ops.aio.handle` for the design and the meaning of
each ``aio`` config key on this thread-pool engine.
"""

from zerospeed.ops.aio.aligned import DEFAULT_ALIGNMENT, byte_view, is_aligned, new_aligned_tensor
from zerospeed.ops.aio.errors import AIOError, check_nvme_path
from zerospeed.ops.aio.handle import AsyncIOHandle, aio_handle
from zerospeed.ops.aio.request import AIORequest

__all__ = [
    "AIOError",
    "AIORequest",
    "AsyncIOHandle",
    "DEFAULT_ALIGNMENT",
    "aio_handle",
    "byte_view",
    "check_nvme_path",
    "is_aligned",
    "new_aligned_tensor",
]
