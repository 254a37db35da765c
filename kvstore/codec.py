"""Bytes <-> checksums and compressed frames.

- `checksum(buf)`: xxh3-64 as 16 hex digits; what the index stores per layer of each extent.
- `shuffle(buf, itemsize)` splits each element's bytes into planes (all first bytes, then all
  second bytes, ...): KV values' exponent bytes repeat a lot, so zstd compresses planes better.
- `pack_frame` / `unpack_frame`: shuffle + zstd (with zstd's own content checksum) and back.
  `unpack_frame` never allocates more than the caller's expected size: a frame whose header
  declares another size, or that inflates past it, is refused (`CorruptData`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash
import zstandard

from .errors import CorruptData

ZSTD_LEVEL = 1


def checksum(buf) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))


def shuffle(buf, itemsize: int) -> np.ndarray:
    """[n * itemsize] bytes -> itemsize planes of n bytes each (a new contiguous array)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if itemsize == 1:
        return raw.copy()
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T)  # [itemsize, n]


def unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1)


def pack_frame(buf, itemsize: int, level: int = ZSTD_LEVEL) -> bytes:
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return compressor.compress(shuffle(buf, itemsize).tobytes())


def unpack_frame(frame: bytes, raw_size: int, itemsize: int, *, what: str) -> np.ndarray:
    """Decompress a frame that must hold exactly raw_size bytes; the raw (unshuffled) bytes."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: not a zstd frame ({e})") from e
    if declared not in (-1, raw_size):  # -1: size not in the header; the stream limit below applies
        raise CorruptData(f"{what}: frame declares {declared} bytes, expected {raw_size}; refusing to inflate it")
    try:
        out = _bounded_decompress(frame, raw_size)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: compressed data is damaged ({e})") from e
    if len(out) != raw_size:
        raise CorruptData(f"{what}: frame holds {len(out)} bytes, expected {raw_size}")
    return unshuffle(np.frombuffer(out, dtype=np.uint8), itemsize)


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
