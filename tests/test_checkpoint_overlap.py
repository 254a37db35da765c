"""Generation's automatic checkpoints commit while the next tokens decode (`commit.commit_later`):
the decode does not wait for them, they commit in order, each is acknowledged (`on_checkpoint`) only
once the index holds it, a failed one is raised by the generation and what it carried is committed
by the next, and the tokens are the same bits as when every checkpoint was waited for."""

from __future__ import annotations

import threading

import pytest

import kvstore
import store_harness as H
from kvstore import commit as commit_module
from kvstore.errors import StoreFull

WAIT_S = 30  # far more than any step of the tiny model; only a broken overlap reaches it


@pytest.fixture
def store(tmp_path):
    return kvstore.open_store(tmp_path / "home")


def stored_head(store, name: str) -> tuple[int, int]:
    """(head, n_tokens) as the index holds them, read apart from the writer."""
    with store.db() as db:
        row = store.row(db, name)
        return row.head, row.n_tokens


def test_the_decode_goes_on_while_an_automatic_checkpoint_commits(store, model, monkeypatch):
    """The first automatic commit is held on the committing thread until the generation has
    produced two more tokens since it handed the checkpoint over: with a commit the decode waited
    for, those tokens would never come. (Counted from the hand-over, on the generation's own thread,
    not from the moment the committing thread starts: the next automatic checkpoint, 4 tokens on,
    waits for this one, and a committing thread that started late must not make that look like a
    decode that waited.)"""
    handed, held, later_tokens = threading.Event(), threading.Event(), threading.Event()
    real, real_later = commit_module.commit, commit_module.commit_later

    def slow_commit(store_, session_id, name, head, change):
        if change.reason == "auto" and not held.is_set():
            held.set()
            assert later_tokens.wait(WAIT_S), "the decode waited for the checkpoint"
        return real(store_, session_id, name, head, change)

    def handing_over(store_, session_id, name, head, change):
        future = real_later(store_, session_id, name, head, change)
        if change.reason == "auto":
            handed.set()
        return future

    monkeypatch.setattr(commit_module, "commit", slow_commit)
    monkeypatch.setattr("kvstore.session.commit_later", handing_over)
    with store.new("s", model, seed=3, checkpoint_every=4) as s:
        s.append_text(H.DOCUMENT)
        seen_after_handover = 0
        for _ in s.generate(12, stop_at_eos=False):
            if handed.is_set():
                seen_after_handover += 1
                if seen_after_handover == 2:
                    later_tokens.set()
        assert held.is_set() and seen_after_handover >= 2
    assert stored_head(store, "s")[1] == len(store.tokens("s"))


def test_automatic_checkpoints_are_acknowledged_in_order_and_only_once_the_index_holds_them(store, model):
    acks = []
    with store.new("s", model, seed=3, checkpoint_every=2) as s:
        s.append_text(H.DOCUMENT)
        first = s.head.seq

        def on_checkpoint(head, n_tokens, n_cached):
            acks.append((head, n_tokens))
            assert stored_head(store, "s") == (head, n_tokens)  # committed before it is acknowledged

        s.on_checkpoint = on_checkpoint
        generated = list(s.generate(15, stop_at_eos=False))
    assert len(generated) == 15
    assert [h for h, _ in acks] == list(range(first + 1, first + 1 + len(acks)))  # none skipped, none twice
    assert [n for _, n in acks] == sorted(n for _, n in acks)
    assert len(acks) >= 15 // 2  # every interval's checkpoint, and the end's
    assert acks[-1] == stored_head(store, "s")


def test_a_failed_automatic_checkpoint_is_raised_by_the_generation_and_the_next_commits_what_it_carried(
        store, model, monkeypatch):
    """The disk is full for one automatic commit: the generation raises StoreFull; the end-of-call
    checkpoint then commits everything, and the reopened session finishes the call as one that
    never failed would have."""
    real, failed = commit_module.commit, []

    def full_once(store_, session_id, name, head, change):
        if change.reason == "auto" and not failed:
            failed.append(head.seq)
            raise StoreFull("the disk is full (injected)")
        return real(store_, session_id, name, head, change)

    with store.new("ref", model, seed=5, checkpoint_every=3) as s:
        s.append_text(H.DOCUMENT)
    store.fork("ref", "cut")
    with store.open("ref", model) as s:
        assert len(list(s.generate(14, stop_at_eos=False))) == 14

    monkeypatch.setattr(commit_module, "commit", full_once)
    got = []
    with store.open("cut", model) as s:
        with pytest.raises(StoreFull):
            for t in s.generate(14, stop_at_eos=False):
                got.append(t)
        assert failed and len(got) < 14
    assert stored_head(store, "cut")[1] == len(store.tokens("cut"))
    assert store.tokens("cut") == store.tokens("ref")[:len(store.tokens("cut"))]
    with store.open("cut", model) as s:
        "".join(s.resume())
    assert store.tokens("cut") == store.tokens("ref")


@pytest.mark.parametrize("every", [1, 3])
def test_the_tokens_and_the_stored_cache_are_those_of_checkpoints_waited_for(store, model, monkeypatch, every):
    with store.new("a", model, seed=9, checkpoint_every=every) as s:
        s.append_text(H.DOCUMENT)
    store.fork("a", "b")
    with store.open("a", model) as s:
        overlapped = list(s.generate(13, stop_at_eos=False))

    real_later = commit_module.commit_later

    def waited(store_, session_id, name, head, change):  # the old protocol: done before the caller goes on
        future = real_later(store_, session_id, name, head, change)
        future.result()
        return future

    monkeypatch.setattr("kvstore.session.commit_later", waited)
    with store.open("b", model) as s:
        waited_for = list(s.generate(13, stop_at_eos=False))
    assert overlapped == waited_for
    assert store.tokens("a")[-13:] == store.tokens("b")[-13:]
    with store.open("a", model) as a, store.open("b", model) as b:
        for x, y in zip(a.seq.cache.state(), b.seq.cache.state()):
            assert x.equal(y)
