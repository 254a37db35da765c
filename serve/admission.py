"""Who runs when: requests on one session one at a time, at most `max_running` on each engine, and a
bound on how many may wait (`max_queue`): beyond it, 429 with Retry-After.

`Admission.slot(key, engine)` is an async context: it waits for the session's turn, then for a
place on the engine, counting the request as waiting meanwhile (the `num_requests_waiting` gauge);
inside it the request runs. `Admission.turn(key)`: the session's turn alone (the server's own
work on a session after a request).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from .failures import ApiError
from .metrics import Metrics


class Admission:
    def __init__(self, metrics: Metrics, *, engines: int, max_running: int, max_queue: int):
        self.metrics, self.max_queue = metrics, max_queue
        self.session_locks: dict[str, asyncio.Lock] = {}
        self.places = [asyncio.Semaphore(max_running) for _ in range(engines)]
        self.waiting = 0
        self.running = 0
        self.closed = False

    @asynccontextmanager
    async def slot(self, key: str, engine: int) -> AsyncIterator[float]:
        """Yields the seconds the request waited."""
        if self.closed:
            raise ApiError(503, "the server is shutting down; retry on another instance or later",
                           type="server_error", code="shutting_down", headers={"Retry-After": "5"})
        if self.waiting >= self.max_queue:
            raise ApiError(429, f"too many requests waiting ({self.waiting}); retry in a few seconds",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "2"})
        lock = self.session_locks.setdefault(key, asyncio.Lock())
        arrived = time.perf_counter()
        self._wait(+1)
        try:
            await lock.acquire()
            try:
                await self.places[engine].acquire()
            except BaseException:
                lock.release()
                raise
        finally:
            self._wait(-1)
        waited = time.perf_counter() - arrived
        self.metrics.queue.observe(waited)
        self._run(+1)
        try:
            yield waited
        finally:
            self._run(-1)
            self.places[engine].release()
            self._release(key, lock)

    @asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        """The session's turn alone, for the server's own work on it after a request (a one-request
        session kept or deleted): after the requests on it before, never refused, not counted, no
        place on the engine taken."""
        lock = self.session_locks.setdefault(key, asyncio.Lock())
        await lock.acquire()
        try:
            yield
        finally:
            self._release(key, lock)

    def _release(self, key: str, lock: asyncio.Lock) -> None:
        lock.release()
        if not lock.locked() and not lock._waiters:  # noqa: SLF001 -- drop idle sessions' locks
            self.session_locks.pop(key, None)

    def _wait(self, d: int) -> None:
        self.waiting += d
        self.metrics.waiting.set(self.waiting)

    def _run(self, d: int) -> None:
        self.running += d
        self.metrics.running.set(self.running)
