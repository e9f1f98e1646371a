"""SwapFolder creation beside other ranks' clean-up (zero/offload/swapfiles.py).

Ranks share ``<nvme_path>/zerospeed_swap``; the last one to close removes it. A rank creating its folder
while another removes the empty parent sees ``makedirs(exist_ok=True)`` raise FileExistsError (its mkdir
hit EEXIST, then the parent was gone when it checked isdir) or mkdtemp raise FileNotFoundError: both are
retried. A parent that is a regular file is not a race: one error naming the config key.
"""
import os

import pytest

from zerospeed.ops.aio.errors import AIOError
from zerospeed.zero.offload import swapfiles


def test_parent_removed_by_another_rank_during_makedirs_is_retried(tmp_path, monkeypatch):
    real = os.makedirs
    calls = []

    def racing_makedirs(path, exist_ok=False):
        calls.append(path)
        if len(calls) == 1:  # the other rank's rmdir landed between our mkdir (EEXIST) and isdir
            raise FileExistsError(17, "File exists", path)
        return real(path, exist_ok=exist_ok)

    monkeypatch.setattr(swapfiles.os, "makedirs", racing_makedirs)
    folder = swapfiles.SwapFolder(str(tmp_path), "optimizer", 0, "zero_optimization.offload_optimizer.nvme_path")
    try:
        assert len(calls) == 2 and os.path.isdir(folder.path)
    finally:
        folder.close()
    assert not os.path.exists(folder.path)


def test_parent_that_is_a_file_names_the_key(tmp_path):
    (tmp_path / swapfiles.SWAP_DIR_NAME).write_text("not a folder")
    with pytest.raises(AIOError, match="zero_optimization.offload_optimizer.nvme_path"):
        swapfiles.SwapFolder(str(tmp_path), "optimizer", 0, "zero_optimization.offload_optimizer.nvme_path")
