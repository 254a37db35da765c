"""Listing at scale, on SQLite and on PostgreSQL: pages in name order that neither repeat nor skip
a session, in a number of index queries that does not grow with the store; disk bytes from the
index that `list` and `info` agree on (raw files while unpacked, blobs once packed, nothing for a
fork until it writes); `verify` reading each extent once however many forks share it, and
reporting a damaged one for every session that uses it. Timings live in the benchmarks
(`python -m benchmarks.scale`)."""

from __future__ import annotations

import pytest
from sqlalchemy import event

import kvstore
import store_harness as H
from kvstore.errors import InvalidArgument, SessionNotFound
from kvstore.store import verify as verify_module
from kvstore.store.extents import kv_bytes, session_extents


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    store = kvstore.open_store(tmp_path / "home", url=url)
    yield store
    store.close()


def document(store, model, name: str = "doc", n_new: int = 4) -> None:
    """A session of several extents (prefill chunks of 16, then a checkpoint every 4 tokens)."""
    with store.new(name, model, seed=1, chunk_size=16, checkpoint_every=4) as s:
        s.append_text(H.DOCUMENT)
        list(s.generate(n_new, stop_at_eos=False))


def layer_file_bytes(store, name: str) -> int:
    directory = store.session_dir(store.info(name).id)
    return sum(p.stat().st_size for p in directory.glob("layer-*.kv"))


def blob_bytes(store) -> int:
    return sum(p.stat().st_size for p in store.blobs_dir.glob("*.kvz"))


def listed(store) -> dict[str, dict]:
    return {i.name: i.to_dict() for i in store.list()}


def assert_list_agrees_with_info(store) -> None:
    records = listed(store)
    assert records == {name: store.info(name).to_dict() for name in store.names()}


# -- pages ---------------------------------------------------------------------------------------
def test_pages_walk_every_session_once_in_name_order(store, model):
    document(store, model)
    for name in ("q-07", "q-01", "b", "q-10", "a.2", "a.10", "z"):
        store.fork("doc", name)
    names = store.names()
    walked, after, pages = [], None, 0
    while True:
        page = store.page(3, after)
        walked += [i.name for i in page.sessions]
        pages += 1
        if page.next is None:
            break
        assert page.next == page.sessions[-1].name and len(page.sessions) == 3
        after = page.next
    assert walked == names and pages == 3 and len(names) == store.count() == 8
    assert [i.name for i in store.list()] == names
    assert [i.name for i in store.list(limit=2, after="b")] == names[names.index("b") + 1:][:2]
    assert store.list(after=names[-1]) == [] and store.page(5, after=names[-1]).next is None
    assert [i.name for i in store.list(after="c")] == [n for n in names if n > "c"]  # any string is a cursor


def test_a_page_costs_the_same_queries_in_a_store_of_any_size(store, model):
    """Two queries for the rows and the forks (plus the transaction's own statements), the same for a
    store of 6 sessions as of 30; count is one."""
    document(store, model)
    for i in range(5):
        store.fork("doc", f"f{i:02d}")
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))

    def cost(call) -> int:
        statements.clear()
        call()
        return len(statements)

    small = cost(lambda: store.page(4)), cost(lambda: store.page(4, after="f00")), cost(store.count)
    for i in range(5, 30):
        store.fork("f00" if i % 2 else "doc", f"f{i:02d}")
    large = cost(lambda: store.page(4)), cost(lambda: store.page(4, after="f00")), cost(store.count)
    assert small == large
    queries = [s for s in statements if s.lstrip().upper().startswith("SELECT")
               and "pg_advisory_xact_lock" not in s]
    assert len(queries) == 1  # count
    assert cost(lambda: store.info("doc")) == small[0]  # info is a page of one


def test_limits_and_cursors_are_checked(store):
    for bad in (0, -1, "3", True, 2.0):
        with pytest.raises(InvalidArgument, match="limit"):
            store.page(bad)
        with pytest.raises(InvalidArgument, match="limit"):
            store.list(limit=bad)
    with pytest.raises(InvalidArgument, match="after"):
        store.page(10, after=5)
    assert store.page(10) == kvstore.SessionPage([], None) and store.count() == 0
    with pytest.raises(SessionNotFound, match="kvstore list"):
        store.info("nope")


def test_forks_parents_and_a_deleted_parent_in_the_records(store, model):
    document(store, model)
    for name in ("c2", "c1", "c3"):
        store.fork("doc", name)
    store.fork("c1", "c1-child", at=10)
    records = listed(store)
    assert records["doc"]["forks"] == ["c1", "c2", "c3"] and records["c1"]["forks"] == ["c1-child"]
    assert records["c1-child"]["parent"] == "c1" and records["c1-child"]["fork_position"] == 10
    page = store.page(1, after="c1")  # a page that holds the parent but none of its forks
    assert [i.name for i in page.sessions] == ["c1-child"]
    assert store.page(1).sessions[0].forks == ["c1-child"]
    store.delete("c1")
    child = store.info("c1-child")
    assert child.parent is None and child.fork_position == 10
    assert_list_agrees_with_info(store)


# -- disk bytes ------------------------------------------------------------------------------------
def test_list_and_info_agree_on_disk_bytes_before_and_after_a_pack_and_for_forks(store, model):
    document(store, model)
    store.fork("doc", "fork")  # owns nothing until it writes
    store.fork("doc", "writer")
    with store.open("writer", model) as w:
        list(w.generate(4, stop_at_eos=False))
    assert_list_agrees_with_info(store)
    doc, fork, writer = (store.info(n) for n in ("doc", "fork", "writer"))
    assert doc.disk_bytes == layer_file_bytes(store, "doc") > 0  # the raw files, from the index
    assert fork.disk_bytes == 0
    assert writer.disk_bytes == layer_file_bytes(store, "writer") > 0

    store.pack("doc")  # frees doc's raw files; its extents, shared by both forks, are in blobs now
    assert_list_agrees_with_info(store)
    assert layer_file_bytes(store, "doc") == 0
    assert store.info("doc").disk_bytes == store.info("fork").disk_bytes == blob_bytes(store) > 0
    assert store.info("writer").disk_bytes == layer_file_bytes(store, "writer") + blob_bytes(store)

    store.pack("writer")
    assert_list_agrees_with_info(store)
    assert layer_file_bytes(store, "writer") == 0
    assert store.info("writer").disk_bytes == blob_bytes(store) > store.info("doc").disk_bytes


def test_a_session_that_writes_after_a_pack_counts_its_raw_files_again(store, model):
    document(store, model)
    store.pack("doc")
    packed = store.info("doc").disk_bytes
    with store.open("doc", model) as s:
        list(s.generate(4, stop_at_eos=False))
    seg_bytes = store.info("doc").disk_bytes - packed
    with store.db() as db:
        from kvstore.store.index import SegmentRow

        seg = db.get(SegmentRow, store.info("doc").id)
    assert seg_bytes == seg.committed_end * seg.n_layers > 0
    assert_list_agrees_with_info(store)


# -- verify ------------------------------------------------------------------------------------------
def flip_a_byte(store, name: str, extent: int) -> None:
    ref = session_extents_of(store, name)[extent]
    path = store.session_dir(ref.segment_id) / "layer-000.kv"
    data = bytearray(path.read_bytes())
    data[ref.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))


def session_extents_of(store, name: str):
    with store.db() as db:
        return session_extents(db, store.info(name).id)


def test_a_damaged_shared_extent_is_reported_for_every_session_that_uses_it(store, model, monkeypatch):
    document(store, model)
    refs = session_extents_of(store, "doc")
    for i in range(3):
        store.fork("doc", f"q{i}")
    store.fork("doc", "early", at=refs[1].start)  # uses extent 0 only
    flip_a_byte(store, "doc", 1)
    report = store.verify()
    damaged = refs[1].extent_id
    for name in ("doc", "q0", "q1", "q2"):
        (problem,) = report[name]
        assert problem.startswith(f"session {name!r}, extent {damaged}, layer 0") and "checksum" in problem
    assert report["early"] == []
    assert store.verify("q1") == {"q1": report["q1"]}
    monkeypatch.setattr(verify_module, "CHUNK", 2)  # the index read two sessions at a time: the same report
    assert store.verify() == report


def test_verify_reads_each_extent_once_and_counts_its_bytes_once(store, model, monkeypatch):
    document(store, model)
    for i in range(4):
        store.fork("doc", f"q{i}")
    with store.open("q0", model) as q:  # q0 adds extents of its own
        list(q.generate(8, stop_at_eos=False))
    store.fork("q0", "q0-child")
    distinct = {r.extent_id: r for name in store.names() for r in session_extents_of(store, name)}
    reads: list[int] = []
    real = verify_module.read_layers_unlocked
    monkeypatch.setattr(verify_module, "read_layers_unlocked",
                        lambda st, ref, *a, **k: (reads.append(ref.extent_id), real(st, ref, *a, **k))[1])
    calls: list[tuple[int, int]] = []
    assert store.verify(progress=lambda done, total: calls.append((done, total))) == \
        {name: [] for name in store.names()}
    assert sorted(reads) == sorted(distinct) and len(reads) == len(distinct)
    total = sum(kv_bytes(r) for r in distinct.values())
    assert calls[-1] == (total, total) and len(calls) == len(distinct)
