"""The store's helper threads (kvstore.store.workers.parallel_map): results in the items' order,
the first failing item's error raised only once every item taken has ended, calls from inside a
helper (nested) that cannot deadlock, and a pool that a forked child makes afresh."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from kvstore.store import workers
from kvstore.store.workers import parallel_map


def test_results_come_in_the_items_order_whatever_finishes_first():
    def slow_first(x: int) -> int:
        time.sleep(0.02 if x == 0 else 0.0)
        return x * x

    assert parallel_map(slow_first, range(12), threads=3) == [x * x for x in range(12)]
    assert parallel_map(slow_first, [5], threads=3) == [25]
    assert parallel_map(slow_first, [], threads=3) == []


def test_the_work_runs_on_the_helpers_not_on_the_caller():
    names = parallel_map(lambda _: threading.current_thread().name, range(8), threads=2)
    assert all(n.startswith(workers.PREFIX) for n in names)


def test_the_first_failing_item_is_raised_after_every_item_taken_has_ended():
    ended: list[int] = []

    def fn(x: int) -> int:
        if x in (3, 9):
            raise ValueError(x)
        time.sleep(0.01)
        ended.append(x)
        return x

    with pytest.raises(ValueError) as caught:
        parallel_map(fn, range(20), threads=2)
    assert caught.value.args == (3,)  # not 9: items are taken in order, and 3 comes first
    count = len(ended)
    time.sleep(0.05)
    assert len(ended) == count  # nothing was still running when the error came back
    assert 3 not in ended and len(ended) < 18  # the helpers stopped taking items: not all the others ran


def test_calls_from_inside_helpers_finish_even_with_every_helper_busy():
    outer = workers.MAX_HELPERS * 2  # more outer items than helpers: all of them wait on inner calls

    def inner_sum(x: int) -> int:
        return sum(parallel_map(lambda y: x + y, range(10), threads=workers.MAX_HELPERS))

    assert parallel_map(inner_sum, range(outer), threads=workers.MAX_HELPERS) == [10 * x + 45 for x in range(outer)]


def in_forked_child(fn):
    """fn() run in a forked child (which makes its own pool), its result sent back."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put(fn()))
    child.start()
    try:
        result = queue.get(timeout=30)
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    return result


def test_a_forked_child_gets_its_own_pool():
    parallel_map(abs, range(4), threads=2)  # the parent's pool exists, with its threads
    assert in_forked_child(lambda: parallel_map(lambda x: x + 1, range(6), threads=2)) == [1, 2, 3, 4, 5, 6]


def _threads_started() -> list[str]:
    before = {t.name for t in threading.enumerate()}
    workers.start_threads(3, ["kvstore-test-serial"])
    return sorted({t.name for t in threading.enumerate()} - before)


def test_start_threads_starts_the_helpers_and_the_serial_threads_named():
    """What a store's warm_up starts before a service says it is ready, in a process that has none yet
    (a forked child makes its pool afresh): the helpers asked for and each serial thread named."""
    started = in_forked_child(_threads_started)
    assert sum(n.startswith(workers.PREFIX) for n in started) == 3
    assert "kvstore-test-serial_0" in started


def _prepared_threads() -> list[str]:
    names = []
    workers.start_threads(3, prepare=lambda: names.append(threading.current_thread().name))
    return sorted(names)


def test_start_threads_prepares_each_helper_once():
    """`prepare` (a store's warm_up: each reading thread's bounce buffer) runs once in each helper
    started, before start_threads returns."""
    names = in_forked_child(_prepared_threads)
    assert len(names) == 3 and len(set(names)) == 3 and all(n.startswith(workers.PREFIX) for n in names)
