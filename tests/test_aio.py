"""zerospeed.ops.aio: round trips, O_DIRECT and its fallback, DeepSpeed names, clear errors."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from zerospeed.config import AioConfig
from zerospeed.ops.aio import (
    AIOError,
    AsyncIOHandle,
    aio_handle,
    byte_view,
    check_nvme_path,
    is_aligned,
    new_aligned_tensor,
)
from zerospeed.ops.aio import engine as aio_engine

KiB = 1024


def _rand(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


def _direct_supported(directory: str) -> bool:
    path = os.path.join(directory, f".odirect-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    try:
        buf = new_aligned_tensor(4096, torch.uint8)
        os.pwrite(fd, byte_view(buf), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture
def handle():
    h = AsyncIOHandle(block_size=64 * KiB, queue_depth=4, thread_count=2)
    yield h
    h.close()


@pytest.fixture
def tmpfs_mount(tmp_path):
    """Mount a tmpfs with the given options (root only); yields a mounter, unmounts after."""
    mounted: list[str] = []

    def mount(options: str) -> str:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(str(target))
        return str(target)

    if shutil.which("mount") is None:
        pytest.skip("no mount(8)")
    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", target], capture_output=True)


# --------------------------------------------------------------------------- round trips


def test_round_trip_many_in_flight_odd_sizes_and_dtypes(tmp_path, handle):
    specs = [(1, torch.float32), (1023, torch.float32), (4097, torch.bfloat16), (65536, torch.float16),
             (300_001, torch.int64), (4096 * 3 + 5, torch.uint8), (1000, torch.bool),
             (262_144, torch.float32), (0, torch.float32)]
    tensors = [_rand(n, dt, seed=i) for i, (n, dt) in enumerate(specs)]
    tensors += [new_aligned_tensor(200_000, torch.float32).copy_(_rand(200_000, torch.float32, 99))]
    requests = [handle.async_pwrite(t, tmp_path / f"t{i}.swp") for i, t in enumerate(tensors)]
    assert handle.wait() == len(tensors)
    assert all(r.done() and not r.failed for r in requests)
    for i, t in enumerate(tensors):
        assert os.path.getsize(tmp_path / f"t{i}.swp") == t.numel() * t.element_size()
    outs = [torch.empty_like(t) for t in tensors]
    for i, out in enumerate(outs):
        handle.async_pread(out, tmp_path / f"t{i}.swp")
    assert handle.wait() == len(tensors)
    for t, out in zip(tensors, outs):
        assert torch.equal(t, out)
    stats = handle.stats()
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert stats["bytes_written"] == stats["bytes_read"] == total


def test_offsets_within_one_file(tmp_path, handle):
    path = tmp_path / "packed.bin"
    pieces = [(0, _rand(5000, torch.float32, 1)), (20_000, _rand(777, torch.float64, 2)),
              (40_960, _rand(123_457, torch.int32, 3)), (600_001, _rand(10, torch.int16, 4))]
    for offset, t in pieces:
        handle.async_pwrite(t, path, file_offset=offset)
    handle.wait()
    raw = path.read_bytes()
    for offset, t in pieces:
        nbytes = t.numel() * t.element_size()
        assert raw[offset:offset + nbytes] == bytes(byte_view(t))
        out = torch.empty_like(t)
        assert handle.sync_pread(out, path, file_offset=offset) == nbytes
        assert torch.equal(out, t)


def test_request_object_wait_and_repr(tmp_path, handle):
    t = _rand(100_000, torch.float32)
    req = handle.async_pwrite(t, tmp_path / "r.bin")
    assert req.wait() == t.numel() * 4
    assert req.done() and "done" in repr(req)
    assert handle.wait() == 1  # still counted by the handle
    assert handle.wait() == 0


def test_direct_io_is_used_on_a_disk_that_supports_it(tmp_path):
    if not _direct_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    with AsyncIOHandle(block_size=256 * KiB, queue_depth=8, direct_io="on") as h:  # auto may measure buffered faster
        aligned = new_aligned_tensor(1 << 20, torch.float32).copy_(_rand(1 << 20, torch.float32))
        assert is_aligned(aligned)
        unaligned = _rand((1 << 20) + 1, torch.float32)[1:]  # 4-byte offset: goes via bounce buffer
        h.sync_pwrite(aligned, tmp_path / "a.bin")
        h.sync_pwrite(unaligned, tmp_path / "u.bin")
        back_a = new_aligned_tensor(1 << 20, torch.float32)
        back_u = torch.empty((1 << 20) + 1, dtype=torch.float32)[1:]  # unaligned on purpose, not by chance
        assert not is_aligned(unaligned) and not is_aligned(back_u)
        h.sync_pread(back_a, tmp_path / "a.bin")
        h.sync_pread(back_u, tmp_path / "u.bin")
        assert torch.equal(back_a, aligned) and torch.equal(back_u, unaligned)
        stats = h.stats()
        assert h.direct_io_fallbacks == {}
        assert stats["direct"] >= 2 * 16 and stats["bounce"] >= 2 * 16 and stats["buffered"] == 0


def test_dev_shm_round_trip():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/zerospeed-aio-test-{uuid.uuid4().hex}"
    try:
        with AsyncIOHandle() as h:
            t = _rand(1_000_003, torch.float32)
            h.sync_pwrite(t, path)
            out = torch.empty_like(t)
            h.sync_pread(out, path)
            assert torch.equal(out, t)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_fallback_when_open_refuses_o_direct(tmp_path, monkeypatch):
    real_open = aio_engine.sys_open

    def refusing_open(path, flags):
        if flags & aio_engine.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags)

    monkeypatch.setattr(aio_engine, "sys_open", refusing_open)
    with AsyncIOHandle(block_size=64 * KiB) as h:
        t = new_aligned_tensor(300_000, torch.float32).copy_(_rand(300_000, torch.float32))
        h.sync_pwrite(t, tmp_path / "f.bin")
        out = new_aligned_tensor(300_000, torch.float32)
        h.sync_pread(out, tmp_path / "f.bin")
        assert torch.equal(out, t)
        assert h.stats()["direct"] == 0
        (path, reason), = h.direct_io_fallbacks.items()
        assert path == str(tmp_path / "f.bin") and "O_DIRECT" in reason


def test_fallback_when_first_direct_io_gets_einval(tmp_path, monkeypatch):
    """A file system may accept O_DIRECT at open and refuse it at the first read or write."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_pwrite, real_pread = aio_engine.sys_pwrite, aio_engine.sys_pread

    def is_direct(fd):
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def pwrite(fd, mv, off):
        if is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, mv, off)

    def pread(fd, mv, off):
        if is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pread(fd, mv, off)

    monkeypatch.setattr(aio_engine, "sys_pwrite", pwrite)
    monkeypatch.setattr(aio_engine, "sys_pread", pread)
    with AsyncIOHandle(block_size=64 * KiB, queue_depth=2) as h:
        t = new_aligned_tensor(100_000, torch.float32).copy_(_rand(100_000, torch.float32))
        h.sync_pwrite(t, tmp_path / "g.bin")
        out = torch.empty_like(t)
        h.sync_pread(out, tmp_path / "g.bin")
        assert torch.equal(out, t)
        if h.use_direct_io:
            assert any("O_DIRECT" in r for r in h.direct_io_fallbacks.values())


@pytest.mark.parametrize("overlap_events,single_submit,thread_count", [(False, True, 1), (False, False, 3)])
def test_submission_modes_give_the_same_bytes(tmp_path, overlap_events, single_submit, thread_count):
    with AsyncIOHandle(block_size=16 * KiB, queue_depth=2, thread_count=thread_count,
                       overlap_events=overlap_events, single_submit=single_submit) as h:
        ts = [_rand(50_000 + i, torch.float32, i) for i in range(6)]
        for i, t in enumerate(ts):
            h.async_pwrite(t, tmp_path / f"m{i}")
        assert h.wait() == 6
        outs = [torch.empty_like(t) for t in ts]
        for i, o in enumerate(outs):
            h.async_pread(o, tmp_path / f"m{i}")
        h.wait()
        assert all(torch.equal(a, b) for a, b in zip(ts, outs))


def test_from_config_and_deepspeed_names(tmp_path):
    cfg = AioConfig(block_size=262144, queue_depth=4, thread_count=2, single_submit=True,
                    overlap_events=False)
    h = AsyncIOHandle.from_config(cfg)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism(),
            h.get_single_submit(), h.get_overlap_events()) == (262144, 4, 2, True, False)
    assert h.num_workers == 8 and h.get_alignment() == 4096
    h.close()
    ds = aio_handle(1 << 20, 8, False, True, 2)  # DeepSpeed's positional order
    assert (ds.get_queue_depth(), ds.get_thread_count(), ds.get_overlap_events()) == (8, 2, True)
    t = _rand(12345, torch.float32)
    pinned = ds.new_cpu_locked_tensor(12345, t)
    assert pinned.dtype == torch.float32 and is_aligned(pinned)
    assert ds.pwrite(t, str(tmp_path / "ds.bin"), True, False, 0) == t.numel() * 4
    req = ds.pread(pinned, str(tmp_path / "ds.bin"), False, True)
    assert ds.wait() == 1 and req.done() and torch.equal(pinned, t)
    assert ds.read(pinned, str(tmp_path / "ds.bin"), True) == t.numel() * 4
    ds.free_cpu_locked_tensor(pinned)
    ds.close()


def test_constructor_and_buffer_validation(tmp_path, handle):
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncIOHandle(queue_depth=0)
    with pytest.raises(ValueError, match="use_gds"):
        AsyncIOHandle.from_config(type("C", (), {"use_gds": True})())
    with pytest.raises(ValueError, match="contiguous"):
        handle.async_pwrite(torch.randn(8, 8).t(), tmp_path / "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        handle.async_pwrite(b"bytes", tmp_path / "x")
    with pytest.raises(ValueError, match="file_offset"):
        handle.async_pwrite(torch.randn(3), tmp_path / "x", file_offset=-1)


# --------------------------------------------------------------------------- errors name the path


def test_missing_directory(tmp_path, handle):
    path = tmp_path / "no_such_dir" / "x.swp"
    with pytest.raises(AIOError) as info:
        handle.async_pwrite(torch.randn(10), path)
    assert info.value.errno == errno.ENOENT and str(path) in str(info.value)
    assert "does not exist" in str(info.value)
    assert handle.wait() == 0  # nothing was queued


def test_parent_is_a_file(tmp_path, handle):
    (tmp_path / "plain").write_text("x")
    path = tmp_path / "plain" / "x.swp"
    with pytest.raises(AIOError) as info:
        handle.async_pwrite(torch.randn(10), path)
    assert info.value.errno == errno.ENOTDIR and str(path) in str(info.value)


def test_read_of_missing_file(tmp_path, handle):
    path = tmp_path / "gone.swp"
    handle.sync_pwrite(torch.randn(10), path)
    os.unlink(path)  # someone deleted the swap file between steps
    with pytest.raises(AIOError) as info:
        handle.async_pread(torch.empty(10), path)
    assert info.value.errno == errno.ENOENT and str(path) in str(info.value)


def test_read_past_end_of_file(tmp_path, handle):
    path = tmp_path / "short.swp"
    handle.sync_pwrite(torch.randn(1000), path)
    handle.async_pread(torch.empty(100_000), path)
    with pytest.raises(AIOError, match="ends at 4000 bytes") as info:
        handle.wait()
    assert str(path) in str(info.value)


def test_file_truncated_while_being_read(tmp_path, monkeypatch):
    path = tmp_path / "shrinking.swp"
    with AsyncIOHandle(block_size=16 * KiB, queue_depth=1, use_direct_io=False) as h:
        h.sync_pwrite(torch.randn(100_000), path)
        real_pread = aio_engine.sys_pread
        calls = []

        def pread_then_truncate(fd, mv, off):
            calls.append(off)
            if len(calls) == 2:
                os.truncate(path, 0)
            return real_pread(fd, mv, off)

        monkeypatch.setattr(aio_engine, "sys_pread", pread_then_truncate)
        req = h.async_pread(torch.empty(100_000), path)
        with pytest.raises(AIOError, match="truncated") as info:
            req.wait()
        assert str(path) in str(info.value)
        assert len(calls) < 100_000 * 4 // (16 * KiB)  # the rest of the request was skipped
        with pytest.raises(AIOError):
            h.wait()  # the handle reports it too; it stays usable afterwards
        monkeypatch.setattr(aio_engine, "sys_pread", real_pread)
        h.sync_pwrite(torch.ones(10), path)
        out = torch.empty(10)
        h.sync_pread(out, path)
        assert torch.equal(out, torch.ones(10))


def test_disk_full(tmpfs_mount):
    mnt = tmpfs_mount("size=1m")
    path = os.path.join(mnt, "big.swp")
    with AsyncIOHandle(block_size=64 * KiB) as h:
        h.async_pwrite(torch.zeros(1 << 20), path)  # 4 MiB into a 1 MiB file system
        h.async_pwrite(torch.zeros(10), os.path.join(mnt, "small.swp"))
        with pytest.raises(AIOError) as info:
            h.wait()
        assert info.value.errno == errno.ENOSPC
        assert path in str(info.value) and "disk is full" in str(info.value)


def test_read_only_file_system(tmpfs_mount):
    mnt = tmpfs_mount("size=1m,ro")
    path = os.path.join(mnt, "x.swp")
    with AsyncIOHandle() as h, pytest.raises(AIOError) as info:
        h.async_pwrite(torch.zeros(10), path)
    assert info.value.errno == errno.EROFS and path in str(info.value)
    with pytest.raises(AIOError, match="not writable") as info:
        check_nvme_path(mnt)
    assert mnt in str(info.value)


def test_file_size_limit(tmp_path):
    """RLIMIT_FSIZE -> EFBIG, a real failing pwrite on any machine (no mount needed).

    The soft limit is lowered only around one write; Python ignores SIGXFSZ, so the write fails
    with EFBIG instead of killing the process. Nothing else writes big files meanwhile.
    """
    import resource
    import signal

    if signal.getsignal(signal.SIGXFSZ) != signal.SIG_IGN:
        pytest.skip("SIGXFSZ is not ignored in this process")
    path = tmp_path / "limited.swp"
    with AsyncIOHandle(block_size=256 * KiB, use_direct_io=False) as h:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            h.async_pwrite(torch.zeros(1 << 19), path)  # 2 MiB against a 1 MiB limit
            with pytest.raises(AIOError) as info:
                h.wait()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG
    assert str(path) in str(info.value) and "maximum file size" in str(info.value)


def test_check_nvme_path(tmp_path):
    assert check_nvme_path(tmp_path) == str(tmp_path)
    with pytest.raises(AIOError, match="does not exist") as info:
        check_nvme_path(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(info.value)
    (tmp_path / "f").write_text("x")
    with pytest.raises(AIOError, match="must be a directory"):
        check_nvme_path(tmp_path / "f")
    assert os.listdir(tmp_path) == ["f"]  # the probe file is gone


def test_error_pickles(tmp_path):
    import pickle

    err = AIOError("write", tmp_path / "x", errno.ENOSPC, file_offset=4096, num_bytes=10)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.errno == errno.ENOSPC and back.path == str(tmp_path / "x")


def test_handle_works_in_a_forked_child(tmp_path, handle):
    """The I/O threads do not survive fork(); a child must start its own instead of hanging."""
    t = _rand(100_000, torch.float32)
    handle.sync_pwrite(t, tmp_path / "parent.bin")  # parent's threads are running now
    pid = os.fork()
    if pid == 0:  # child: no torch compute here (OpenMP after fork), only the aio engine
        code = 1
        try:
            import signal

            signal.alarm(20)
            handle.sync_pwrite(t, tmp_path / "child.bin")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    out = torch.empty_like(t)
    handle.sync_pread(out, tmp_path / "child.bin")
    assert torch.equal(out, t)
