"""Bytes <-> checksums and compressed layer payloads.

- `checksum(buf)`: xxh3-64 as 16 hex digits; what the index stores per layer of each extent.
- `pack_frame(buf, itemsize, row_bytes)` / `unpack_frame`: one layer's KV bytes (token rows of
  `row_bytes`) <-> its compressed payload: `PLANES_MARK`, then the elements' byte planes in token
  order (every element's lowest byte, then the next byte, ...), each plane one zstd frame (content
  size in its header) preceded by its length as a u32 little-endian. Exponent planes compress well
  and mantissa planes hardly at all: separate frames let zstd store the latter raw, so inflating is
  mostly copies, and merging the planes back is one pass over the output.
- The frames carry no zstd checksum: every reader verifies the inflated layer against its xxh3-64
  (the index's, or the archive manifest's), a stronger check of the same bytes; zstd's 32-bit one
  was a second pass over them (without it, and with one decompressor per thread, a packed 2,048-
  token session opens on one thread in 40.5 ms instead of 45.5; AMD EPYC Zen 4). Frames written
  with one (blobs and archives packed before) are still checked by zstd as well.
- Two earlier encodings are still read: the same planes taken channel-major, without the mark
  (archive format 2 and the blobs packed in that time), and one zstd frame of the token-major bytes
  byte-shuffled (archive format 1, the first blobs); each starts differently (docs/FORMATS.md).
- `unpack_frame` never allocates more than the caller's expected size: a frame whose header
  declares another size, or that inflates past it, is refused (`CorruptData`).
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import xxhash
import zstandard

from ..errors import CorruptData

ZSTD_LEVEL = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LENGTH = struct.Struct("<I")  # each plane frame's length, before it
# starts a token-major payload; read as a u32 LE it is above 2**31, a length no frame of the
# channel-major encoding (which starts with one) can have: a layer of an extent is far smaller
PLANES_MARK = b"KVP\x83"
UINT = {2: np.uint16, 4: np.uint32}  # element sizes the byte planes are split and merged as
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes per element of each KV dtype the store keeps


def checksum(buf) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))


def checksummer():
    """`checksum` piece by piece: `update(piece)` in order, then `hexdigest()` equals checksum(whole)."""
    return xxhash.xxh3_64()


def _planes(buf, itemsize: int) -> np.ndarray:
    """Token-major bytes -> `[itemsize, n_elements]` byte planes, lowest byte first."""
    if itemsize not in UINT:
        return np.ascontiguousarray(np.frombuffer(buf, np.uint8).reshape(-1, itemsize).T)
    elems = np.frombuffer(buf, UINT[itemsize])
    planes = np.empty((itemsize, elems.size), np.uint8)
    for k in range(itemsize):  # whole elements shifted: much faster than a byte transpose
        np.copyto(planes[k], elems >> (8 * k) if k else elems, casting="unsafe")
    return planes


def _merge(planes: list[np.ndarray], itemsize: int, out: np.ndarray) -> np.ndarray:
    """The inverse of `_planes`, written into `out`: the top plane widened, then each lower one or-ed
    in under it."""
    if itemsize not in UINT:
        np.copyto(out.reshape(-1, itemsize), np.stack(planes).T)
        return out
    elems = out.view(UINT[itemsize])
    np.left_shift(planes[-1], 8 * (itemsize - 1), out=elems, dtype=elems.dtype)
    for k in range(itemsize - 2, -1, -1):
        elems |= np.left_shift(planes[k], 8 * k, dtype=elems.dtype) if k else planes[k]
    return out


def _unplanes_channel_major(planes: list[np.ndarray], itemsize: int, row_bytes: int, out: np.ndarray) -> np.ndarray:
    """The second encoding's planes (of the channel-major elements) -> the token-major bytes in `out`."""
    channels = row_bytes // itemsize
    stacked = np.stack(planes).reshape(itemsize, channels, -1)  # [itemsize, channels, T]
    np.copyto(out.reshape(-1, channels, itemsize), stacked.transpose(2, 1, 0))
    return out


def pack_frame(buf, itemsize: int, row_bytes: int, level: int = ZSTD_LEVEL) -> bytes:
    if len(buf) % row_bytes or row_bytes % itemsize:
        raise ValueError(f"{len(buf)} bytes are not whole token rows of {row_bytes} bytes")
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    out = [PLANES_MARK]
    for plane in _planes(buf, itemsize):
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
    token_major = payload[:4] == PLANES_MARK
    planes = _inflate_planes(payload, len(PLANES_MARK) if token_major else 0, itemsize, raw_size // itemsize, what)
    if token_major:
        return _merge(planes, itemsize, out)
    return _unplanes_channel_major(planes, itemsize, row_bytes, out)


def _inflate_planes(payload: memoryview, at: int, n_planes: int, plane_size: int, what: str) -> list[np.ndarray]:
    """The n_planes length-prefixed plane frames from `at` on, each inflated to plane_size bytes."""
    planes = []
    for k in range(n_planes):
        if at + LENGTH.size > len(payload):
            raise CorruptData(f"{what}: the payload ends before byte plane {k}")
        (n,) = LENGTH.unpack(payload[at:at + LENGTH.size])
        at += LENGTH.size
        if at + n > len(payload):
            raise CorruptData(f"{what}: byte plane {k} runs past the end of the payload")
        planes.append(_inflate(payload[at:at + n], plane_size, what=f"{what}, byte plane {k}"))
        at += n
    if at != len(payload):
        raise CorruptData(f"{what}: {len(payload) - at} stray bytes after the last byte plane")
    return planes


def _unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """The first encoding's byte planes `[itemsize, n]` over token-major elements (uint8, as `_inflate`
    returns them) -> the bytes."""
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1)


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (one may not serve two threads at once; making one per frame cost
    12 µs, 15 ms for the 1,200 frames of a packed 2,048-token session under cProfile)."""
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _inflate(frame, size: int, *, what: str) -> np.ndarray:
    """One zstd frame that must inflate to exactly `size` bytes, as a uint8 array (read only); refused
    before inflating when its header declares another size, and never written past `size` bytes (a
    bomb cannot exhaust memory). A frame whose header declares `size` inflates in one call (zstd
    refuses one that holds more); one without a declared size, or that the call refuses, is read
    into a new array, bounded, which says what is wrong."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: not a zstd frame ({e})") from e
    if declared not in (-1, size):  # -1: size not in the header; the bounded read below applies
        raise CorruptData(f"{what}: frame declares {declared} bytes, expected {size}; refusing to inflate it")
    if declared == size:  # the one-shot call: zstd allocates the declared size and fails past it
        try:
            data = _decompressor().decompress(frame, allow_extra_data=False)
        except zstandard.ZstdError:
            pass  # the bounded read below gives the verdict, and says what is wrong
        else:
            if len(data) == size:
                return np.frombuffer(data, np.uint8)
    out = np.empty(size, np.uint8)
    view, got = memoryview(out), 0
    try:  # across frames: bytes after the frame must be nothing, or a frame inflating to nothing
        with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=True) as reader:
            while got < size and (n := reader.readinto(view[got:])):
                got += n
            extra = reader.read(1)  # also lets zstd reach the frame's end and check its checksum
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: compressed data is damaged ({e})") from e
    if extra:
        raise CorruptData(f"{what}: frame inflates past the expected {size} bytes")
    if got != size:
        raise CorruptData(f"{what}: frame holds {got} bytes, expected {size}")
    return out
