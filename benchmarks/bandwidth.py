"""The machine's streaming-read bandwidth, measured by the benchmark itself, and the decode rate it
allows.

A decode step reads every weight once and the whole KV cache once, and on these small models it
does little else: so `bytes read per token / bandwidth` is a floor under a step's time, and its
inverse a ceiling over tok/s. The benchmark measures the bandwidth beside the engines (once per
repetition of the engine rotation, on the same torch threads) with a plain read: `torch.sum` over
a float32 buffer the size of the stored weights, and never smaller than `CACHE_MULTIPLE` times the
last-level cache, so it streams from memory. The limit at a context of n tokens is

    bandwidth / (weight bytes + KV bytes per token × (n + new / 2))

(the cache grows from n to n + new - 1 over the `new` tokens timed; its mean length is close to
n + new / 2), and an engine's measured rate is reported as a share of its own limit: its weights in
its own format (the GGUF's blocks, or bfloat16), the KV in bfloat16 / float16 (the same bytes).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

CACHE_MULTIPLE = 4  # the buffer is at least this many times the last-level cache
PASSES = 5  # reads per measurement; the measurement is their median


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs names for CPU 0 (0 where it cannot be read)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def buffer_bytes(weight_bytes: int, cache_bytes: int | None = None) -> int:
    """How many bytes the read streams: the weights' size, at least CACHE_MULTIPLE × the last-level
    cache, rounded up to whole MiB."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    size = max(weight_bytes, CACHE_MULTIPLE * cache)
    return -(-size // (1 << 20)) * (1 << 20)


class ReadProbe:
    """A buffer of `nbytes` (allocated and written once) and its read rate."""

    def __init__(self, nbytes: int):
        self.buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # written: every page is backed
        self.nbytes = self.buffer.numel() * 4
        self.buffer.sum()  # first touch outside the timing

    def read_bytes_per_s(self, passes: int = PASSES) -> float:
        """The median over `passes` of nbytes / the time of one `torch.sum` over the buffer."""
        rates = []
        for _ in range(passes):
            start = time.perf_counter()
            self.buffer.sum()
            rates.append(self.nbytes / (time.perf_counter() - start))
        return statistics.median(rates)


def limit_tok_s(bytes_per_s: float, weight_bytes: int, kv_bytes_per_token: int, context: int, new: int) -> float:
    """The decode rate the bandwidth allows at `context` tokens of cache, `new` tokens timed."""
    per_token = weight_bytes + kv_bytes_per_token * (context + new / 2)
    return bytes_per_s / per_token


def limits(bytes_per_s: float, weight_bytes: int, kv_bytes_per_token: int, contexts: list[int], new: int) -> dict:
    """{str(context): limit tok/s} for each context."""
    return {str(n): limit_tok_s(bytes_per_s, weight_bytes, kv_bytes_per_token, n, new) for n in contexts}


def share_pct(rate: float, limit: float) -> float:
    """A measured rate as a percentage of its limit."""
    return 100.0 * rate / limit
