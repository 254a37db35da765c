"""The compressed layer payload (docs/FORMATS.md): a mark, then the elements' byte planes in token
order, one zstd frame each; exact round trip; both earlier encodings still read; damaged payloads
refused before anything is inflated past its expected size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from kvstore.store import codec
from kvstore.errors import CorruptData

TOKENS, ROW = 37, (2, 3, 8)  # token rows of [K/V, heads, head_dim]


def kv_bytes(dtype: torch.dtype, seed: int = 0) -> tuple[np.ndarray, int, int]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(TOKENS, *ROW, generator=g) * 3).to(dtype)
    raw = x.view(torch.uint8).numpy().reshape(-1).copy()
    return raw, x.element_size(), raw.size // TOKENS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_payload_inflates_to_exactly_the_bytes_packed(dtype):
    raw, itemsize, row_bytes = kv_bytes(dtype)
    payload = codec.pack_frame(raw, itemsize, row_bytes)
    assert np.array_equal(codec.unpack_frame(payload, raw.size, itemsize, row_bytes, what="t"), raw)


def test_each_byte_plane_is_its_own_frame_and_the_exponents_compress():
    raw, itemsize, row_bytes = kv_bytes(torch.bfloat16)
    payload = codec.pack_frame(raw, itemsize, row_bytes)
    assert payload[:4] == codec.PLANES_MARK
    (n_low,) = codec.LENGTH.unpack(payload[4:8])
    (n_high,) = codec.LENGTH.unpack(payload[8 + n_low:12 + n_low])
    assert 12 + n_low + n_high == len(payload)
    low = zstandard.ZstdDecompressor().decompress(payload[8:8 + n_low])
    assert low == raw[0::2].tobytes()  # every element's low byte, in token order
    assert n_high < raw.size // 2 * 0.6  # sign and exponent bytes of normal-ish values repeat a lot


def test_frames_carry_no_zstd_checksum_but_one_written_before_is_still_checked():
    """Every reader verifies an inflated layer against its xxh3-64, so the frames skip zstd's own
    (32-bit) checksum of the same bytes; frames packed with one still inflate, and a damaged one
    is refused by zstd."""
    raw, itemsize, row_bytes = kv_bytes(torch.bfloat16)
    payload = codec.pack_frame(raw, itemsize, row_bytes)
    (n_low,) = codec.LENGTH.unpack(payload[4:8])
    assert not zstandard.get_frame_parameters(payload[8:8 + n_low]).has_checksum
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    frames = [compressor.compress(plane.tobytes()) for plane in (raw[0::2], raw[1::2])]
    before = codec.PLANES_MARK + b"".join(codec.LENGTH.pack(len(f)) + f for f in frames)
    assert np.array_equal(codec.unpack_frame(before, raw.size, itemsize, row_bytes, what="t"), raw)
    damaged = bytearray(before)
    damaged[8 + len(frames[0]) - 1] ^= 0xFF  # the low plane's frame ends with its checksum
    with pytest.raises(CorruptData, match="damaged"):
        codec.unpack_frame(bytes(damaged), raw.size, itemsize, row_bytes, what="t")


def test_the_mark_is_no_length_a_channel_major_payload_can_start_with():
    (as_length,) = codec.LENGTH.unpack(codec.PLANES_MARK)
    assert as_length > 2**31 and codec.PLANES_MARK != codec.ZSTD_MAGIC


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_second_encoding_channel_major_planes_without_a_mark_is_still_read(dtype):
    raw, itemsize, row_bytes = kv_bytes(dtype)
    elems = raw.reshape(TOKENS, row_bytes // itemsize, itemsize)  # [T, channels, itemsize]
    planes = np.ascontiguousarray(elems.transpose(2, 1, 0)).reshape(itemsize, -1)  # channel-major
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    frames = [compressor.compress(plane.tobytes()) for plane in planes]
    v2 = b"".join(codec.LENGTH.pack(len(f)) + f for f in frames)
    assert np.array_equal(codec.unpack_frame(v2, raw.size, itemsize, row_bytes, what="t"), raw)


def forged(raw: np.ndarray, row_bytes: int, *, declare: int | None = None, tail: bytes = b"") -> bytes:
    payload = bytearray(codec.pack_frame(raw, 2, row_bytes))
    if declare is not None:  # replace the low plane's frame with one that declares another size
        (n_low,) = codec.LENGTH.unpack(payload[4:8])
        frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * declare)
        payload[4:8 + n_low] = codec.LENGTH.pack(len(frame)) + frame
    return bytes(payload) + tail


def grown(payload: bytes, extra: bytes) -> bytes:
    """The payload with `extra` bytes after the low plane's frame, inside that plane's length."""
    (n_low,) = codec.LENGTH.unpack(payload[4:8])
    frame = payload[8:8 + n_low] + extra
    return payload[:4] + codec.LENGTH.pack(len(frame)) + frame + payload[8 + n_low:]


def test_damaged_payloads_are_refused():
    raw, _, row_bytes = kv_bytes(torch.bfloat16)
    good = codec.pack_frame(raw, 2, row_bytes)
    cases = {
        "stray bytes": good + b"\0",
        "ends early": good[:-5],
        "no second plane": good[:8 + codec.LENGTH.unpack(good[4:8])[0]],
        "length past the end": codec.PLANES_MARK + codec.LENGTH.pack(len(good)) + good[8:],
        "a frame after the low plane's frame": grown(good, zstandard.ZstdCompressor().compress(b"x")),
        "junk after the low plane's frame": grown(good, b"junk"),
        "declares more": forged(raw, row_bytes, declare=1 << 30),
        "declares less": forged(raw, row_bytes, declare=raw.size // 2 - 2),
    }
    for why, payload in cases.items():
        with pytest.raises(CorruptData):
            codec.unpack_frame(payload, raw.size, 2, row_bytes, what=why)
    with pytest.raises(CorruptData, match="whole token rows"):
        codec.unpack_frame(good, raw.size - 1, 2, row_bytes, what="odd size")


def test_a_checksum_taken_piece_by_piece_is_the_checksum_of_the_whole():
    raw, _, _ = kv_bytes(torch.bfloat16)
    hasher = codec.checksummer()
    for start in range(0, raw.size, 100):
        hasher.update(raw[start:start + 100])
    assert hasher.hexdigest() == codec.checksum(raw)
