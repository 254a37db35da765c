"""Bytes <-> checksums and compressed layer payloads.

- `checksum(buf)`: xxh3-64 as 16 hex digits; what the index stores per layer of each extent.
- `pack_frame(buf, itemsize, row_bytes)` / `unpack_frame`: one layer's KV bytes (token rows of
  `row_bytes`) <-> its compressed payload. The payload: the elements transposed channel-major
  (each K/V channel's series over the tokens), split into byte planes (all lowest bytes, then the
  next, ...), each plane one zstd frame (content size and zstd's checksum in its header) preceded
  by its length as a u32 little-endian. Exponent planes compress well and mantissa planes hardly
  at all: separate frames let zstd store the latter raw, and decompression is then mostly copies.
- A payload that is a single zstd frame of the token-major bytes byte-shuffled is the first
  encoding (archives of format version 1, blobs written before); it is still read.
- `unpack_frame` never allocates more than the caller's expected size: a frame whose header
  declares another size, or that inflates past it, is refused (`CorruptData`).
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash
import zstandard

from .errors import CorruptData

ZSTD_LEVEL = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LENGTH = struct.Struct("<I")  # each plane frame's length, before it
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes per element of each KV dtype the store keeps


def checksum(buf) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))


def _planes(buf, itemsize: int, row_bytes: int) -> np.ndarray:
    """Token rows -> `[itemsize, channels * n_tokens]` byte planes of the channel-major elements."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if itemsize == 2:  # split as uint16: much faster than a byte transpose
        elems = np.ascontiguousarray(raw.view(np.uint16).reshape(-1, row_bytes // 2).T)  # [channels, T]
        planes = np.empty((2, elems.size), np.uint8)
        np.copyto(planes[0], elems.reshape(-1), casting="unsafe")  # the low bytes
        elems >>= 8
        np.copyto(planes[1], elems.reshape(-1), casting="unsafe")
        return planes
    rows = raw.reshape(-1, row_bytes // itemsize, itemsize)  # [T, channels, itemsize]
    return np.ascontiguousarray(rows.transpose(2, 1, 0)).reshape(itemsize, -1)  # [itemsize, channels * T]


def _unplanes(planes: list[np.ndarray], itemsize: int, row_bytes: int, out: np.ndarray) -> np.ndarray:
    """The inverse of `_planes`, written into `out` (the token-major bytes). Byte pairs merge as uint16."""
    channels = row_bytes // itemsize
    if itemsize == 2:
        elems = planes[1].astype(np.uint16)
        elems <<= 8
        elems |= planes[0]  # [channels * T] uint16, channel-major
        np.copyto(out.view(np.uint16).reshape(-1, channels), elems.reshape(channels, -1).T)
        return out
    stacked = np.stack(planes).reshape(itemsize, channels, -1)  # [itemsize, channels, T]
    np.copyto(out.reshape(-1, channels, itemsize), stacked.transpose(2, 1, 0))
    return out


def pack_frame(buf, itemsize: int, row_bytes: int, level: int = ZSTD_LEVEL) -> bytes:
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    out = []
    for plane in _planes(buf, itemsize, row_bytes):
        frame = compressor.compress(plane)  # a contiguous row: no copy
        out += [LENGTH.pack(len(frame)), frame]
    return b"".join(out)


def unpack_frame(payload, raw_size: int, itemsize: int, row_bytes: int, *, what: str,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Decompress one layer's payload that must hold exactly raw_size bytes: the raw bytes, written
    into `out` (a writable uint8 array of raw_size bytes, e.g. a cache's rows) when given."""
    payload = memoryview(payload)
    out = np.empty(raw_size, np.uint8) if out is None else out
    if payload[:4] == ZSTD_MAGIC:
        out[:] = _unshuffle(_inflate(payload, raw_size, what=what), itemsize)
        return out
    if raw_size % row_bytes or row_bytes % itemsize:
        raise CorruptData(f"{what}: {raw_size} bytes are not whole token rows of {row_bytes} bytes")
    plane_size, planes, at = raw_size // itemsize, [], 0
    for k in range(itemsize):
        if at + LENGTH.size > len(payload):
            raise CorruptData(f"{what}: the payload ends before byte plane {k}")
        (n,) = LENGTH.unpack(payload[at:at + LENGTH.size])
        at += LENGTH.size
        if at + n > len(payload):
            raise CorruptData(f"{what}: byte plane {k} runs past the end of the payload")
        planes.append(np.frombuffer(_inflate(payload[at:at + n], plane_size, what=f"{what}, byte plane {k}"), np.uint8))
        at += n
    if at != len(payload):
        raise CorruptData(f"{what}: {len(payload) - at} stray bytes after the last byte plane")
    return _unplanes(planes, itemsize, row_bytes, out)


def _unshuffle(raw: bytes, itemsize: int) -> np.ndarray:
    """The first encoding's byte planes `[itemsize, n]` over token-major elements -> the bytes."""
    planes = np.frombuffer(raw, dtype=np.uint8)
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1)


def _inflate(frame, size: int, *, what: str) -> bytes:
    """One zstd frame that must inflate to exactly `size` bytes, refused before allocating otherwise."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: not a zstd frame ({e})") from e
    if declared not in (-1, size):  # -1: size not in the header; the stream limit below applies
        raise CorruptData(f"{what}: frame declares {declared} bytes, expected {size}; refusing to inflate it")
    try:  # with the size declared, one call into a buffer of exactly that size; else a bounded stream
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size, allow_extra_data=False) \
            if declared == size else _bounded_decompress(frame, size)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: compressed data is damaged ({e})") from e
    if len(out) != size:
        raise CorruptData(f"{what}: frame holds {len(out)} bytes, expected {size}")
    return out


def _bounded_decompress(frame: bytes, limit: int) -> bytes:
    """Inflate at most limit + 1 bytes, so a bomb cannot exhaust memory."""
    reader = zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False)
    with reader:
        out = reader.read(limit + 1)
        if len(out) > limit:
            raise CorruptData(f"frame inflates past the expected {limit} bytes")
        return out


def parallel_map(fn, items: Sequence, threads: int = 4) -> list:
    """Map over items with threads (zstd and xxhash release the GIL)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(fn, items))
