"""Packed extents: `blobs/<hash>.kvz`, one compressed payload per layer (`codec`), content-addressed.

The name is the xxh3-128 of the extent's raw bytes (all layers in order), so identical extents,
forks' shared ones first of all, are stored once. A pack holds `hold(shared=True)` from the first
blob it writes or reuses until its commit, so gc cannot delete one in between. The index keeps
each payload's [offset, size] and a checksum of the whole file; the raw bytes are checked against
the extent's per-layer checksums after inflating (the zstd frames of blobs packed before
2026-12-03 carry zstd's own content checksum too, which zstd checks as well). An open reads a
payload at a time (`open_blob`, `read_payload`) and checks its layer's checksum; `unpack` (verify,
export, a fork's partial extent, a CUDA cache) checks the whole file's checksum first too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..engine.buffers import BufferPool
from ..errors import CorruptData
from ..fileio import io, reraise_full, write_durable
from . import codec
from .workers import parallel_map


@dataclass
class Packed:
    hash: str
    frames: list[list[int]]
    size: int
    file_checksum: str


LOCK = ".blobs.lock"  # in the home


def hold(home: Path, *, shared: bool) -> int | None:
    """The flock that keeps gc from deleting blobs a pack is writing and committing: packs share it
    (waiting for a running gc), gc takes it alone and returns None when a pack holds it."""
    try:
        return io.lock(home / LOCK, shared=shared, wait=shared)
    except BlockingIOError:
        return None
    except OSError as e:
        if not shared:  # a gc on a full disk still frees what it can, blobs aside
            return None
        reraise_full(e, "locking the blobs for a pack")


def blob_path(blobs_dir: Path, digest: str) -> Path:
    return blobs_dir / f"{digest}.kvz"


def content_hash(layers: list[np.ndarray]) -> str:
    h = xxhash.xxh3_128()
    for d in layers:
        h.update(memoryview(d).cast("B"))
    return h.hexdigest()


def pack(blobs_dir: Path, layers: list[np.ndarray], itemsize: int, row_bytes: int, digest: str | None = None) -> Packed:
    """Write the blob for one extent's per-layer raw bytes. A file already there under that name
    (left by a killed pack, perhaps in an older encoding) is kept only if it is byte-identical."""
    digest = digest or content_hash(layers)
    frames = parallel_map(lambda d: codec.pack_frame(d, itemsize, row_bytes), layers)
    table, offset = [], 0
    for f in frames:
        table.append([offset, len(f)])
        offset += len(f)
    body = b"".join(frames)
    file_checksum = codec.checksum(body)
    path = blob_path(blobs_dir, digest)
    if not io.exists(path) or codec.checksum(io.read_file(path)) != file_checksum:
        try:
            io.mkdir(blobs_dir)
        except OSError as e:
            reraise_full(e, f"creating {blobs_dir.name}/")
        write_durable(path, body)
    return Packed(digest, table, len(body), file_checksum)


READ_PIECE = 1 << 20  # bytes of a blob read and hashed at a time


def read_body(blobs_dir: Path, digest: str, file_checksum: str, *, what: str) -> memoryview:
    """A blob's bytes, its file checksum verified (layers are sliced from it without copies)."""
    fd = open_blob(blobs_dir, digest, what=what)
    try:
        size = io.size(fd)
        body, hasher, at = memoryview(bytearray(size)), codec.checksummer(), 0
        while at < size:  # hashed piece by piece as it is read, while each piece is in the CPU's cache
            n = io.pread_into(fd, body[at:at + READ_PIECE], at)
            if n == 0:
                break
            hasher.update(body[at:at + n])
            at += n
        body = body[:at]
    finally:
        io.close(fd)
    if hasher.hexdigest() != file_checksum:
        raise CorruptData(f"{what}: blob {blob_path(blobs_dir, digest).name} fails its checksum; the file was damaged")
    return body


def open_blob(blobs_dir: Path, digest: str, *, what: str) -> int:
    """A blob's file, open for reading (`read_payload`); CorruptData when it is missing."""
    path = blob_path(blobs_dir, digest)
    try:
        return io.open_read(path)
    except FileNotFoundError:
        raise CorruptData(f"{what}: blob {path.name} is missing; the session cannot be restored") from None


def read_payload(fd: int, frames: list[list[int]], layer: int, into: np.ndarray, *, what: str) -> memoryview:
    """One layer's payload of an open blob, read into `into` (a uint8 array at least that long):
    the way an open reads a packed extent, a layer at a time into memory that stays in the CPU's
    cache while it inflates. The file checksum is not computed here: each payload's zstd frame
    checks and its layer's checksum of the raw bytes, which the caller verifies, refuse every change
    that would alter a byte of KV (`verify` checks the file checksum as well). CorruptData when the
    file ends before the payload."""
    offset, size = frames[layer]
    view = memoryview(into).cast("B")[:size]
    if io.pread_into(fd, view, offset) != size:
        raise CorruptData(f"{what}: the blob ends before layer {layer}'s payload; the file was truncated")
    return view


PAYLOADS = BufferPool(limit=16 << 20, new=lambda n: np.empty(n, np.uint8))  # where `read_payload` reads to


def layer_payload(body: memoryview, frames: list[list[int]], layer: int) -> memoryview:
    offset, size = frames[layer]
    return body[offset:offset + size]


def unpack(blobs_dir: Path, digest: str, frames: list[list[int]], file_checksum: str, raw_size: int,
           itemsize: int, row_bytes: int, *, what: str) -> list[np.ndarray]:
    """Per-layer raw bytes of a packed extent (checksums of the file and of each frame verified)."""
    body = read_body(blobs_dir, digest, file_checksum, what=what)
    name = blob_path(blobs_dir, digest).name
    return parallel_map(
        lambda i: codec.unpack_frame(layer_payload(body, frames, i), raw_size, itemsize, row_bytes,
                                     what=f"{what}, blob {name}, layer {i}"),
        list(range(len(frames))))
