"""Long jobs report progress: export, import, pack and verify call `progress(done, total)` after each
extent with the raw KV bytes handled so far, and export keeps one extent in memory at a time."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

import kvstore
import store_harness as H
from kvstore.store.extents import kv_bytes, session_extents


@pytest.fixture
def store(tmp_path):
    s = kvstore.open_store(tmp_path / "home")
    yield s
    s.close()


def document(store, model, name="doc", chunk_size=16):
    """A session of many extents: a prefill in chunks, then decode checkpoints every 4 tokens."""
    with store.new(name, model, seed=3, temperature=0.9, chunk_size=chunk_size, checkpoint_every=4) as s:
        s.append_text(H.DOCUMENT * 3)
        list(s.generate(24, stop_at_eos=False))
    with store.db() as db:
        refs = session_extents(db, store.row(db, name).id)
    assert len(refs) > 5
    return refs


def record():
    calls = []
    return calls, lambda done, total: calls.append((done, total))


def assert_reports(calls, total):
    """done rises after every step, never past total, and reaches it; total never changes."""
    assert calls, "no progress was reported"
    dones = [d for d, _ in calls]
    assert all(t == total for _, t in calls)
    assert all(a < b for a, b in zip(dones, dones[1:]))
    assert dones[-1] == total


def test_export_import_pack_and_verify_report_kv_bytes(store, model, tmp_path):
    refs = document(store, model)
    total = sum(kv_bytes(r) for r in refs)
    calls, progress = record()
    store.export("doc", tmp_path / "doc.kvs", progress=progress)
    assert_reports(calls, total)
    assert len(calls) == len(refs)

    calls, progress = record()
    store.import_(tmp_path / "doc.kvs", name="copy", progress=progress)
    used = sum(r.n_tokens * r.token_bytes * len(r.checksums) for r in refs)  # an archive holds the used tokens
    assert_reports(calls, used)

    calls, progress = record()
    assert store.verify(progress=progress) == {"copy": [], "doc": []}
    assert_reports(calls, total + used)

    calls, progress = record()
    with store.open("doc", model) as s:
        assert s.pack(progress=progress)["raw_bytes"] == total
    assert_reports(calls, total)
    calls, progress = record()
    store.pack("copy", progress=progress)
    assert_reports(calls, used)
    assert store.verify() == {"copy": [], "doc": []}


def test_export_holds_one_extent_at_a_time(store, model_path, tmp_path):
    """Memory in use does not grow with the extents written: what is compressed goes to the file.
    (Float32 and prefill chunks of 64: extents large enough that their bytes, not the manifest's
    entries for them, are what would pile up.)"""
    document(store, kvstore.load_model(model_path, dtype=torch.float32), chunk_size=64)
    in_use = []
    tracemalloc.start()
    try:
        summary = store.export("doc", tmp_path / "doc.kvs",
                               progress=lambda done, total: in_use.append(tracemalloc.get_traced_memory()[0]))
    finally:
        tracemalloc.stop()
    data = summary["bytes"]
    assert len(in_use) >= 4 and data > 50_000
    assert max(in_use) - in_use[0] < data / 4, (in_use, data)


def test_an_archive_leaves_room_for_its_manifest_and_imports_after_a_round_trip(store, model, tmp_path):
    """The manifest is written last, into room reserved for its widest form; the rest is spaces."""
    from kvstore.store import archive

    document(store, model)
    summary = store.export("doc", tmp_path / "doc.kvs")
    assert (tmp_path / "doc.kvs").stat().st_size == summary["bytes"]
    manifest, data_start, data_size = archive.read_manifest(tmp_path / "doc.kvs")
    assert data_size == manifest["data_size"] == summary["bytes"] - data_start
    assert store.import_(tmp_path / "doc.kvs", name="back") == "back"
    assert store.tokens("back") == store.tokens("doc")
    assert store.verify("back") == {"back": []}
