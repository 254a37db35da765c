"""The compressed layer payload (docs/FORMATS.md): byte planes of the channel-major elements, one
zstd frame each, exact round trip, the first encoding still read, damaged payloads refused before
anything is inflated past its expected size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from kvstore import codec
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
    (n_low,) = codec.LENGTH.unpack(payload[:4])
    (n_high,) = codec.LENGTH.unpack(payload[4 + n_low:8 + n_low])
    assert 8 + n_low + n_high == len(payload)
    assert zstandard.frame_content_size(payload[4:4 + n_low]) == raw.size // 2
    assert n_high < raw.size // 2 * 0.6  # sign and exponent bytes of normal-ish values repeat a lot


def test_the_first_encoding_one_shuffled_frame_is_still_read():
    raw, itemsize, row_bytes = kv_bytes(torch.bfloat16)
    shuffled = np.ascontiguousarray(raw.reshape(-1, itemsize).T).tobytes()
    legacy = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(shuffled)
    assert np.array_equal(codec.unpack_frame(legacy, raw.size, itemsize, row_bytes, what="t"), raw)


def forged(raw: np.ndarray, row_bytes: int, *, declare: int | None = None, tail: bytes = b"") -> bytes:
    payload = bytearray(codec.pack_frame(raw, 2, row_bytes))
    if declare is not None:  # replace the low plane's frame with one that declares another size
        (n_low,) = codec.LENGTH.unpack(payload[:4])
        frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * declare)
        payload[:4 + n_low] = codec.LENGTH.pack(len(frame)) + frame
    return bytes(payload) + tail


def test_damaged_payloads_are_refused():
    raw, _, row_bytes = kv_bytes(torch.bfloat16)
    good = codec.pack_frame(raw, 2, row_bytes)
    cases = {
        "stray bytes": good + b"\0",
        "ends early": good[:-5],
        "no second plane": good[:4 + codec.LENGTH.unpack(good[:4])[0]],
        "length past the end": codec.LENGTH.pack(len(good)) + good[4:],
        "declares more": forged(raw, row_bytes, declare=1 << 30),
        "declares less": forged(raw, row_bytes, declare=raw.size // 2 - 2),
    }
    for why, payload in cases.items():
        with pytest.raises(CorruptData):
            codec.unpack_frame(payload, raw.size, 2, row_bytes, what=why)
    with pytest.raises(CorruptData, match="whole token rows"):
        codec.unpack_frame(good, raw.size - 1, 2, row_bytes, what="odd size")
