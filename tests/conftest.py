"""Suite-wide isolation: a test module that initialises torch.distributed in the pytest process (a
world of one, through ``zerospeed.initialize``) must not leave it to the modules after it, whose
single-process code paths (e.g. building a 2-stage PipelineModule without processes) behave
differently when a default process group exists."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def _fresh_process_group_per_module() -> Iterator[None]:
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from zerospeed.comm.lifecycle import shutdown

        shutdown(timeout_s=5.0)
    from zerospeed.comm.mesh import reset_mesh

    reset_mesh()
    try:
        from zerospeed.moe.groups import reset_expert_groups
    except ImportError:
        return
    reset_expert_groups()
