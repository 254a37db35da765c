"""Write the golden fixtures beside this file: an archive of every format version kvstore reads and a
packed blob in every payload encoding, as each kvstore that wrote them did. tests/test_golden_formats.py
decodes them and checks every KV byte, token id, message and setting against the formulas below.

When to run it: ONLY when a NEW format is added (an archive version, a payload encoding): add its
writer here, run `python tests/golden/make_golden.py` from the repository root, commit the new
files and add their expectations to tests/test_golden_formats.py. It writes only the files that are
not there yet (and adds their entries to blobs.json): the committed ones are never rewritten, and
`git diff --stat tests/golden` after a run shows new files only. NEVER run it to make a failing
golden test pass: a failure means kvstore no longer reads what an earlier kvstore wrote (or writes
what it used to), and the fix belongs in the reader, or in a new format version. The committed
files are the fixtures, not this script's output of the day: zstd may compress the same bytes
differently in another release, so a rerun can change the files' bytes (never what they decode to),
and the tests only ever decode the committed bytes, never compare them with a fresh compression.

This script imports nothing from kvstore: its writers follow docs/FORMATS.md (and our own history
of kvstore/codec.py and kvstore/archive.py), so a change to a constant or a layout in the package
cannot leak into the fixtures. It is deterministic: same numpy, zstandard and xxhash, same bytes.

The synthetic session (no weights exist; the archives import without a model):
- model: llama config, 2 layers, 4 heads over 2 KV heads of head_dim 8, hidden_size 32, vocab 1000;
- 17 tokens, `TOKEN(i) = (37 * i + 11) % 1000`; three chat messages (system, user, assistant) with
  non-ASCII text (accents, CJK, an emoji outside the BMP) covering every token;
- KV bytes of layer l, token t, element c (of `2 * n_kv_heads * head_dim`, K then V, head by head):
  `kv_element` below, as a little-endian bfloat16 or float32 bit pattern: a high byte of sign and
  exponent from a few values (compressible, like real KV), the lower byte(s) a hash (incompressible);
- archive versions 1-3 (before contract C2's amendment): 16 of the 17 tokens cached, the last one
  pending, extents [0, 8) [8, 12) [12, 16), no `last_hidden` field;
- archive version 4: every token cached, extents [0, 8) [8, 16) [16, 17), `last_hidden` =
  `hidden_bytes` below in hex, and a chat generation in progress (`active_call`) for the reply;
- archive version 5: version 4's session with `weights` = "stored" (the model's GGUF blocks kept as
  stored; every earlier session was "dense", which those versions do not write);
- blobs: the extent [0, 8) of every layer, in each payload encoding; `blobs.json` holds what the
  index keeps of each (its name, per-layer [offset, size], file checksum, per-layer checksums).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import xxhash
import zstandard

HERE = Path(__file__).resolve().parent

# -- the synthetic session ---------------------------------------------------------------------------
N_LAYERS, N_KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 2, 8, 32, 1000
ELEMENTS = 2 * N_KV_HEADS * HEAD_DIM  # per token and layer
ITEMSIZE = {"bfloat16": 2, "float32": 4}
N_TOKENS = 17
TOKENS = [(37 * i + 11) % VOCAB for i in range(N_TOKENS)]
CONFIG = {"arch": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "n_layers": N_LAYERS, "n_heads": 4,
          "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 64, "norm_eps": 1e-05,
          "max_context": 64, "rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": False,
          "qkv_bias": False, "o_bias": False, "mlp_bias": False, "variant": ""}
MODEL = {"fingerprint": xxhash.xxh3_128_hexdigest(b"kvstore golden synthetic model"), "arch": "llama",
         "config": CONFIG, "source": "golden-synthetic-model (no weights)"}
SAMPLER = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
           "repetition_window": 64}
SEED = -1234567890123  # signed, beyond 32 bits
MESSAGES = [
    {"ordinal": 0, "role": "system", "text": "Réponds brièvement, s'il te plaît.", "token_start": 0, "token_end": 5},
    {"ordinal": 1, "role": "user", "text": "Grüße! 日本語で答えて 🙂", "token_start": 5, "token_end": 11},
    {"ordinal": 2, "role": "assistant", "text": "はい — ça va ✓", "token_start": 11, "token_end": 17},
]
ACTIVE_CALL_V4 = {"kind": "chat", "start": 11, "max_new_tokens": 32, "stop": [], "message": 2}
WEIGHTS_V5 = "stored"  # how the model held its weights (version 5 on); not the default, so the field counts
EXTENTS = {"pending": [(0, 8), (8, 4), (12, 4)], "all": [(0, 8), (8, 8), (16, 1)]}  # (start, n_tokens)

MAGIC = b"\x89KVS\r\n\x1a\n"
HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, manifest length, manifest xxh3-64
PLANES_MARK = b"KVP\x83"
LENGTH = struct.Struct("<I")


def kv_element(layer: np.ndarray, token: np.ndarray, element: np.ndarray, itemsize: int) -> np.ndarray:
    """The bit pattern of one KV element (broadcasting over arrays), as uint16 or uint32."""
    t, c = token.astype(np.uint64), element.astype(np.uint64)
    x = (t * 0x9E3779B1 + c * 0x85EBCA77 + (np.uint64(layer) + 1) * 0xC2B2AE3D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    top = (0x3C + (t + c) % 8) | ((c % 3 == 0).astype(np.uint64) << 7)  # sign and exponent byte
    if itemsize == 2:
        return ((top << 8) | (x & 0xFF)).astype(np.uint16)
    return ((top << 24) | (x & 0xFFFFFF)).astype(np.uint32)


def kv_bytes(layer: int, start: int, n_tokens: int, dtype: str) -> bytes:
    """Token-major raw bytes of one layer for tokens [start, start + n_tokens)."""
    itemsize = ITEMSIZE[dtype]
    t = np.arange(start, start + n_tokens)[:, None]
    c = np.arange(ELEMENTS)[None, :]
    return kv_element(np.uint64(layer), t, c, itemsize).astype(f"<u{itemsize}").tobytes()


def hidden_bytes(dtype: str) -> bytes:
    """The last token's final hidden state of the version-4 archives: hidden_size elements."""
    return bytes((73 * i + 5) % 256 for i in range(HIDDEN * ITEMSIZE[dtype]))


# -- the three payload encodings (docs/FORMATS.md, "Compressed layer payload") ----------------------
def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(data)


def _token_planes(raw: bytes, itemsize: int) -> np.ndarray:
    """[itemsize, n_elements]: every element's lowest byte in token order, then the next byte, ..."""
    return np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T)


def encode_shuffled(raw: bytes, itemsize: int, row_bytes: int) -> bytes:
    """Encoding 1 (archive format 1, the first blobs): one zstd frame of the token-order planes."""
    return _zstd(_token_planes(raw, itemsize).tobytes())


def encode_channel_major(raw: bytes, itemsize: int, row_bytes: int) -> bytes:
    """Encoding 2 (archive format 2, blobs of that time): the planes of the elements taken channel-major
    (element j of every token, then element j + 1, ...), each a length-prefixed zstd frame, no mark."""
    rows = np.frombuffer(raw, np.uint8).reshape(-1, row_bytes // itemsize, itemsize)  # [T, channels, itemsize]
    planes = np.ascontiguousarray(rows.transpose(2, 1, 0)).reshape(itemsize, -1)
    return b"".join(LENGTH.pack(len(f)) + f for f in map(_zstd, (p.tobytes() for p in planes)))


def encode_planes(raw: bytes, itemsize: int, row_bytes: int) -> bytes:
    """Encoding 3 (archive formats 3 to 5, current blobs): the mark, then the token-order planes, each
    a length-prefixed zstd frame."""
    frames = [_zstd(p.tobytes()) for p in _token_planes(raw, itemsize)]
    return PLANES_MARK + b"".join(LENGTH.pack(len(f)) + f for f in frames)


ENCODINGS = {"shuffled": encode_shuffled, "channel-major": encode_channel_major, "planes": encode_planes}
ARCHIVE_ENCODING = {1: "shuffled", 2: "channel-major", 3: "planes", 4: "planes", 5: "planes"}


# -- archives (docs/FORMATS.md, "The archive") -------------------------------------------------------
def write_archive(path: Path, version: int, dtype: str) -> None:
    """As kvstore's exporter of `version` wrote it: versions 1 and 2 a manifest of exactly its length;
    3 (from its streaming exporter on) to 5 a manifest padded with spaces to the room reserved for it.
    Version 4's bfloat16 archive spells its text in raw UTF-8 (the format allows it); the others in
    JSON's ASCII escapes, as kvstore writes them (the emoji as a surrogate pair)."""
    itemsize, token_bytes = ITEMSIZE[dtype], ELEMENTS * ITEMSIZE[dtype]
    encode = ENCODINGS[ARCHIVE_ENCODING[version]]
    cached = "all" if version >= 4 else "pending"
    data, extents = [], []
    for start, n in EXTENTS[cached]:
        frames = []
        for layer in range(N_LAYERS):
            raw = kv_bytes(layer, start, n, dtype)
            payload = encode(raw, itemsize, token_bytes)
            frames.append({"offset": sum(map(len, data)), "size": len(payload), "raw_size": len(raw),
                           "xxh3": xxhash.xxh3_64_hexdigest(raw)})
            data.append(payload)
        extents.append({"start": start, "n_tokens": n, "frames": frames})
    session = {"name": f"golden-v{version}-{dtype}", "seed": SEED, "sampler": SAMPLER, "chunk_size": 8,
               "checkpoint_every": 4, "dtype": dtype,
               "kv_layout": {"order": "token-major", "n_layers": N_LAYERS, "per_token": [2, N_KV_HEADS, HEAD_DIM],
                             "dtype": dtype},
               "active_call": ACTIVE_CALL_V4 if version >= 4 else None,
               "n_tokens": N_TOKENS, "n_cached": sum(n for _, n in EXTENTS[cached])}
    if version >= 4:
        session["last_hidden"] = hidden_bytes(dtype).hex()
    if version >= 5:
        session["weights"] = WEIGHTS_V5
    manifest = {"format": "kvstore-archive", "version": version, "session": session, "model": MODEL,
                "token_bytes": token_bytes, "tokens": TOKENS, "messages": MESSAGES, "extents": extents,
                "data_size": sum(map(len, data))}
    body = json.dumps(manifest, separators=(",", ":"), ensure_ascii=(version, dtype) != (4, "bfloat16")).encode()
    if version >= 3:
        body += b" " * (64 - len(body) % 64 + 40)  # room left unused: trailing JSON whitespace
    header = HEADER.pack(MAGIC, version, 0, len(body), xxhash.xxh3_64_intdigest(body))
    path.write_bytes(header + body + b"".join(data))


# -- packed blobs (docs/FORMATS.md, "The store": blobs/<xxh3-128>.kvz) --------------------------------
def write_blob(path: Path, encoding: str, dtype: str) -> dict:
    """The extent [0, 8) of every layer, one payload per layer in `encoding`, back to back; returns
    what the index keeps of it."""
    itemsize, token_bytes, start, n = ITEMSIZE[dtype], ELEMENTS * ITEMSIZE[dtype], 0, 8
    layers = [kv_bytes(layer, start, n, dtype) for layer in range(N_LAYERS)]
    payloads = [ENCODINGS[encoding](raw, itemsize, token_bytes) for raw in layers]
    frames, offset = [], 0
    for p in payloads:
        frames.append([offset, len(p)])
        offset += len(p)
    body = b"".join(payloads)
    path.write_bytes(body)
    return {"file": path.name, "encoding": encoding, "dtype": dtype, "start": start, "n_tokens": n,
            "token_bytes": token_bytes, "hash": xxhash.xxh3_128_hexdigest(b"".join(layers)),
            "frames": frames, "size": len(body), "file_checksum": xxhash.xxh3_64_hexdigest(body),
            "checksums": [xxhash.xxh3_64_hexdigest(raw) for raw in layers]}


def main() -> None:
    """Write every fixture that is missing; leave the committed ones as they are."""
    written = []
    for version in ARCHIVE_ENCODING:
        for dtype in ITEMSIZE:
            path = HERE / f"v{version}-{dtype}.kvs"
            if not path.exists():
                write_archive(path, version, dtype)
                written.append(path.name)
    index_path = HERE / "blobs.json"
    known = {e["file"]: e for e in json.loads(index_path.read_text())} if index_path.exists() else {}
    index = []
    for encoding in ENCODINGS:
        for dtype in ITEMSIZE:
            path = HERE / f"blob-{encoding}-{dtype}.kvz"
            if path.name in known and path.exists():
                index.append(known[path.name])
            else:
                index.append(write_blob(path, encoding, dtype))
                written.append(path.name)
    if index != list(known.values()):
        index_path.write_text(json.dumps(index, indent=1) + "\n")
        written.append(index_path.name)
    print(f"wrote {', '.join(written) or 'nothing (every fixture is there)'} into {HERE}")


if __name__ == "__main__":
    main()
