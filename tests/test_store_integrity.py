"""Contracts C4–C8 at the store level: corrupt or truncated files, a deleted index, the wrong
model, two writers, a killed writer, a full disk, hostile names and forged archives all end in a
precise error and lose nothing."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash
import zstandard
from safetensors.torch import load_file, save_file
from sqlalchemy import select

import kvstore
import store_harness as H
from kvstore.store.archive import HEADER, MAGIC, VERSION
from kvstore.store import codec
from kvstore.store.index import BlobRow, ExtentBlobRow, ExtentRow, SegmentRow
from kvstore.errors import (CorruptData, InvalidName, ModelMismatch, SessionBusy, SessionNotFound, StoreMissing,
                            UnsupportedFormat)


@pytest.fixture
def store(tmp_path):
    return kvstore.open_store(tmp_path / "home")


@pytest.fixture
def saved(store, model):
    """A closed session with a document and a few generated tokens."""
    with store.new("s", model, seed=1, chunk_size=16, checkpoint_every=4) as s:
        s.append_text(H.DOCUMENT)
        list(s.generate(8, stop_at_eos=False))
    return store


@pytest.fixture
def prefilled(store, model):
    """A closed session whose last checkpoint is its prefill's: every token's KV and the last one's state."""
    with store.new("s", model, seed=1, chunk_size=16) as s:
        s.append_text(H.DOCUMENT)
    return store


def layer_file(store, name="s", layer=0) -> Path:
    return store.session_dir(store.info(name).id) / f"layer-{layer:03d}.kv"


# -- damaged bytes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 1000, -1])
def test_a_flipped_byte_in_an_extent_is_caught_on_open_and_by_verify(saved, model, offset):
    path = layer_file(saved, layer=1)
    H.flip_byte(path, offset if offset >= 0 else path.stat().st_size + offset)
    with pytest.raises(CorruptData, match=r"session 's', extent \d+.*layer 1.*checksum"):
        saved.open("s", model)
    problems = saved.verify()["s"]
    assert len(problems) == 1 and "checksum mismatch" in problems[0]


def test_a_truncated_file_is_corrupt_data(saved, model):
    path = layer_file(saved)
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(CorruptData, match="truncated"):
        saved.open("s", model)
    assert saved.verify()["s"]


def test_a_missing_file_is_corrupt_data(saved, model):
    layer_file(saved).unlink()
    with pytest.raises(CorruptData, match="missing"):
        saved.open("s", model)


def test_a_flipped_byte_in_a_packed_blob_is_caught(saved, model):
    saved.pack("s")
    blob = next((saved.home / "blobs").glob("*.kvz"))
    H.flip_byte(blob, blob.stat().st_size // 2)
    with pytest.raises(CorruptData, match="blob"):
        saved.open("s", model)
    assert saved.verify()["s"]


def test_a_truncated_or_missing_blob_is_corrupt_data(saved, model):
    saved.pack("s")
    blob = next((saved.home / "blobs").glob("*.kvz"))
    os.truncate(blob, blob.stat().st_size - 10)
    with pytest.raises(CorruptData, match=f"blobs/{blob.name}.*truncated"):
        saved.open("s", model)
    blob.unlink()
    with pytest.raises(CorruptData, match=f"blob {blob.name} is missing"):
        saved.open("s", model)
    assert saved.verify()["s"]


def test_every_layer_of_a_packed_extent_is_checked_on_open(saved, model):
    """An open reads a blob a layer at a time (no whole-file checksum on the way): a flipped byte in
    any layer's payload is refused, by zstd's frame checks or the layer's checksum of its raw bytes."""
    saved.pack("s")
    blob = next((saved.home / "blobs").glob("*.kvz"))
    good = blob.read_bytes()
    with saved.db() as db:
        frames = db.get(BlobRow, blob.stem).frames
    for offset, size in frames:
        for at in (offset + 8, offset + size // 2, offset + size - 1):
            H.flip_byte(blob, at)
            with pytest.raises(CorruptData, match="blob"):
                saved.open("s", model)
            blob.write_bytes(good)
    saved.open("s", model).close()  # the file as packed opens


def test_a_well_formed_blob_holding_other_kv_is_caught(saved, model):
    """Past zstd's own checks: a layer's payload that inflates cleanly to other bytes (a blob written
    wrong) fails that layer's checksum of its raw bytes."""
    saved.pack("s")
    blob = next((saved.home / "blobs").glob("*.kvz"))
    body = blob.read_bytes()
    with saved.db() as db:
        row = db.get(BlobRow, blob.stem)
        extent = db.get(ExtentRow, db.scalar(select(ExtentBlobRow.extent_id).where(ExtentBlobRow.blob_hash == row.hash)))
        token_bytes = db.get(SegmentRow, extent.segment_id).token_bytes
        itemsize = 2 if model.dtype == torch.bfloat16 else model.dtype.itemsize
        (offset, size), rest = row.frames[0], row.frames[1:]
        raw = codec.unpack_frame(body[offset:offset + size], extent.n_tokens * token_bytes, itemsize, token_bytes,
                                 what="test")
        raw[0] ^= 1  # one bit of the first element of layer 0
        other = codec.pack_frame(raw.tobytes(), itemsize, token_bytes)
        new_body = other + body[rest[0][0]:] if rest else other
        shift = len(other) - size
        row.frames = [[0, len(other)]] + [[o + shift, n] for o, n in rest]
        row.size = len(new_body)
        db.commit()
    blob.write_bytes(new_body)
    with pytest.raises(CorruptData, match=r"layer 0 \(blob .*checksum mismatch"):
        saved.open("s", model)


def test_a_deleted_index_is_reported_and_not_recreated(saved, tmp_path):
    saved.close()
    (tmp_path / "home" / "kvstore.db").unlink()
    for extra in (tmp_path / "home").glob("kvstore.db-*"):
        extra.unlink()
    with pytest.raises(StoreMissing, match="kvstore.db is missing"):
        kvstore.open_store(tmp_path / "home")
    assert not (tmp_path / "home" / "kvstore.db").exists()


def test_a_clean_store_verifies(saved):
    assert saved.verify() == {"s": []}


# -- identity ----------------------------------------------------------------------------------------
def test_the_same_architecture_with_other_weights_is_a_model_mismatch(saved, model_path, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(model_path, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name] + 0.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelMismatch, match="other weights"):
        saved.open("s", kvstore.load_model(other))


def test_another_dtype_is_a_model_mismatch(saved, model_path):
    with pytest.raises(ModelMismatch, match="bfloat16.*float32"):
        saved.open("s", kvstore.load_model(model_path, dtype="float32"))


def test_weights_held_another_way_are_a_model_mismatch_and_a_fork_may_switch(tmp_path, tiny):
    """C6: a session made on a GGUF's stored blocks continues only on them (other bits), found by
    itself when no model is given; a fork may ask to go on with dense weights instead."""
    from engine_models import Q

    path, _ = tiny("llama-gqa").gguf(Q.Q8_0)
    stored, dense = kvstore.load_model(path, weights="stored"), kvstore.load_model(path, weights="dense")
    store = kvstore.open_store(tmp_path / "home")
    with store.new("q", stored, seed=1) as s:
        s.append_text(H.DOCUMENT[:200])
        tokens = list(s.tokens)
    with pytest.raises(ModelMismatch, match="weights held 'stored'.*holds them 'dense'.*weights='stored'"):
        store.open("q", dense)
    with store.open("q") as s:  # the session's own way, found from its record
        assert s.model.weights == "stored" and s.tokens == tokens
    store.fork("q", "q-dense", weights="dense")
    assert store.info("q-dense").weights == "dense"
    with store.open("q-dense", dense) as s:
        assert s.tokens == tokens
    with pytest.raises(kvstore.errors.InvalidArgument, match="use one of"):
        store.fork("q", "q-bad", weights="int4")


def test_the_model_is_found_from_the_session_when_not_given(saved):
    with saved.open("s") as s:
        assert len(s.tokens) == saved.info("s").n_tokens


# -- writers -------------------------------------------------------------------------------------------
def test_a_second_writer_in_the_same_process_is_busy(saved, model):
    with saved.open("s", model):
        with pytest.raises(SessionBusy, match="another process"):
            saved.open("s", model)


def test_a_second_writer_in_another_process_is_busy_at_once_and_free_after_a_kill(saved, model, model_path, tmp_path):
    proc, conn = H.start(H.child_hold, str(tmp_path / "home"), model_path, "s")
    H.wait_for(conn, "ready")
    started = time.monotonic()
    with pytest.raises(SessionBusy):
        saved.open("s", model)
    # at once: while the writer still holds the lock, not after waiting for it (SQLite's busy wait is
    # 30 s); the bound leaves room for a loaded machine
    assert proc.is_alive() and time.monotonic() - started < 10.0
    H.kill_after(proc, conn, 0.05)
    with saved.open("s", model) as s:  # the kernel released the dead writer's lock
        assert s.tokens


def test_delete_waits_for_no_writer(saved, model):
    with saved.open("s", model):
        with pytest.raises(SessionBusy):
            saved.delete("s")
    saved.delete("s")
    with pytest.raises(SessionNotFound):
        saved.open("s", model)


# -- a full disk ----------------------------------------------------------------------------------------
@pytest.mark.skipif(H.tmpfs_refused() is not None, reason="needs `unshare -rm` and tmpfs mounts (user namespaces)")
def test_a_full_disk_raises_store_full_and_keeps_the_last_checkpoint(tmp_path, model_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    tests_dir = Path(__file__).parent
    code = f"import store_harness; store_harness.enospc_child({str(disk / 'home')!r}, {model_path!r})"
    cmd = f"mount -t tmpfs -o size=3m tmpfs {disk} && exec {sys.executable} -c {json.dumps(code)}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert result["raised"] == "StoreFull" and "disk is full" in result["message"]
    assert result["alive"] and result["lock_released"] and result["loads"] and result["tokens_ok"]
    assert result["verify"] == {"s": []}


# -- hostile input ----------------------------------------------------------------------------------------
HOSTILE = ["../x", "/etc/passwd", "a/b", "a\\b", "nul\0byte", "x" * 10_000, "", ".hidden", "-rf", "new\nline",
           "..", "a b"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_are_refused_and_nothing_is_written_outside_the_home(tmp_path, model, name):
    before = sorted(p.name for p in tmp_path.iterdir())
    store = kvstore.open_store(tmp_path / "home")
    with pytest.raises(InvalidName):
        store.new(name, model)
    with pytest.raises(InvalidName):
        store.open(name, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(before) | {"home"})
    assert store.names() == []


def test_names_are_labels_never_paths(store, model):
    with store.new("report:q3@2026+draft.v1", model) as s:
        s.append_text("hello")
    assert [p.name for p in store.sessions_dir.iterdir()] == [store.info("report:q3@2026+draft.v1").id]


def _archive_parts(path: Path):
    data = path.read_bytes()
    _, version, flags, length, _ = HEADER.unpack(data[:HEADER.size])
    manifest = json.loads(data[HEADER.size:HEADER.size + length])
    return manifest, data[HEADER.size + length:]


def test_an_export_clears_what_a_killed_export_to_the_same_file_left(saved, tmp_path):
    """A killed export leaves its temp file (.NAME.PID.tmp); the next export to that file removes it,
    but not one another export is still writing (it holds the file's flock), nor other files."""
    from kvstore.fileio import io

    abandoned = tmp_path / ".s.kvs.4242.tmp"
    abandoned.write_bytes(b"half an archive")
    live = io.lock(tmp_path / ".s.kvs.4343.tmp")
    unrelated = [tmp_path / ".t.kvs.4242.tmp", tmp_path / ".s.kvs.notes"]
    for path in unrelated:
        path.write_text("keep")
    try:
        saved.export("s", tmp_path / "s.kvs")
        assert not abandoned.exists()
        assert (tmp_path / ".s.kvs.4343.tmp").exists() and all(p.exists() for p in unrelated)
    finally:
        io.unlock(live)
    assert kvstore.open_store(tmp_path / "other").import_(tmp_path / "s.kvs") == "s"


def _write_archive(path: Path, manifest, payload: bytes, version: int | None = None) -> None:
    """An archive of `manifest` and `payload`, its header's version the manifest's unless given."""
    version = manifest["version"] if version is None else version
    body = json.dumps(manifest).encode()
    path.write_bytes(HEADER.pack(MAGIC, version, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body + payload)


def test_an_archive_with_a_forged_decompressed_size_is_refused_before_inflating(saved, tmp_path):
    saved.export("s", tmp_path / "s.kvs")
    manifest, payload = _archive_parts(tmp_path / "s.kvs")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # declares 64 MiB in its header
    frame = manifest["extents"][0]["frames"][0]
    frame["offset"], frame["size"] = len(payload), len(bomb)
    manifest["data_size"] = len(payload) + len(bomb)
    _write_archive(tmp_path / "bomb.kvs", manifest, payload + bomb)
    other = kvstore.open_store(tmp_path / "other")
    with pytest.raises(CorruptData, match="declares 67108864 bytes"):
        other.import_(tmp_path / "bomb.kvs")
    assert other.names() == [] and not any(other.sessions_dir.iterdir())


def test_an_archive_frame_that_inflates_past_its_size_is_refused(saved, tmp_path):
    saved.export("s", tmp_path / "s.kvs")
    manifest, payload = _archive_parts(tmp_path / "s.kvs")
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * (8 << 20))
    frame = manifest["extents"][0]["frames"][0]
    frame["offset"], frame["size"] = len(payload), len(stream)
    manifest["data_size"] = len(payload) + len(stream)
    _write_archive(tmp_path / "bomb.kvs", manifest, payload + stream)
    with pytest.raises(CorruptData, match="inflates past"):
        kvstore.open_store(tmp_path / "other").import_(tmp_path / "bomb.kvs")


@pytest.mark.parametrize("forge", ["raw_size", "tokens", "layout", "name", "offset"])
def test_forged_manifests_are_refused(saved, tmp_path, forge):
    saved.export("s", tmp_path / "s.kvs")
    manifest, payload = _archive_parts(tmp_path / "s.kvs")
    frame = manifest["extents"][0]["frames"][0]
    expected: type[Exception] = CorruptData
    if forge == "raw_size":
        frame["raw_size"] = 1 << 40
    elif forge == "tokens":
        manifest["tokens"][3] = 10 ** 9
    elif forge == "layout":
        manifest["session"]["kv_layout"]["per_token"][1] = 64
    elif forge == "name":
        manifest["session"]["name"] = "../../escape"
        expected = InvalidName
    elif forge == "offset":
        frame["offset"] = len(payload)
    _write_archive(tmp_path / "forged.kvs", manifest, payload)
    other = kvstore.open_store(tmp_path / "other")
    with pytest.raises(expected):
        other.import_(tmp_path / "forged.kvs")
    assert other.names() == [] and not any(other.sessions_dir.iterdir())


@pytest.mark.parametrize("forge", ["short", "not-hex", "missing", "pending"])
def test_an_archive_with_a_forged_last_token_state_is_refused(prefilled, model, tmp_path, forge):
    prefilled.export("s", tmp_path / "s.kvs")
    manifest, payload = _archive_parts(tmp_path / "s.kvs")
    session = manifest["session"]
    assert session["n_cached"] == session["n_tokens"] and len(session["last_hidden"]) == 2 * model.hidden_bytes
    if forge == "short":
        session["last_hidden"] = session["last_hidden"][:-2]
    elif forge == "not-hex":
        session["last_hidden"] = "zz" + session["last_hidden"][2:]
    elif forge == "missing":
        session["last_hidden"] = None
    elif forge == "pending":
        manifest["tokens"].append(manifest["tokens"][-1])
        session["n_tokens"] += 1
    _write_archive(tmp_path / "forged.kvs", manifest, payload)
    other = kvstore.open_store(tmp_path / "other")
    with pytest.raises(CorruptData, match="last.token"):
        other.import_(tmp_path / "forged.kvs")
    assert other.names() == [] and not any(other.sessions_dir.iterdir())


def test_a_lost_last_token_state_is_corrupt_data_on_open_and_in_verify(prefilled, model):
    from sqlalchemy import update

    from kvstore.store.index import SessionRow

    with prefilled.db() as db, db.begin():
        db.execute(update(SessionRow).values(last_hidden=None))
    with pytest.raises(CorruptData, match="last token's state is missing"):
        prefilled.open("s", model)
    assert prefilled.verify() == {"s": ["every token's KV is cached, but the last token's state is missing"]}
    with prefilled.db() as db, db.begin():
        db.execute(update(SessionRow).values(last_hidden=b"\0" * 6))
    with pytest.raises(CorruptData, match="6 bytes"):
        prefilled.open("s", model)
    assert "has 6 bytes" in prefilled.verify()["s"][0]


def test_an_archive_whose_header_and_manifest_disagree_on_the_version_is_refused(saved, tmp_path):
    saved.export("s", tmp_path / "s.kvs")
    manifest, payload = _archive_parts(tmp_path / "s.kvs")
    assert manifest["version"] == VERSION
    _write_archive(tmp_path / "mixed.kvs", manifest, payload, version=VERSION - 1)
    other = kvstore.open_store(tmp_path / "other")
    with pytest.raises(CorruptData, match=f"header says format version {VERSION - 1}, the manifest {VERSION}"):
        other.import_(tmp_path / "mixed.kvs")
    assert other.names() == []


def test_archive_magic_version_and_damage(saved, tmp_path):
    saved.export("s", tmp_path / "s.kvs")
    data = (tmp_path / "s.kvs").read_bytes()
    other = kvstore.open_store(tmp_path / "other")
    (tmp_path / "text.kvs").write_bytes(b"hello world, not an archive at all" * 3)
    with pytest.raises(UnsupportedFormat, match="bad magic"):
        other.import_(tmp_path / "text.kvs")
    (tmp_path / "v9.kvs").write_bytes(data[:8] + struct.pack("<I", 9) + data[12:])
    with pytest.raises(UnsupportedFormat, match="version 9"):
        other.import_(tmp_path / "v9.kvs")
    flipped = bytearray(data)
    flipped[-5] ^= 1
    (tmp_path / "flip.kvs").write_bytes(bytes(flipped))
    with pytest.raises(CorruptData):
        other.import_(tmp_path / "flip.kvs")
    (tmp_path / "short.kvs").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptData):
        other.import_(tmp_path / "short.kvs")
    assert other.names() == []


@pytest.mark.parametrize("damage", ["gap", "overlap"])
def test_token_blocks_that_do_not_tile_are_corrupt_data_on_open_and_in_verify(saved, model, damage):
    """The index's token blocks must follow each other exactly (a check that holds under python -O
    too: it is not an assert); the session then opens nowhere and verify says why."""
    from sqlalchemy import select, update

    from kvstore.store.index import TokenBlockRow

    sid = saved.info("s").id
    with saved.db() as db, db.begin():
        last = db.scalars(select(TokenBlockRow).where(TokenBlockRow.session_id == sid)
                          .order_by(TokenBlockRow.start.desc())).first()
        moved = last.start + 3 if damage == "gap" else last.start - 1
        db.execute(update(TokenBlockRow).where(TokenBlockRow.session_id == sid, TokenBlockRow.start == last.start)
                   .values(start=moved))
    with pytest.raises(CorruptData, match=r"session 's': the token blocks are not contiguous"):
        saved.open("s", model)
    with pytest.raises(CorruptData, match="not contiguous"):
        saved.tokens("s")
    (problem,) = [p for p in saved.verify()["s"] if "contiguous" in p]
    assert f"starts at position {moved}" in problem

