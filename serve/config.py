"""The service's settings: what `kvstore serve` was started with (`command.py`), in one dataclass."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
         "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


def engine_of(session: str, workers: int) -> int:
    """The engine a session is pinned to among `workers` (a hash of its name), so that one process
    writes it (C7 across engines)."""
    return zlib.crc32(session.encode()) % workers


def parse_size(text: str, *, zero: bool = False) -> int:
    """"2GiB", "512MiB", "1.5G", "100000" -> bytes ("0" too with `zero`); ValueError saying what is
    accepted."""
    if zero and text.strip() == "0":
        return 0
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("BIKMGT")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a size: write a number with an optional unit, e.g. 2GiB, 512MiB, 1.5G")
    return int(value * UNITS[unit])


@dataclass
class ServeConfig:
    home: Path | None = None  # the store (None: $KVSTORE_HOME, else the per-user app folder)
    index: str | None = None  # the index's URL (None: the home's kvstore.db)
    model: str = "smollm2"  # alias, .gguf file or Hugging Face folder
    model_id: str | None = None  # the name /v1/models gives it (default: the alias or the file's stem)
    dtype: str | None = None
    weights: str | None = None  # how the engines hold the weight matrices (kvstore.WEIGHT_FORMATS)
    device: str = "cpu"  # where the engines run the model and keep the paged KV memory ("cpu" or "cuda")
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # engine processes
    threads: int = 0  # torch threads per engine (0: the CPUs / workers)
    api_keys: list[str] = field(default_factory=list)
    allow_open: bool = False  # serve a non-loopback address without keys
    allowed_origins: list[str] = field(default_factory=list)  # web origins allowed to call from a browser (CORS)
    max_queue: int = 64  # requests that may wait; beyond: 429
    max_running: int = 8  # requests running at once on one engine (their decode steps interleave)
    max_open: int = 100000  # sessions an engine keeps open between requests (besides the KV memory's bound)
    prewarm: bool = True  # after a start, each engine restores the sessions it held open before (prewarm.py)
    kv_memory: int = 2 * 2**30  # bytes of paged KV memory, shared out among the engines
    prefix_cache: int = 2**30  # KV bytes of the prefix-cache entries (stateless requests' sessions); 0: off
    step_tokens: int = 512  # tokens one engine step's forward computes at most (decode rows + prompt rows)
    max_slowdown: float = 2.0  # a step reading prompt rows beside decode tokens: at most this x their step alone
    max_body: int = 8 * 2**20  # bytes of a request body; beyond: 413 (imports: max_import)
    max_import: int = 4 * 2**30
    max_tokens: int = 4096  # the most a request may generate; the default too, within the context
    chunk_size: int | None = None  # prefill chunk of the sessions this server creates (None: the library's)
    checkpoint_every: int | None = None
    keep_alive: float = 15.0  # seconds between keep-alive comments on an idle stream
    grace: float = 30.0  # seconds SIGTERM waits for requests in flight
    log_format: str = "text"  # or "json": one JSON object per request

    def served_name(self) -> str:
        if self.model_id:
            return self.model_id
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name if os.sep in self.model else self.model

    def engine_kv_memory(self) -> int:
        return self.kv_memory // max(1, self.workers)

    def engine_threads(self) -> int:
        if self.threads:
            return self.threads
        return max(1, (os.cpu_count() or 1) // max(1, self.workers))
