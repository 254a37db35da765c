"""Making a checkpoint's files durable (`fileio.PosixIO.fsync_files`): one syncfs where that is as
safe as an fsync of each file (Linux 5.8 or later, ext4 / XFS / Btrfs) and little else waits to be
written (it would be written too), else an fsync of each; an
error of the syncfs is the checkpoint's error (ENOSPC: StoreFull, the head unchanged), and
KVSTORE_SYNCFS=0 turns it off. (The fault-injection layer models each file's fsync: tests/faults.py.)"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

import pytest

import kvstore
from kvstore import fileio
from kvstore.errors import StoreFull


def open_files(folder, n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.open(folder / f"f{i}", os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(fd, b"x" * 4096, 0)
        fds.append(fd)
    return fds


def sync_new_files(folder, n: int) -> list[int]:
    """`fsync_files` of n files just written: their (closed) descriptors."""
    fds = open_files(folder, n)
    try:
        fileio.PosixIO().fsync_files(fds)
    finally:
        fileio.close_all(fds)
    return fds


@pytest.fixture
def fsyncs(monkeypatch):
    """The descriptors os.fsync is called with."""
    seen: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (seen.append(fd), real(fd))[1])
    return seen


class FailingLibc:
    """libc whose syncfs fails with `err` (and counts its calls); the rest is the real one's."""

    def __init__(self, err: int):
        self.err, self.calls, self.real = err, 0, fileio._libc()

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def syncfs(self, fd: int) -> int:
        self.calls += 1
        ctypes.set_errno(self.err)
        return -1


@pytest.fixture
def syncfs_here(tmp_path, monkeypatch):
    """Skips where syncfs does not apply to tmp_path's file system; counts the system's dirty bytes
    as none (what else is waiting to be written depends on the machine's moment)."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        if not fileio.syncfs_applies(fd):
            pytest.skip("syncfs does not apply here (kernel before 5.8, or not ext4 / XFS / Btrfs)")
    finally:
        os.close(fd)
    monkeypatch.setattr(fileio, "dirty_bytes", lambda: 0)


def test_files_on_a_journalled_local_file_system_are_synced_in_one_call(tmp_path, fsyncs, syncfs_here):
    sync_new_files(tmp_path, 5)
    assert fsyncs == []


@pytest.mark.parametrize("why", ["one file", "turned off"])
def test_otherwise_each_file_is_fsynced(tmp_path, fsyncs, monkeypatch, why):
    if why == "turned off":
        monkeypatch.setenv("KVSTORE_SYNCFS", "0")
    fds = sync_new_files(tmp_path, 1 if why == "one file" else 4)
    assert fsyncs == fds


def test_a_file_system_without_a_safe_syncfs_gets_an_fsync_per_file(tmp_path, fsyncs, monkeypatch):
    monkeypatch.setattr(fileio, "SYNCFS_FILE_SYSTEMS", {})  # as on NFS, FUSE, tmpfs, ...
    fds = sync_new_files(tmp_path, 3)
    assert fsyncs == fds


def test_much_dirty_data_elsewhere_gets_an_fsync_per_file(tmp_path, fsyncs, syncfs_here, monkeypatch):
    """Another process's big unsynced write would make a syncfs wait for all of it."""
    monkeypatch.setattr(fileio, "dirty_bytes", lambda: fileio.SYNCFS_MAX_DIRTY + 1)
    fds = sync_new_files(tmp_path, 3)
    assert fsyncs == fds


def test_dirty_bytes_reads_the_kernels_count():
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo")
    assert 0 <= fileio.dirty_bytes() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_failed_syncfs_raises_its_error(tmp_path, syncfs_here, monkeypatch):
    libc = FailingLibc(errno.EIO)
    monkeypatch.setattr(fileio, "_libc", lambda: libc)
    fds = open_files(tmp_path, 3)
    try:
        with pytest.raises(OSError) as caught:
            fileio.PosixIO().fsync_files(fds)
    finally:
        fileio.close_all(fds)
    assert caught.value.errno == errno.EIO and libc.calls == 1


def test_a_checkpoint_whose_syncfs_finds_the_disk_full_is_store_full_and_commits_nothing(tiny, tmp_path, syncfs_here,
                                                                                           monkeypatch):
    m = tiny("llama-gqa")
    model = kvstore.load_model(m.folder, dtype="float32")
    store = kvstore.open_store(tmp_path / "home")
    s = store.new("s", model, seed=1, chunk_size=8)
    s.append_tokens(m.ids(16))  # checkpointed: its files exist
    before = store.info("s")
    s.seq.add(m.ids(24)[16:])
    list(s.seq.prefill())
    libc = FailingLibc(errno.ENOSPC)
    monkeypatch.setattr(fileio, "_libc", lambda: libc)
    with pytest.raises(StoreFull):
        s.checkpoint("test")
    assert libc.calls == 1
    after = store.info("s")
    assert (after.n_tokens, after.n_cached) == (before.n_tokens, before.n_cached)
    monkeypatch.undo()
    s.checkpoint("test")  # the disk is back
    assert store.info("s").n_cached == 24
    s.close()
    store.close()


def test_a_checkpoint_writes_its_index_rows_while_its_files_sync_and_commits_after(tiny, tmp_path, monkeypatch):
    """The sync is a wait on the disk: it runs on the syncing thread while this one inserts the
    checkpoint's rows, and the commit (C4) waits until it is done."""
    from sqlalchemy import event

    from kvstore import commit as commit_module

    m = tiny("llama-gqa")
    model = kvstore.load_model(m.folder, dtype="float32")
    store = kvstore.open_store(tmp_path / "home")
    s = store.new("s", model, seed=1, chunk_size=8)
    s.append_tokens(m.ids(16))
    events: list[tuple[str, str]] = []

    class SlowSync(fileio.PosixIO):
        def fsync_files(self, fds, started=lambda: None):
            def slow_disk():
                events.append(("sync starts", threading.current_thread().name))
                started()
                time.sleep(0.2)
            super().fsync_files(fds, slow_disk)
            events.append(("sync ends", threading.current_thread().name))

    add_checkpoint = commit_module.ADD_CHECKPOINT  # run on the driver's cursor: no execution events

    def checkpoint_row(db, params):
        events.append(("checkpoint row", threading.current_thread().name))
        return add_checkpoint(db, params)

    monkeypatch.setattr(commit_module, "ADD_CHECKPOINT", checkpoint_row)

    @event.listens_for(store.engine, "commit")
    def committed(conn):
        events.append(("commit", threading.current_thread().name))

    s.seq.add(m.ids(24)[16:])
    list(s.seq.prefill())
    with fileio.use(SlowSync()):
        s.checkpoint("test")
    me, order = threading.current_thread().name, [e for e, _ in events]
    assert order == ["sync starts", "checkpoint row", "sync ends", "commit"]  # the rows meanwhile; C4
    threads = dict(events)
    assert threads["checkpoint row"] == threads["commit"] == me
    assert threads["sync starts"] == threads["sync ends"] != me
    assert store.info("s").n_cached == 24
    s.close()


def test_a_forked_child_makes_its_files_durable_on_a_syncing_thread_of_its_own(tmp_path):
    """The parent's syncing thread does not exist in a forked child: the child starts its own (an
    executor copied from the parent would take the work and never run it)."""
    import torch

    from kvstore.store import segments

    rows = [torch.zeros(4, 2, 1, 16, dtype=torch.bfloat16)]
    segments.append(tmp_path / "parent", 0, rows)  # the parent's syncing thread is running now
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, an exit status only
        try:
            segments.append(tmp_path / "child", 0, rows)
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's append never finished")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert (tmp_path / "child" / "layer-000.kv").stat().st_size == rows[0].numel() * 2
