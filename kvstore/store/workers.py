"""The store's helper threads: `parallel_map(fn, items, threads)` over a pool that lives as long as
the process, and `serial(name)`: one thread of that name doing what it is handed in order (the
layer files' syncs, the checkpoints a generation does not wait for).

Restoring a session is a few milliseconds of preads and checksums (both release the GIL), split
over its layers. A pool made per call spent a good part of that starting threads, and a task per
layer cost a hand-off per layer; here `threads` helpers each take the next item as they come
free, so one of them held up (a busy machine) leaves its share to the others. The caller waits
meanwhile: measured on 2 busy cores (AMD EPYC Zen 5), a restore with the caller working too had a
median 40 % slower than with the caller waiting, at an equal best case. A call made from one of
the pool's own threads (nested) works on its items itself as well and never waits for a helper
that has not started, so nesting cannot deadlock; after a fork the child makes its own pool.

The result is `[fn(x) for x in items]`; when calls fail, the error of the first failing item (in
the items' order) is raised, once every item taken has finished: no helper still writes into
memory the caller has moved on from.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_HELPERS = 8  # threads the pool may grow to (it starts them as calls need them)
PREFIX = "kvstore-store"  # the helpers' thread names begin so

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_serial: dict[str, ThreadPoolExecutor] = {}


def _helpers() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_HELPERS, thread_name_prefix=PREFIX)
        return _pool


def serial(name: str) -> ThreadPoolExecutor:
    """The process's one thread called `name` (made on first use): its tasks run one at a time, in
    the order submitted. After a fork the child makes its own. Once the interpreter shuts down it
    takes no new task (`submit` raises RuntimeError): callers then do the work themselves."""
    with _lock:
        if name not in _serial:
            _serial[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        return _serial[name]


def _forget_pool() -> None:  # in a forked child: the parent's threads (and the lock's holder) are not here
    global _pool, _lock
    _pool, _lock = None, threading.Lock()
    _serial.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def start_threads(helpers: int, serial_names: Sequence[str] = (), prepare: Callable[[], None] | None = None) -> None:
    """Start `helpers` of the pool's threads and the serial threads named, now: each starts as a call
    first needs it otherwise, and a start is a pause of that call (`warm_up` of a store). `prepare`
    runs once in each of the helpers (what a thread makes on its first read: its bounce buffer)."""
    helpers = min(helpers, MAX_HELPERS)
    arrived = threading.Barrier(helpers + 1)  # each task holds its thread until all have one

    def start() -> None:
        if prepare is not None:
            prepare()
        arrived.wait(10.0)

    pool = _helpers()
    started = [pool.submit(start) for _ in range(helpers)]
    try:
        arrived.wait(10.0)
    except threading.BrokenBarrierError:  # the pool was busy with other calls: they started threads
        pass
    wait(started)
    for name in serial_names:
        serial(name).submit(lambda: None).result()


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int = 4) -> list[R]:
    """`[fn(x) for x in items]`, computed by up to `threads` helpers."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    results: list = [None] * len(items)
    errors: dict[int, BaseException] = {}
    order = iter(range(len(items)))  # shared: each next() hands one index to one thread (the GIL)

    def work() -> None:
        for i in order:
            if errors:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 -- raised below, by the caller
                errors[i] = e
                return

    pool = _helpers()
    nested = threading.current_thread().name.startswith(PREFIX)
    helpers = [pool.submit(work) for _ in range(min(threads, len(items)) - nested)]
    try:
        if nested:
            work()
        for h in helpers:
            if not (nested and h.cancel()):
                h.result()
    except BaseException as e:  # interrupted while waiting: the helpers take no more items; let them end
        errors[len(items)] = e
        for h in helpers:
            h.cancel()
        wait(helpers)
        raise
    if errors:
        raise errors[min(errors)]
    return results
