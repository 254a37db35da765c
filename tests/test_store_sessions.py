"""The store's verbs on whole sessions: list and describe, fork by reference (no KV byte copied;
its milliseconds are measured in the benchmarks), delete without harming forks, garbage-collect
only what nothing references, pack blobs shared between forks."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
import torch

import kvstore
import store_harness as H
from kvstore.store import blobs
from kvstore.store import index
from kvstore.store.extents import read_layers, session_extents
from kvstore.errors import IndexBusy, SessionBusy, SessionExists, SessionNotFound


@pytest.fixture
def store(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("doc", model, seed=1, chunk_size=16, checkpoint_every=4, system="Be brief.") as s:
        s.append_text(H.DOCUMENT)
        list(s.generate(10, stop_at_eos=False))
    return store


def files(store):
    return sorted(p.relative_to(store.home).as_posix() for p in store.home.rglob("*") if p.is_file()
                  and p.suffix in (".kv", ".kvz"))


def test_list_and_info_describe_sessions(store):
    info = store.info("doc")
    assert [i.name for i in store.list()] == ["doc"]
    assert info.n_tokens == info.n_cached + 1
    assert info.checkpoints >= 3 and info.disk_bytes > 0 and info.dtype == "bfloat16"
    assert info.parent is None and info.forks == []
    assert [m.role for m in store.messages("doc")] == ["system"]


def test_names_are_unique(store, model):
    with pytest.raises(SessionExists):
        store.new("doc", model)
    with pytest.raises(SessionExists):
        store.fork("doc", "doc")


def test_unknown_sessions_are_reported(store, model):
    for call in (lambda: store.open("nope", model), lambda: store.info("nope"), lambda: store.delete("nope"),
                 lambda: store.fork("nope", "x"), lambda: store.export("nope", "x.kvs")):
        with pytest.raises(SessionNotFound, match="kvstore list"):
            call()
    assert store.exists("doc") and not store.exists("nope")


def test_discard_drops_what_was_not_checkpointed_and_frees_the_session(store, model):
    """`Session.discard` (the service's after a request that failed midway): closed without a
    checkpoint, so the store keeps its last one: a generation's tokens since are gone, the call
    it recorded stands (`resume` finishes it), and the lock is free."""
    before = store.info("doc")
    s = store.open("doc", model)
    s.checkpoint_every = 1000  # nothing committed while it generates
    ids = s.generate(12, stop_at_eos=False)
    taken = [next(ids) for _ in range(5)]
    assert len(s.tokens) == before.n_tokens + 5
    s.discard()
    s.discard()  # twice: nothing more
    ids.close()  # the abandoned generation writes nothing once discarded
    assert store.info("doc").n_tokens == before.n_tokens  # the 5 tokens were never committed
    with store.open("doc", model) as again:  # not busy: the lock went with it
        assert len(again.tokens) == before.n_tokens and again.active_call["start"] == before.n_tokens
        list(again.resume())
        assert again.tokens[before.n_tokens:][:5] == taken and len(again.tokens) == before.n_tokens + 12


def test_a_fork_shares_extents_and_costs_no_kv_bytes(store):
    """No KV byte is read or written (its time is in the benchmarks: `python -m benchmarks run`)."""
    before = files(store)
    store.fork("doc", "child")
    assert files(store) == before  # nothing copied
    child = store.info("child")
    assert child.parent == "doc" and child.disk_bytes == 0 and store.info("doc").forks == ["child"]
    assert store.tokens("child") == store.tokens("doc")


def test_fork_at_a_position(store):
    store.fork("doc", "early", at=20)
    info = store.info("early")
    assert info.n_tokens == 20 and info.n_cached == 19 and info.fork_position == 20
    with pytest.raises(kvstore.errors.InvalidArgument, match="between 1 and"):  # also a ValueError
        store.fork("doc", "bad", at=10_000)
    assert "bad" not in store.names()


def test_a_fork_at_the_head_takes_the_last_tokens_state_an_earlier_one_leaves_its_last_token_pending(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("doc", model, seed=1, chunk_size=16) as s:
        s.append_text(H.DOCUMENT)
        state, tokens = s.seq.hidden.clone(), list(s.tokens)
        live = s.fork("live")  # in this process, from the open session
        assert torch.equal(live.seq.hidden, state) and live.seq.cache.length == len(tokens)
        live.close()
    store.fork("doc", "head")
    store.fork("doc", "early", at=10)
    assert store.info("head").n_cached == store.info("live").n_cached == len(tokens)
    assert store.info("early").n_cached == 9
    for name in ("head", "live"):
        with store.open(name, model) as c:
            assert torch.equal(c.seq.hidden, state) and c.pending == []
    with store.open("early", model) as c:
        assert c.seq.hidden is None and c.pending == [tokens[9]]
    assert all(problems == [] for problems in store.verify().values())


def test_deleting_the_parent_keeps_the_fork_and_gc_frees_only_unreferenced_files(store, model):
    store.fork("doc", "child")
    parent_dir = store.session_dir(store.info("doc").id)
    store.delete("doc")
    assert parent_dir.exists()  # the child still reads the parent's extents
    with store.open("child", model) as c:
        list(c.generate(4, stop_at_eos=False))
    assert store.verify() == {"child": []}
    store.delete("child")
    store.gc()
    assert files(store) == [] and not any(store.sessions_dir.iterdir())


def test_packed_blobs_are_shared_between_forks(store, model):
    store.fork("doc", "child")
    store.pack("doc")
    n_blobs = len(list(store.blobs_dir.glob("*.kvz")))
    assert store.pack("child")["extents"] == 0  # everything it uses was packed with the parent
    assert len(list(store.blobs_dir.glob("*.kvz"))) == n_blobs
    with store.open("child", model) as c:
        assert c.seq.cache.length == store.info("child").n_cached
    assert store.verify() == {"child": [], "doc": []}


class Once:
    """Another process overtaking a reader: `action` runs at the first call (given as a progress
    callback, after the reader's first extent) and never again; `result` is what it returned."""

    def __init__(self, action):
        self.action, self.ran, self.result = action, False, None

    def __call__(self, *_progress) -> None:
        if not self.ran:
            self.ran, self.result = True, self.action()


def test_verify_and_export_beside_a_pack_in_another_process_report_no_damage(store, model, tmp_path):
    """A pack (another process: another store object) that moves the extents into blobs and frees the
    raw files while a verify or an export reads them: both read the moved extents from the blobs."""
    other = kvstore.open_store(store.home)
    for job in ("verify", "export"):
        with store.new(job, model, seed=2, chunk_size=16, checkpoint_every=4) as s:
            s.append_text(H.DOCUMENT)
            list(s.generate(10, stop_at_eos=False))
        packed = Once(lambda name=job: other.pack(name))  # after the first extent was read
        if job == "verify":
            assert store.verify(job, progress=packed) == {job: []}
        else:
            store.export(job, tmp_path / "job.kvs", progress=packed)
            assert store.import_(tmp_path / "job.kvs", name="imported") == "imported"
            assert store.tokens("imported") == store.tokens(job) and store.verify("imported") == {"imported": []}
        assert packed.result["extents"] > 1
    other.close()


def test_a_session_deleted_while_verify_reads_it_is_left_out_of_the_report(store, model):
    other = kvstore.open_store(store.home)
    store.fork("doc", "kept")
    with store.new("gone", model, seed=2, chunk_size=16) as s:
        s.append_text(H.DOCUMENT)
    gone_files = store.session_dir(store.info("gone").id)
    deleted = Once(lambda: (other.delete("gone"), other.gc()))  # after the first extent of "doc" was read

    assert store.verify(progress=deleted) == {"doc": [], "kept": []}
    assert deleted.ran and not gone_files.exists()  # its files were gone when verify came to it
    other.close()


def test_a_session_deleted_while_it_is_exported_is_not_found_and_no_archive_is_written(store, model, tmp_path):
    other = kvstore.open_store(store.home)
    with store.new("gone", model, seed=2, chunk_size=16) as s:
        s.append_text(H.DOCUMENT)
    deleted = Once(lambda: other.delete("gone"))  # after its first extent was written to the archive
    with pytest.raises(SessionNotFound, match="deleted while it was being exported"):
        store.export("gone", tmp_path / "gone.kvs", progress=deleted)
    assert deleted.ran and list(tmp_path.glob("*gone.kvs*")) == []
    other.close()


def test_a_fork_opened_while_its_parent_is_packed_elsewhere_loads_from_the_blobs(store, model, monkeypatch):
    """The parent's pack (another process: it takes the parent's lock, not the fork's) lands between
    the fork's open reading its extent list and reading the extents' raw files, which it frees."""
    from kvstore.store import restore as session_module

    store.fork("doc", "child")
    with store.open("child", model) as c:
        expected = [t.clone() for t in c.seq.cache.state(0, c.seq.cache.length)]
    other = kvstore.open_store(store.home)
    load_cache, packed = session_module.load_cache, Once(lambda: other.pack("doc"))

    def pack_first(*args, **kwargs):
        packed()
        return load_cache(*args, **kwargs)

    monkeypatch.setattr(session_module, "load_cache", pack_first)
    with store.open("child", model) as c:
        got = c.seq.cache.state(0, c.seq.cache.length)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == len(expected)
    assert packed.result["extents"] > 1 and not list(store.session_dir(store.info("doc").id).glob("*.kv"))
    other.close()


def test_a_fork_packed_while_its_parent_is_packed_elsewhere_shares_the_parents_blobs(store, model):
    """Both packs read the parent's extents; the parent's (another process) commits first and frees
    the raw files the fork's pack has yet to read: the fork's pack takes them from the blobs."""
    store.fork("doc", "child")
    other = kvstore.open_store(store.home)
    packed = Once(lambda: other.pack("doc"))  # after the fork's pack read its first extent
    store.pack("child", progress=packed)
    assert packed.result["extents"] > 1
    assert store.verify() == {"child": [], "doc": []}
    blobs_before = sorted(store.blobs_dir.glob("*.kvz"))
    assert store.gc()["blobs"] == 0 and sorted(store.blobs_dir.glob("*.kvz")) == blobs_before  # one set, shared
    other.close()


def test_a_stale_blob_file_under_the_right_name_is_replaced_when_packing(store, model):
    """A killed pack (or an older kvstore's encoding) can leave a blob file no index row describes."""
    with store.db() as db:
        refs = session_extents(db, store.row(db, "doc").id)
    digest = blobs.content_hash(read_layers(refs[0], store.home, 2, session="doc"))
    stale = blobs.blob_path(store.blobs_dir, digest)
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"bytes in some other encoding")
    store.pack("doc")
    assert store.verify() == {"doc": []}
    with store.open("doc", model) as s:
        assert s.seq.cache.length == store.info("doc").n_cached


def test_a_blob_file_lost_since_its_commit_is_written_again_by_the_next_pack(tmp_path, model):
    """Two sessions with the same KV share blobs; the second pack relies on a committed blob only if
    its file is there, so it never frees raw files for a blob that is gone (and mends the first)."""
    store = kvstore.open_store(tmp_path / "home")
    for name in ("a", "b"):
        with store.new(name, model, seed=1, chunk_size=16) as s:
            s.append_text(H.DOCUMENT)
    store.pack("a")
    lost = sorted(store.blobs_dir.glob("*.kvz"))
    for path in lost:
        path.unlink()
    assert store.verify()["a"]  # a's KV is gone with its blobs
    store.pack("b")
    assert sorted(store.blobs_dir.glob("*.kvz")) == lost  # the same content: the same blob names
    assert store.verify() == {"a": [], "b": []}
    with store.open("a", model) as a:
        assert a.seq.cache.length == store.info("a").n_cached


def test_gc_takes_no_lock_of_a_session_with_unpacked_kv(store, model, monkeypatch):
    """A gc looks at such sessions through the index only: it never holds their writer's lock, so
    it cannot make their writer's open or pack fail."""
    from kvstore.store import locking

    taken = []
    real = locking.SessionLock.acquire
    monkeypatch.setattr(locking.SessionLock, "acquire", lambda self, **kw: taken.append(self.name) or real(self, **kw))
    store.fork("doc", "child")
    store.gc()
    assert taken == []


def test_a_lock_freed_while_waiting_is_taken_and_one_kept_is_busy(tmp_path, monkeypatch):
    from kvstore.store import locking

    waiting = threading.Event()

    class Clock:  # the locking module's clock, telling us when a waiter first sleeps
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds):
            waiting.set()
            time.sleep(seconds)

    monkeypatch.setattr(locking, "time", Clock)
    holder = locking.SessionLock(tmp_path / "s", "s").acquire()
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("lock", locking.SessionLock(tmp_path / "s", "s").acquire(
        patience_s=60)))
    waiter.start()
    assert waiting.wait(60)  # the waiter found the lock held and waits
    holder.release()  # as a gc does after its look
    waiter.join(60)
    assert got["lock"].held
    with pytest.raises(SessionBusy, match="open for writing in another process"):
        locking.SessionLock(tmp_path / "s", "s").acquire(patience_s=0)
    got["lock"].release()


def test_an_index_locked_past_the_wait_is_index_busy(tmp_path, model, monkeypatch):
    """Another program holding kvstore.db's write lock longer than LOCK_WAIT_S: IndexBusy, nothing
    changed; the next try goes through once it lets go."""
    monkeypatch.setattr(index, "LOCK_WAIT_S", 1)
    store = kvstore.open_store(tmp_path)
    other = sqlite3.connect(tmp_path / "kvstore.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(IndexBusy, match="locked by another process for 1 s.*nothing was changed"):
        store.new("s", model)
    other.execute("ROLLBACK")
    other.close()
    assert store.list() == []
    store.new("s", model).close()
    assert [i.name for i in store.list()] == ["s"]
    store.close()


@pytest.mark.slow
def test_writers_forks_packs_and_gc_at_once(tmp_path, model_path, model):
    H.churn_with_gc(str(tmp_path / "home"), None, model_path, model)


def test_a_restored_or_forked_cache_has_room_for_the_next_tokens(store, model):
    """Growing a cache copies it whole: the first tokens after a resume or a fork must not."""
    with store.open("doc", model) as s:
        first_row = s.seq.cache.layers[0].data_ptr()
        list(s.generate(5, stop_at_eos=False))
        assert s.seq.cache.layers[0].data_ptr() == first_row
        child = s.fork("side")
        first_row = child.seq.cache.layers[0].data_ptr()
        list(child.generate(5, stop_at_eos=False))
        assert child.seq.cache.layers[0].data_ptr() == first_row
        child.close()


def test_gc_removes_folders_left_by_a_crashed_create(store):
    stray = store.sessions_dir / "0123456789abcdef0123456789abcdef"
    stray.mkdir()
    (stray / "layer-000.kv").write_bytes(b"\0" * 4096)
    assert store.gc()["segments"] == 1
    assert not stray.exists()


def test_a_session_api_fork_continues_independently(store, model):
    with store.open("doc", model) as s:
        child = s.fork("side")
        list(child.generate(5, stop_at_eos=False))
        child.close()
        list(s.generate(3, stop_at_eos=False))
        n_parent = len(s.tokens)
    assert store.info("doc").n_tokens == n_parent
    assert store.info("side").n_tokens == n_parent - 3 + 5
    assert store.verify() == {"doc": [], "side": []}


def test_a_script_that_leaves_a_generation_unfinished_exits_cleanly(tmp_path, model_path):
    """A script that stops reading `generate` and exits without closing: no noise at interpreter exit
    (the session is checkpointed and unlocked before teardown, not by the generator's cleanup while
    imports fail), and the session then holds the tokens taken and the unfinished call."""
    import subprocess
    import sys

    home = tmp_path / "home"
    script = (f"import kvstore\nstore = kvstore.open_store({str(home)!r})\n"
              f"model = kvstore.load_model({model_path!r})\n"
              "s = store.new('left', model, seed=3)\ns.append_text('Once upon a time the cache')\n"
              "gen = s.generate(20, stop_at_eos=False)\nprint(next(gen), next(gen))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    taken = [int(t) for t in done.stdout.split()]
    store = kvstore.open_store(home)
    info = store.info("left")
    assert store.tokens("left")[-len(taken):] == taken and info.active_call is not None
    with store.open("left", kvstore.load_model(model_path)) as s:  # not locked any more
        list(s.resume())
        assert len(s.tokens) == info.active_call["start"] + 20
