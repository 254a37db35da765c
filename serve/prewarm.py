"""The sessions an engine held open, restored again after it starts: a server killed, crashed or
restarted comes back with its conversations in memory, as they were, instead of restoring each one
on its first request (PostgreSQL's autoprewarm, for KV).

- `WorkingSet(home, engine)`: the file `<home>/serve/engine-<i>.json`, the names of the sessions
  the engine holds open, least recently used first. `save(names)` writes it when the engine goes
  idle and the list changed (atomically, not synced: a hint, which a power cut may lose); `load()`
  reads it once at start ([] where there is none, or it cannot be read).
- `Prewarm(engine, names, workers)`: while the engine has no job to run, `step()` opens the next
  session, the most recently used first (`Engine.writer`: a restore like any other, every checksum
  verified, so what a request then reads is what it would have restored itself). It leaves out a
  session that is gone, busy (another writer holds it), made with another model, or damaged (its
  request will say why), or pinned to another engine (the server may run with another --workers
  now); it stops at the engine's --max-open sessions and keeps to half of its KV memory, so it
  never evicts a session to make room. A request always goes first: the engine takes its jobs
  between two sessions' restores.

Nothing here changes a bit of any reply: a prewarmed session is the session its request would
have opened.

Measured: a 2,400-4,000-token conversation of the serve benchmark's (SmolLM2, 2 threads, AMD EPYC
Zen 1 kind), the server killed and started again 16 times, `--prewarm` and `--no-prewarm`
alternated: the first turn after the restart took 199 ms to its first token (median; 156-259)
against 250 ms (204-281); a turn with no restart before it, 183 ms.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import kvstore

from .config import engine_of

log = logging.getLogger("kvstore.serve")


class WorkingSet:
    def __init__(self, home: Path, engine: int):
        self.path = Path(home) / "serve" / f"engine-{engine}.json"
        self.saved: list[str] | None = None

    def load(self) -> list[str]:
        try:
            names = json.loads(self.path.read_text(encoding="utf-8"))["open"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        self.saved = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
        return list(self.saved)

    def save(self, names: list[str]) -> None:
        """Write `names` (least recently used first) where they changed since the last save; an
        error (a full disk, a read-only home) only logs: the service goes on without it."""
        if names == self.saved:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps({"open": names}), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not note the sessions engine holds open in %s: %s", self.path, e)
            return
        self.saved = list(names)


class Prewarm:
    def __init__(self, engine, names: list[str], workers: int):
        self.engine = engine
        self.pending = [n for n in reversed(names) if engine_of(n, workers) == engine.index]  # most recent first
        self.restored, self.tokens, self.skipped = 0, 0, 0
        self.started = time.perf_counter()

    def step(self) -> dict[str, Any] | None:
        """Open the next session; once none is left, the `prewarmed` event that says what was done
        (None before that)."""
        while self.pending:
            name = self.pending.pop(0)
            if self._full() or name in self.engine.sessions:
                continue
            if not self._fits(name):
                self.skipped += 1
                continue
            try:
                session, _, _ = self.engine.writer(name)
            except kvstore.errors.KvstoreError as e:  # gone, busy, another model, damaged: its request says
                self.skipped += 1
                log.info("engine %d did not restore session %r it held before: %s", self.engine.index, name, e)
                continue
            self.restored += 1
            self.tokens += session.n_cached
            return None  # one session a step: a request waits for one restore at most
        self.pending = []
        return {"event": "prewarmed", "engine": self.engine.index, "sessions": self.restored, "tokens": self.tokens,
                "skipped": self.skipped, "seconds": time.perf_counter() - self.started}

    def _full(self) -> bool:
        return len(self.engine.sessions) >= self.engine.max_open

    def _fits(self, name: str) -> bool:
        """Whether the session's KV fits in half of the engine's KV memory with what is held already."""
        pool = self.engine.pool
        if pool is None:
            return True
        try:
            tokens = self.engine.store.info(name).n_cached
        except kvstore.errors.KvstoreError:
            return True  # the open says what is wrong
        return pool.used + -(-tokens // pool.block_tokens) <= pool.n_blocks // 2
