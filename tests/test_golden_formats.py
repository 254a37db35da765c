"""Golden formats: files written the way every earlier kvstore wrote them stay readable, byte for byte.

tests/golden/ holds, committed once (`tests/golden/make_golden.py`, which says when it may be rerun:
only for a new format), an archive of every version this kvstore reads (1 to 5, in bfloat16 and
float32) and a packed blob in each of the three payload encodings (docs/FORMATS.md). This module is
their specification, written independently of both the writer and the reader: the KV bytes come
from `element` below (recomputed here, element by element, not read from any writer), the tokens,
messages and settings are spelled out here. The contract checked:

- the committed files carry the documented constants (magic, header layout, versions, flags, the
  planes mark, zstd's magic, u32 lengths), and kvstore's constants are those: changing one fails here;
- decoded by the spec alone (zstandard and numpy, no kvstore code) every payload is the formula's
  bytes, so the fixtures are what docs/FORMATS.md says;
- `Store.import_` of each archive (no model) yields exactly the tokens, messages, settings, model
  record, extents, KV bytes, (version 4 on) last token's state and how the model held its weights
  (version 5's field; "dense" before it), and `verify` finds nothing wrong; an export of it is the
  current version and carries the same session, its weights included;
- `blobs.unpack` of each blob yields the formula's bytes, its name is the xxh3-128 of them, and a
  store whose pack finds such a blob already committed (an older kvstore packed it) reads it;
- one changed byte in an archive is refused (`CorruptData`, `UnsupportedFormat`) with the store
  left as it was; in a blob every changed byte is refused or decodes to the very same bytes.
The tests decode committed bytes only; they never compare them with a fresh compression (zstd's
output may differ across its releases).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard

import kvstore
from kvstore.errors import CorruptData, UnsupportedFormat
from kvstore.store import archive, blobs, codec
from kvstore.store.extents import read_layers, session_extents
from kvstore.store.index import BlobRow, ExtentBlobRow, ModelRow

GOLDEN = Path(__file__).parent / "golden"

# -- the specification of the fixtures ---------------------------------------------------------------
MAGIC = b"\x89KVS\r\n\x1a\n"
HEADER = "<8sIIQQ"  # magic, version u32, flags u32, manifest length u64, manifest xxh3-64 u64
PLANES_MARK = b"KVP\x83"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
VERSIONS = (1, 2, 3, 4, 5)
DTYPES = {"bfloat16": 2, "float32": 4}  # itemsize
# the payloads each version wrote
ENCODING_OF = {1: "shuffled", 2: "channel-major", 3: "planes", 4: "planes", 5: "planes"}
ENCODINGS = ("shuffled", "channel-major", "planes")
ARCHIVES = [(v, d) for v in VERSIONS for d in DTYPES]
BLOBS = [(e, d) for e in ENCODINGS for d in DTYPES]

N_LAYERS, N_KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 2, 8, 32, 1000
ELEMENTS = 2 * N_KV_HEADS * HEAD_DIM
TOKENS = [(37 * i + 11) % VOCAB for i in range(17)]
SEED = -1234567890123
SAMPLER = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
           "repetition_window": 64}
MESSAGES = [
    ("system", "Réponds brièvement, s'il te plaît.", 0, 5),
    ("user", "Grüße! 日本語で答えて 🙂", 5, 11),
    ("assistant", "はい — ça va ✓", 11, 17),
]
CONFIG = {"arch": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "n_layers": N_LAYERS, "n_heads": 4,
          "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 64, "norm_eps": 1e-05,
          "max_context": 64, "rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": False,
          "qkv_bias": False, "o_bias": False, "mlp_bias": False, "variant": ""}
FINGERPRINT = xxhash.xxh3_128_hexdigest(b"kvstore golden synthetic model")
SOURCE = "golden-synthetic-model (no weights)"


def element(layer: int, token: int, c: int, itemsize: int) -> int:
    """Bit pattern of element c (K then V, head by head) of `token` in `layer`: a sign and exponent byte
    from a few values on top, then a 32-bit hash's low byte (bfloat16) or low three bytes (float32)."""
    x = (token * 0x9E3779B1 + c * 0x85EBCA77 + (layer + 1) * 0xC2B2AE3D) % 2**32
    x ^= x >> 15
    x = x * 0x2C1B3C6D % 2**32
    x ^= x >> 12
    top = 0x3C + (token + c) % 8 + (0x80 if c % 3 == 0 else 0)
    return top << 8 | x & 0xFF if itemsize == 2 else top << 24 | x & 0xFFFFFF


def kv(layer: int, start: int, n: int, dtype: str) -> bytes:
    """Token-major raw bytes of `layer` for tokens [start, start + n), little-endian elements."""
    size = DTYPES[dtype]
    return b"".join(element(layer, t, c, size).to_bytes(size, "little")
                    for t in range(start, start + n) for c in range(ELEMENTS))


def hidden(dtype: str) -> bytes:
    return bytes((73 * i + 5) % 256 for i in range(HIDDEN * DTYPES[dtype]))


def expected(version: int, dtype: str) -> dict:
    """What the archive of `version` holds beyond the shared session: before version 4 the last
    token is pending (C2 as first written: 16 of 17 cached, no state); version 4 caches every token,
    carries its state and a chat reply in progress; version 5 is 4 with the weights held "stored"
    (C6), where every earlier session's were "dense" (those versions have no field for it)."""
    weights = "stored" if version >= 5 else "dense"
    if version < 4:
        return {"n_cached": 16, "extents": [(0, 8), (8, 4), (12, 4)], "last_hidden": None, "active_call": None,
                "weights": weights}
    return {"n_cached": 17, "extents": [(0, 8), (8, 8), (16, 1)], "last_hidden": hidden(dtype),
            "active_call": {"kind": "chat", "start": 11, "max_new_tokens": 32, "stop": [], "message": 2},
            "weights": weights}


def archive_path(version: int, dtype: str) -> Path:
    return GOLDEN / f"v{version}-{dtype}.kvs"


def split(data: bytes) -> tuple[tuple, dict, int]:
    """(header fields, manifest, data start), parsed by the spec alone."""
    fields = struct.unpack_from(HEADER, data)
    start = struct.calcsize(HEADER) + fields[3]
    return fields, json.loads(data[struct.calcsize(HEADER):start]), start


def spec_decode(payload: bytes, encoding: str, itemsize: int, row_bytes: int) -> bytes:
    """One layer's payload -> its token-major bytes, by docs/FORMATS.md and nothing from kvstore."""
    inflate = zstandard.ZstdDecompressor().decompress
    if encoding == "shuffled":  # one frame: the byte planes of the token-major elements
        return np.frombuffer(inflate(payload), np.uint8).reshape(itemsize, -1).T.tobytes()
    at, planes = (4 if encoding == "planes" else 0), []
    for _ in range(itemsize):
        (n,) = struct.unpack_from("<I", payload, at)
        planes.append(inflate(payload[at + 4:at + 4 + n]))
        at += 4 + n
    assert at == len(payload), "bytes after the last plane"
    p = np.frombuffer(b"".join(planes), np.uint8).reshape(itemsize, -1)
    if encoding == "planes":
        return p.T.tobytes()
    return p.reshape(itemsize, row_bytes // itemsize, -1).transpose(2, 1, 0).tobytes()  # channel-major


def assert_starts_as(payload: bytes, encoding: str) -> None:
    """How a reader tells the encodings apart: their first four bytes (docs/FORMATS.md)."""
    head = payload[:4]
    if encoding == "shuffled":
        assert head == ZSTD_MAGIC
    elif encoding == "channel-major":
        assert head not in (ZSTD_MAGIC, PLANES_MARK) and struct.unpack("<I", head)[0] < 2**31  # a frame's length
    else:
        assert head == PLANES_MARK


# -- the constants --------------------------------------------------------------------------------------
def test_kvstore_has_the_documented_constants_and_a_golden_archive_of_every_version_it_reads():
    assert archive.MAGIC == MAGIC
    assert archive.HEADER.format == HEADER and archive.HEADER.size == 32
    assert codec.PLANES_MARK == PLANES_MARK and codec.ZSTD_MAGIC == ZSTD_MAGIC and codec.LENGTH.format == "<I"
    assert codec.ITEMSIZE["bfloat16"] == 2 and codec.ITEMSIZE["float32"] == 4
    # a version added to READABLE needs its golden archive (tests/golden/make_golden.py) and its spec here
    assert tuple(sorted(archive.READABLE)) == VERSIONS and archive.VERSION == max(VERSIONS)
    assert sorted(p.name for p in GOLDEN.glob("*.kvs")) == sorted(archive_path(v, d).name for v, d in ARCHIVES)
    index = json.loads((GOLDEN / "blobs.json").read_text())
    assert sorted((e["encoding"], e["dtype"]) for e in index) == sorted(BLOBS)
    assert sorted(p.name for p in GOLDEN.glob("*.kvz")) == sorted(e["file"] for e in index)


@pytest.mark.parametrize("version, dtype", ARCHIVES)
def test_the_archive_header_and_manifest_are_the_documented_ones(version, dtype):
    path = archive_path(version, dtype)
    data = path.read_bytes()
    (magic, v, flags, length, digest), man, start = split(data)
    assert (magic, v, flags, start) == (MAGIC, version, 0, 32 + length)
    assert xxhash.xxh3_64_intdigest(data[32:start]) == digest
    if version >= 3:  # the streaming exporter's manifest: room left unused is JSON whitespace
        assert data[32:start].rstrip(b" ") != data[32:start]
    assert man["format"] == "kvstore-archive" and man["version"] == version
    assert set(man) == {"format", "version", "session", "model", "token_bytes", "tokens", "messages", "extents",
                        "data_size"}
    session_fields = {"name", "seed", "sampler", "chunk_size", "checkpoint_every", "dtype", "kv_layout",
                      "active_call", "n_tokens", "n_cached"} | ({"last_hidden"} if version >= 4 else set()) \
        | ({"weights"} if version >= 5 else set())
    assert set(man["session"]) == session_fields
    assert man["session"].get("weights", "dense") == expected(version, dtype)["weights"]
    assert man["data_size"] == len(data) - start
    assert archive.read_manifest(path) == (man, start, len(data) - start)  # the reader agrees with the spec
    assert archive.validate(man, len(data) - start, path.name) is man


@pytest.mark.parametrize("version, dtype", ARCHIVES)
def test_every_payload_is_in_its_versions_encoding_and_decodes_to_the_formula(version, dtype):
    data = archive_path(version, dtype).read_bytes()
    _, man, start = split(data)
    itemsize, encoding = DTYPES[dtype], ENCODING_OF[version]
    assert man["token_bytes"] == ELEMENTS * itemsize
    assert [(e["start"], e["n_tokens"]) for e in man["extents"]] == expected(version, dtype)["extents"]
    for e in man["extents"]:
        assert len(e["frames"]) == N_LAYERS
        for layer, fr in enumerate(e["frames"]):
            payload = data[start + fr["offset"]:start + fr["offset"] + fr["size"]]
            raw = kv(layer, e["start"], e["n_tokens"], dtype)
            assert_starts_as(payload, encoding)
            assert fr["raw_size"] == len(raw) and fr["xxh3"] == xxhash.xxh3_64_hexdigest(raw)
            assert spec_decode(payload, encoding, itemsize, man["token_bytes"]) == raw
            got = codec.unpack_frame(payload, len(raw), itemsize, man["token_bytes"], what="golden")
            assert got.tobytes() == raw


# -- import: the whole session -----------------------------------------------------------------------
@pytest.mark.parametrize("version, dtype", ARCHIVES)
def test_an_archive_of_every_version_imports_as_the_session_it_was(tmp_path, version, dtype):
    want = expected(version, dtype)
    store = kvstore.open_store(tmp_path / "home")
    name = store.import_(archive_path(version, dtype))
    assert name == f"golden-v{version}-{dtype}"
    assert store.tokens(name) == TOKENS
    assert [(m.ordinal, m.role, m.text, m.token_start, m.token_end) for m in store.messages(name)] == \
        [(i, *m) for i, m in enumerate(MESSAGES)]
    assert store.history(name) == [{"role": r, "text": t, "token_start": a, "token_end": b} for r, t, a, b in MESSAGES]
    info = store.info(name)
    assert (info.dtype, info.seed, info.sampler, info.chunk_size, info.checkpoint_every) == (dtype, SEED, SAMPLER, 8, 4)
    assert (info.n_tokens, info.n_cached, info.active_call) == (17, want["n_cached"], want["active_call"])
    assert info.weights == want["weights"]
    assert (info.model, info.model_source, info.parent) == (FINGERPRINT, SOURCE, None)
    itemsize = DTYPES[dtype]
    with store.db() as db:
        row = store.row(db, name)
        assert row.last_hidden == want["last_hidden"] and row.weights == want["weights"]
        assert row.kv_layout == {"order": "token-major", "n_layers": N_LAYERS, "per_token": [2, N_KV_HEADS, HEAD_DIM],
                                 "dtype": dtype}
        assert db.get(ModelRow, FINGERPRINT).config == CONFIG
        refs = session_extents(db, row.id)
    assert [(r.start, r.n_tokens) for r in refs] == want["extents"]
    for ref in refs:
        assert ref.token_bytes == ELEMENTS * itemsize
        layers = read_layers(ref, store.home, itemsize, session=name)
        assert [d.tobytes() for d in layers] == [kv(layer, ref.start, ref.n_tokens, dtype) for layer in range(N_LAYERS)]
    assert store.verify() == {name: []}
    store.close()


@pytest.mark.parametrize("version, dtype", ARCHIVES)
def test_an_imported_archive_exports_as_the_current_version_with_the_same_session(tmp_path, version, dtype):
    store = kvstore.open_store(tmp_path / "home")
    name = store.import_(archive_path(version, dtype))
    store.export(name, tmp_path / "again.kvs")
    (magic, v, flags, _, _), man, _ = split((tmp_path / "again.kvs").read_bytes())
    _, old, _ = split(archive_path(version, dtype).read_bytes())
    assert (magic, v, flags, man["version"]) == (MAGIC, archive.VERSION, 0, archive.VERSION)
    assert man["session"] == {**old["session"], "last_hidden": old["session"].get("last_hidden"),
                              "weights": expected(version, dtype)["weights"]}
    for key in ("model", "token_bytes", "tokens", "messages"):
        assert man[key] == old[key]
    def kv_plan(m: dict) -> list:  # offsets and sizes are the new compression's, the rest must not change
        return [(e["start"], e["n_tokens"], [(fr["raw_size"], fr["xxh3"]) for fr in e["frames"]]) for e in m["extents"]]

    assert kv_plan(man) == kv_plan(old)
    again = store.import_(tmp_path / "again.kvs", name="again")
    assert store.tokens(again) == TOKENS and store.verify() == {name: [], again: []}
    assert store.info(again).weights == expected(version, dtype)["weights"]
    store.close()


# -- packed blobs ---------------------------------------------------------------------------------------
def blob_entry(encoding: str, dtype: str) -> dict:
    index = json.loads((GOLDEN / "blobs.json").read_text())
    (entry,) = [e for e in index if (e["encoding"], e["dtype"]) == (encoding, dtype)]
    return entry


def blob_layers(entry: dict) -> list[bytes]:
    return [kv(layer, entry["start"], entry["n_tokens"], entry["dtype"]) for layer in range(N_LAYERS)]


@pytest.mark.parametrize("encoding, dtype", BLOBS)
def test_a_blob_of_every_encoding_unpacks_to_its_extent(tmp_path, encoding, dtype):
    entry = blob_entry(encoding, dtype)
    body = (GOLDEN / entry["file"]).read_bytes()
    layers, itemsize = blob_layers(entry), DTYPES[dtype]
    assert (entry["start"], entry["n_tokens"], entry["token_bytes"]) == (0, 8, ELEMENTS * itemsize)
    assert entry["hash"] == xxhash.xxh3_128_hexdigest(b"".join(layers))  # the name: content-addressed
    assert entry["hash"] == blobs.content_hash([np.frombuffer(d, np.uint8) for d in layers])
    assert entry["file_checksum"] == xxhash.xxh3_64_hexdigest(body) and entry["size"] == len(body)
    assert entry["checksums"] == [xxhash.xxh3_64_hexdigest(d) for d in layers]
    ends = [0] + [o + s for o, s in entry["frames"]]
    assert [o for o, _ in entry["frames"]] == ends[:-1] and ends[-1] == len(body)  # payloads back to back
    for (offset, size), raw in zip(entry["frames"], layers):
        assert_starts_as(body[offset:offset + size], encoding)
        assert spec_decode(body[offset:offset + size], encoding, itemsize, entry["token_bytes"]) == raw
    (tmp_path / "blobs").mkdir()
    shutil.copy(GOLDEN / entry["file"], blobs.blob_path(tmp_path / "blobs", entry["hash"]))
    got = blobs.unpack(tmp_path / "blobs", entry["hash"], entry["frames"], entry["file_checksum"], len(layers[0]),
                       itemsize, entry["token_bytes"], what="golden")
    assert [d.tobytes() for d in got] == layers


@pytest.mark.parametrize("encoding, dtype", BLOBS)
def test_a_store_reads_a_blob_an_older_kvstore_packed(tmp_path, encoding, dtype):
    """The blob is committed for the session's first extent (as if an earlier kvstore had packed a
    session with the same bytes); the pack reuses it as it is, and everything reads through it."""
    entry = blob_entry(encoding, dtype)
    store = kvstore.open_store(tmp_path / "home")
    name = store.import_(archive_path(4, dtype))
    store.blobs_dir.mkdir(exist_ok=True)
    shutil.copy(GOLDEN / entry["file"], blobs.blob_path(store.blobs_dir, entry["hash"]))
    with store.db() as db, db.begin():
        db.add(BlobRow(hash=entry["hash"], frames=entry["frames"], size=entry["size"],
                       file_checksum=entry["file_checksum"]))
    store.pack(name)
    with store.db() as db:
        row = store.row(db, name)
        refs = session_extents(db, row.id)
        assert db.get(ExtentBlobRow, refs[0].extent_id).blob_hash == entry["hash"]
        assert db.get(BlobRow, entry["hash"]).file_checksum == entry["file_checksum"]  # kept, not rewritten
    assert (GOLDEN / entry["file"]).read_bytes() == blobs.blob_path(store.blobs_dir, entry["hash"]).read_bytes()
    assert not list(store.session_dir(row.id).glob("layer-*.kv"))  # only the blobs hold the KV now
    for ref in refs:
        layers = read_layers(ref, store.home, DTYPES[dtype], session=name)
        assert [d.tobytes() for d in layers] == [kv(layer, ref.start, ref.n_tokens, dtype) for layer in range(N_LAYERS)]
    assert store.verify() == {name: []}
    store.export(name, tmp_path / "packed.kvs")
    again = store.import_(tmp_path / "packed.kvs", name="again")
    with store.db() as db:
        first = session_extents(db, store.row(db, again).id)[0]
    assert [d.tobytes() for d in read_layers(first, store.home, DTYPES[dtype], session=again)] == blob_layers(entry)
    store.close()


# -- the checks bite ------------------------------------------------------------------------------------
def changed(data: bytes, at: int, to: int | None = None) -> bytes:
    out = bytearray(data)
    out[at] = out[at] ^ 0x01 if to is None else to
    return bytes(out)


@pytest.mark.parametrize("version", VERSIONS)
def test_one_changed_byte_of_an_archive_is_refused_and_nothing_is_stored(tmp_path, version):
    data = archive_path(version, "bfloat16").read_bytes()
    _, man, start = split(data)
    payloads = [start + fr["offset"] + k for e in man["extents"] for fr in e["frames"] for k in (0, fr["size"] // 2,
                                                                                               fr["size"] - 1)]
    cases = [(changed(data, 1), UnsupportedFormat), (changed(data, 8, version + 10), UnsupportedFormat),
             (changed(data, 12), UnsupportedFormat), (changed(data, 16), CorruptData),
             (changed(data, 24), CorruptData), (changed(data, (32 + start) // 2), CorruptData),
             (changed(data, start - 1), CorruptData), *((changed(data, at), CorruptData) for at in payloads)]
    store = kvstore.open_store(tmp_path / "home")
    for i, (bad, error) in enumerate(cases):
        path = tmp_path / f"bad-{i}.kvs"
        path.write_bytes(bad)
        with pytest.raises(error):
            store.import_(path)
        assert store.names() == [] and list(store.sessions_dir.iterdir()) == []
    assert store.import_(archive_path(version, "bfloat16"))  # the file itself is sound
    store.close()


@pytest.mark.parametrize("encoding, dtype", BLOBS)
def test_every_changed_byte_of_a_blob_is_refused_or_changes_nothing(encoding, dtype):
    """The blob's file checksum refuses any change; past it (a damage it would not see), the payloads'
    own checks refuse every change that would alter a byte of KV: a flipped bit either fails zstd's
    frame checks or sits where the decoder never looks (padding of an entropy-coded stream)."""
    entry = blob_entry(encoding, dtype)
    body = (GOLDEN / entry["file"]).read_bytes()
    layers, itemsize = blob_layers(entry), DTYPES[dtype]
    refused = 0
    for at in range(len(body)):
        for bit in (0x01, 0x80):
            bad = bytearray(body)
            bad[at] ^= bit
            assert codec.checksum(bytes(bad)) != entry["file_checksum"]
            decoded = []
            try:
                for (offset, size), raw in zip(entry["frames"], layers):
                    decoded.append(codec.unpack_frame(bytes(bad[offset:offset + size]), len(raw), itemsize,
                                                      entry["token_bytes"], what="golden").tobytes())
            except CorruptData:
                refused += 1
                continue
            assert decoded == layers, f"byte {at} ^ {bit:#x} decodes to other KV bytes"
    assert refused >= 2 * len(body) - 8  # all but a handful of bits are checked, none is trusted blindly
