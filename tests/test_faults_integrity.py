"""Contract C6 byte by byte: every single-byte flip of a small extent, of its packed blob and of an
exported archive is detected (a precise error, never other tokens or other cache bytes), and so is
a truncation of each kind of file at every length class, the index included."""

from __future__ import annotations

import mmap
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.store.archive import HEADER, read_manifest
from kvstore.errors import CorruptData, KvstoreError, StoreMissing

SECTOR, PAGE = 512, mmap.PAGESIZE


@pytest.fixture(scope="module")
def small(tmp_path_factory, model):
    """A closed session whose KV is two small extents (2 tokens at offset 0, 1 at the next page),
    its export, and its packed copy."""
    root = tmp_path_factory.mktemp("small")
    store = kvstore.open_store(root / "home")
    with store.new("s", model, seed=1, system="Be brief.", chunk_size=2) as s:
        s.append_tokens([5, 17, 42, 99])
        state = [t.clone() for t in s.seq.cache.state()]
        tokens = list(s.tokens)
    store.export("s", root / "s.kvs")
    shutil.copytree(root / "home", root / "packed")
    packed = kvstore.open_store(root / "packed")
    packed.pack("s")
    store.close()
    packed.close()
    return root, tokens, state


def same_session(store, model, name, tokens, state) -> bool:
    with store.open(name, model) as s:
        return s.tokens == tokens and all(torch.equal(a, b) for a, b in zip(s.seq.cache.state(), state))


def flipped(path: Path, offset: int, mask: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def flip_each_byte(path: Path, offsets, attempt) -> dict[str, int]:
    """Flip each byte in turn (a random non-zero mask), call attempt(), restore; count outcomes."""
    original, rng = path.read_bytes(), random.Random(str(path.name))
    counts = {"detected": 0, "harmless": 0, "undetected": 0}
    for offset in offsets:
        flipped(path, offset, rng.randrange(1, 256))
        try:
            counts["harmless" if attempt() else "undetected"] += 1
        except KvstoreError:
            counts["detected"] += 1
        finally:
            path.write_bytes(original)
    return counts


def test_every_byte_flip_of_a_small_extent_is_detected(small, model, tmp_path):
    root, tokens, state = small
    shutil.copytree(root / "home", tmp_path / "home")
    store = kvstore.open_store(tmp_path / "home")
    directory = store.session_dir(store.info("s").id)
    token_bytes = state[0][0].numel() * state[0].element_size()
    committed = [*range(2 * token_bytes), *range(PAGE, PAGE + token_bytes)]  # the two extents
    total = {"detected": 0, "harmless": 0, "undetected": 0}
    for layer in range(len(state)):
        counts = flip_each_byte(directory / f"layer-{layer:03d}.kv", committed,
                                lambda: same_session(store, model, "s", tokens, state))
        total = {k: total[k] + counts[k] for k in total}
    assert total == {"detected": len(committed) * len(state), "harmless": 0, "undetected": 0}


def test_every_byte_flip_of_a_blob_is_detected(small, model, tmp_path):
    root, tokens, state = small
    shutil.copytree(root / "packed", tmp_path / "home")
    store = kvstore.open_store(tmp_path / "home")
    blob = next((tmp_path / "home" / "blobs").glob("*.kvz"))
    counts = flip_each_byte(blob, range(blob.stat().st_size), lambda: same_session(store, model, "s", tokens, state))
    assert counts["undetected"] == 0 and counts["detected"] == blob.stat().st_size, counts


def archive_offsets(path: Path, every: int) -> list[int]:
    """All the header and frame bytes; every `every`-th manifest byte (its checksum covers them)."""
    manifest, start, size = read_manifest(path)
    return [*range(HEADER.size), *range(HEADER.size, start, every), *range(start, start + size)]


def import_attempt(path: Path, home: Path, model, tokens, state):
    store = kvstore.open_store(home)

    def attempt() -> bool:
        try:
            name = store.import_(path, name="copy")
        except KvstoreError:
            assert store.names() == [] and list(store.sessions_dir.iterdir()) == [], "a refused import left files"
            raise
        same = same_session(store, model, name, tokens, state)
        store.delete(name)
        return same
    return attempt


def test_byte_flips_of_an_archive_are_detected(small, model, tmp_path):
    root, tokens, state = small
    archive = tmp_path / "s.kvs"
    shutil.copy(root / "s.kvs", archive)
    offsets = archive_offsets(archive, every=16)
    counts = flip_each_byte(archive, offsets, import_attempt(archive, tmp_path / "home", model, tokens, state))
    assert counts["undetected"] == 0 and counts["detected"] >= len(offsets) - 2, counts


@pytest.mark.slow
def test_every_byte_flip_of_an_archive_is_detected(small, model, tmp_path):
    root, tokens, state = small
    archive = tmp_path / "s.kvs"
    shutil.copy(root / "s.kvs", archive)
    counts = flip_each_byte(archive, archive_offsets(archive, every=1),
                            import_attempt(archive, tmp_path / "home", model, tokens, state))
    assert counts["undetected"] == 0, counts


# -- truncation ------------------------------------------------------------------------------------
def length_classes(size: int, boundaries=()) -> list[int]:
    """0, 1, around a sector and a page, around each boundary, half, one short."""
    marks = {0, 1, SECTOR - 1, SECTOR, SECTOR + 1, PAGE - 1, PAGE, PAGE + 1, size // 2, size - 1}
    for b in boundaries:
        marks |= {b - 1, b, b + 1}
    return sorted(n for n in marks if 0 <= n < size)


@pytest.mark.parametrize("kind", ["layer", "blob"])
def test_a_truncated_kv_file_at_every_length_class_is_corrupt_data(small, model, tmp_path, kind):
    root, tokens, state = small
    source = root / ("home" if kind == "layer" else "packed")
    size = max(p.stat().st_size for p in source.rglob("*.kv*"))
    token_bytes = state[0][0].numel() * state[0].element_size()
    for n in length_classes(size, [token_bytes, 2 * token_bytes] if kind == "layer" else [4, 8, 12]):
        home = tmp_path / f"home-{n}"
        shutil.copytree(source, home)
        store = kvstore.open_store(home)
        path = (store.session_dir(store.info("s").id) / "layer-001.kv" if kind == "layer"
                else max((home / "blobs").glob("*.kvz"), key=lambda p: p.stat().st_size))
        os.truncate(path, n)
        with pytest.raises(CorruptData, match="truncated|missing|checksum|damaged"):
            store.open("s", model)
        assert store.verify()["s"], f"verify missed a {kind} file cut to {n} bytes"
        store.close()


def test_a_truncated_archive_at_every_length_class_is_refused(small, model, tmp_path):
    root, tokens, state = small
    data = (root / "s.kvs").read_bytes()
    manifest, start, size = read_manifest(root / "s.kvs")
    frames = [start + fr["offset"] for e in manifest["extents"] for fr in e["frames"]]
    for n in length_classes(len(data), [8, 12, 16, 24, HEADER.size, start, *frames]):
        (tmp_path / "cut.kvs").write_bytes(data[:n])
        store = kvstore.open_store(tmp_path / f"home-{n}")
        with pytest.raises(KvstoreError):
            store.import_(tmp_path / "cut.kvs")
        assert store.names() == [] and list(store.sessions_dir.iterdir()) == []
        store.close()


def test_a_truncated_index_at_every_length_class_is_refused_and_gc_cannot_run(small, model, tmp_path):
    """A damaged kvstore.db must not open as an empty store: a gc there would delete every session."""
    root, tokens, state = small
    size = (root / "home" / "kvstore.db").stat().st_size
    for n in length_classes(size, [100]):
        home = tmp_path / f"home-{n}"
        shutil.copytree(root / "home", home)
        os.truncate(home / "kvstore.db", n)
        kv_files = sorted(p.relative_to(home) for p in home.rglob("*.kv"))
        try:
            store = kvstore.open_store(home)
        except (StoreMissing, CorruptData):
            pass
        else:  # only a cut in free pages could leave it readable: then it must still be whole
            try:
                assert store.names() == ["s"] and same_session(store, model, "s", tokens, state)
                store.gc()
            finally:
                store.close()
        assert sorted(p.relative_to(home) for p in home.rglob("*.kv")) == kv_files
