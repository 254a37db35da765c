"""Contract C7 and C4 together: two writers racing on one session (started at a barrier), with the
flock and without it (as on storage where flock is not shared), end with exactly one winner, and
the winner's checkpoint is intact: the loser wrote nothing over it. gc interleaved at every
operation of a pack, an import and a checkpoint never deletes what they are about to commit."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from sqlalchemy import event

import kvstore
import faults_kit as torture
from faults import FaultyIO
from kvstore import fileio
from kvstore.errors import IndexBusy

TEXTS = (" The fox resumes its run, keys and values stay cached.", " Quick brown dogs sleep; the cache holds.")


@pytest.fixture(scope="module")
def expected(kit, tmp_path_factory):
    """For each text: the session's tokens and cache bytes if that racer wins."""
    out = {}
    for text in TEXTS:
        root = torture.copy_template(kit.template("checkpoint")[0], tmp_path_factory.mktemp("winner") / "t")
        store = kvstore.open_store(root / "home")
        with store.open("s", kit.model) as s:
            s.seq.add(kit.model.tokenizer.encode(text, add_bos=False))
            list(s.seq.prefill())
            s.checkpoint()
            out[text] = (list(s.tokens), [t.clone() for t in s.seq.cache.state()])
        store.close()
    return out


@pytest.mark.parametrize("use_lock", [True, False], ids=["flock", "no-flock"])
@pytest.mark.parametrize("round_", range(4))
def test_two_writers_racing_have_exactly_one_winner(kit, expected, tmp_path, use_lock, round_):
    root = torture.copy_template(kit.template("checkpoint")[0], tmp_path / "t")
    texts = TEXTS if round_ % 2 == 0 else TEXTS[::-1]
    results = torture.race(root / "home", kit.model_path, texts, use_lock)
    kinds = sorted(r[0] for r in results)
    assert kinds == (["busy", "won"] if use_lock else ["lost", "won"]), results
    winner = next(r[1] for r in results if r[0] == "won")
    store = kvstore.open_store(root / "home")
    assert store.verify() == {"s": []}, "the loser damaged the winner's checkpoint"
    with store.open("s", kit.model) as s:
        tokens, cache = expected[winner]
        assert s.tokens == tokens
        assert all(torch.equal(a, b) for a, b in zip(s.seq.cache.state(), cache))


# -- gc running in the middle of another verb ------------------------------------------------------------
class OtherProcessGC:
    """A gc from another store object, run at a chosen operation: at once if the index is free,
    else (the verb holds the index's write lock) in a thread that waits for it, as a process would."""

    def __init__(self, home):
        self.now = kvstore.open_store(home)
        event.listen(self.now.engine, "connect", lambda conn, _: conn.execute("PRAGMA busy_timeout = 0"))
        self.now.engine.dispose()  # the pooled connection predates the listener
        self.later = kvstore.open_store(home)
        self.thread: threading.Thread | None = None

    def __call__(self) -> None:
        try:
            self.now.gc()
        except IndexBusy:  # the verb holds the index (this store waits 0 s for it)
            self.thread = threading.Thread(target=self.later.gc)
            self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(60)
        self.now.close()
        self.later.close()


def gc_in_the_middle(kit, tmp_path, verb: str, op: int) -> None:
    template, floors = kit.template(verb)
    root = torture.copy_template(template, tmp_path / f"{verb}-{op}")
    fs = FaultyIO(track=False)
    store, action, base = torture.start_verb(root, kit.model, verb, fs)
    other = OtherProcessGC(root / "home")
    fs.hook(base + op, other)
    with fileio.use(fs):
        action()
        other.close()
    store.close()
    torture.check(root, kit.model, kit.ref, verb, floors, acked=True)
    shutil.rmtree(root)


GC_VERBS = ["pack", "import", "checkpoint", "create", "fork"]


def gc_at(kit, tmp_path, verb: str, ops_at: list[int]) -> None:
    ops, _ = kit.ops(verb)
    for op in ops_at:
        try:
            gc_in_the_middle(kit, tmp_path, verb, op)
        except AssertionError as e:
            raise AssertionError(f"gc before operation {op} of {verb} ({ops[op][0]}): {e}") from e


@pytest.mark.parametrize("verb", GC_VERBS)
def test_gc_interleaved_at_a_sample_of_operations(kit, tmp_path, verb):
    n = len(kit.ops(verb)[0])
    gc_at(kit, tmp_path, verb, range(0, n, max(1, n // 10)))


@pytest.mark.slow
@pytest.mark.parametrize("verb", GC_VERBS)
def test_gc_interleaved_at_every_operation(kit, tmp_path, verb):
    gc_at(kit, tmp_path, verb, range(len(kit.ops(verb)[0])))
