"""Automatic checkpoints of several sessions that queue while the committing thread is busy commit
together (`commit.commit_group`): one transaction and one sync for all of them, and each one's
outcome its own. A head moved by another writer fails that session's checkpoint only; a disk full
for one session's files fails its checkpoint only (the group is rolled back and each committed
alone); an index locked past the wait fails all of them once, not once each. What a group commits
restores and continues bit for bit as what was committed alone."""

from __future__ import annotations

import errno
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from sqlalchemy import event, update

import kvstore
import store_harness as H
from kvstore import commit as commit_module
from kvstore import fileio
from kvstore.errors import IndexBusy, SessionBusy, StoreFull
from kvstore.store import index
from kvstore.store.index import SessionRow
from kvstore.store.workers import serial

WAIT_S = 30  # far more than any commit of the tiny model; only a broken hand-over reaches it
NAMES = ("a", "b", "c")
TURNS = {"a": "What does the store keep?", "b": "Where does a session resume?", "c": "Is anything lost?"}


class Counting(fileio.PosixIO):
    """Plain file calls; counts the syncs of layer files (`fsync_files`), and fails every write under
    `full` (a directory) with ENOSPC, as a disk full for that session's files would."""

    def __init__(self, full: Path | None = None):
        self.syncs = 0
        self.full = full
        self._paths: dict[int, Path] = {}  # what each open descriptor is

    def fsync_files(self, fds, started=lambda: None):
        self.syncs += 1
        return super().fsync_files(fds, started)

    def open(self, path: Path, *, create: bool = False) -> int:
        fd = super().open(path, create=create)
        self._paths[fd] = Path(path)
        return fd

    def pwrite(self, fd: int, data, offset: int) -> None:
        if self.full is not None and self._paths.get(fd, Path()).parent == self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().pwrite(fd, data, offset)


@pytest.fixture
def store(tmp_path):
    return kvstore.open_store(tmp_path / "home")


@pytest.fixture
def groups(monkeypatch):
    """The sizes of the groups the committing thread commits, in order."""
    sizes: list[int] = []
    real = commit_module.commit_group

    def recorded(store_, checkpoints):
        sizes.append(len(checkpoints))
        return real(store_, checkpoints)

    monkeypatch.setattr(commit_module, "commit_group", recorded)
    return sizes


@contextmanager
def committer_held():
    """The committing thread kept busy until the block ends: checkpoints handed over meanwhile queue."""
    running, release = threading.Event(), threading.Event()
    held = serial(commit_module.COMMITTER).submit(lambda: (running.set(), release.wait(WAIT_S)))
    assert running.wait(WAIT_S)
    try:
        yield
    finally:
        release.set()
        held.result(WAIT_S)


def opened(store, model, groups: list[int]) -> dict:
    """Three sessions that read the document (each checkpointed, waited for); `groups` (the fixture's)
    emptied after: their prefills' checkpoints went through the committing thread too."""
    sessions = {}
    for name in NAMES:
        s = store.new(name, model, seed=5, chunk_size=16, checkpoint_every=4, **H.SAMPLED)
        s.append_text(H.DOCUMENT)
        sessions[name] = s
    groups.clear()
    return sessions


def read_turn(s) -> None:
    """A user turn added and read (its KV computed), then its automatic checkpoint handed over: not
    waited for."""
    s.add_message("user", TURNS[s.name])
    for _ in s.seq.prefill():
        pass
    assert s.checkpoint("auto", wait=False)


def stored(store, name: str) -> tuple[int, int, int]:
    """(head, n_tokens, n_cached) as the index holds them, read apart from the writer."""
    with store.db() as db:
        row = store.row(db, name)
        return row.head, row.n_tokens, row.n_cached


def kv_rows(s) -> torch.Tensor:
    """Every cached position's KV, all layers: `[n_layers, T, 2, n_kv, hd]`."""
    rows = s.seq.cache.state(0, s.seq.cache.length)
    return rows if isinstance(rows, torch.Tensor) else torch.stack(list(rows))


def continued(store, model, name: str, trace: Path) -> tuple[list[int], list[dict]]:
    """The session reopened from disk, 8 tokens generated: its tokens and trace."""
    with store.open(name, model) as s:
        list(s.generate(8, trace=trace, stop_at_eos=False))
        return list(s.tokens), H.read_trace(trace)


def reference(tmp_path: Path, model, name: str) -> tuple[list[int], list[dict]]:
    """The same session, its turn committed alone and waited for, then continued as `continued`."""
    store = kvstore.open_store(tmp_path / f"alone-{name}")
    with store.new(name, model, seed=5, chunk_size=16, checkpoint_every=4, **H.SAMPLED) as s:
        s.append_text(H.DOCUMENT)
        s.add_message("user", TURNS[name])
        for _ in s.seq.prefill():
            pass
        s.checkpoint("auto")
    got = continued(store, model, name, tmp_path / f"alone-{name}.jsonl")
    store.close()
    return got


def test_checkpoints_that_queue_together_commit_in_one_transaction_and_one_sync(store, model, groups, tmp_path):
    sessions = opened(store, model, groups)
    commits = []
    event.listen(store.engine, "commit", lambda conn: commits.append(1))
    counting = Counting()
    with fileio.use(counting):
        with committer_held():
            for s in sessions.values():
                read_turn(s)
        for s in sessions.values():
            s.settle()
    assert groups == [3]
    assert len(commits) == 1 and counting.syncs == 1
    for name, s in sessions.items():
        assert s.head.n_tokens == s.head.n_cached == len(s.seq.tokens)
        assert stored(store, name) == (s.head.seq, s.head.n_tokens, s.head.n_cached)
        in_memory = kv_rows(s)
        s.close()
        with store.open(name, model) as back:  # what the group committed is what was in memory, bit for bit
            assert torch.equal(kv_rows(back), in_memory)
    for name in NAMES:
        assert continued(store, model, name, tmp_path / f"{name}.jsonl") == reference(tmp_path, model, name)


def test_a_head_moved_by_another_writer_fails_only_its_own_checkpoint(store, model, groups):
    sessions = opened(store, model, groups)
    before = stored(store, "b")
    with committer_held():
        for s in sessions.values():
            read_turn(s)
        with store.engine.begin() as db:  # another writer (one without the flock) moved b's head meanwhile
            db.execute(update(SessionRow).where(SessionRow.name == "b").values(head=SessionRow.head + 1))
    with pytest.raises(SessionBusy, match="changed or deleted by someone else"):
        sessions["b"].settle()
    for name in ("a", "c"):
        sessions[name].settle()
        assert stored(store, name)[1] == len(sessions[name].seq.tokens)
    assert groups == [3]
    assert stored(store, "b") == (before[0] + 1, *before[1:])  # only the other writer's move


def test_a_disk_full_for_one_sessions_files_fails_only_its_checkpoint(store, model, groups, tmp_path):
    sessions = opened(store, model, groups)
    full_for = sessions["b"].directory
    with fileio.use(Counting(full=full_for)):
        with committer_held():
            for s in sessions.values():
                read_turn(s)
        with pytest.raises(StoreFull, match="disk is full"):
            sessions["b"].settle()
        for name in ("a", "c"):
            sessions[name].settle()
            assert stored(store, name)[1] == len(sessions[name].seq.tokens)
    assert groups == [3]  # tried together, then each alone
    assert stored(store, "b")[1] < len(sessions["b"].seq.tokens)
    assert sessions["b"].checkpoint("auto")  # room again: what failed is committed by the next one
    for s in sessions.values():
        s.close()
    for name in NAMES:
        assert continued(store, model, name, tmp_path / f"{name}.jsonl") == reference(tmp_path, model, name)


def test_an_index_locked_past_the_wait_fails_the_group_once(tmp_path, model, groups, monkeypatch):
    """The index's lock not given in time is the group's begin failing: every checkpoint of it gets
    IndexBusy at once, none is tried again alone (each would wait as long again)."""
    monkeypatch.setattr(index, "LOCK_WAIT_S", 1)
    store = kvstore.open_store(tmp_path / "home")
    sessions = opened(store, model, groups)
    alone = []
    real_commit = commit_module.commit
    monkeypatch.setattr(commit_module, "commit", lambda *a: alone.append(a) or real_commit(*a))
    other = sqlite3.connect(tmp_path / "home" / "kvstore.db", isolation_level=None)
    with committer_held():
        for s in sessions.values():
            read_turn(s)
        other.execute("BEGIN IMMEDIATE")
    for s in sessions.values():
        with pytest.raises(IndexBusy):
            s.settle()
    other.execute("ROLLBACK")
    other.close()
    assert groups == [3] and alone == []
    for name, s in sessions.items():
        assert s.checkpoint("auto")  # the lock let go: the next checkpoint commits what failed
        assert stored(store, name)[1] == len(s.seq.tokens)
        s.close()
    store.close()
