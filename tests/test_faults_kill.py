"""Contract C4 under SIGKILL: a writer killed at any moment (at random, or before any single file
operation of a checkpoint, create, fork, pack, export, import, gc, delete or recovery) loses no
acknowledged checkpoint; the store verifies, loads exactly the committed bytes, and a continued
session matches the uninterrupted run bit for bit. A deleted index or `-wal` after a kill is an
older consistent state or a precise error, never garbage."""

from __future__ import annotations

import random

import pytest
import torch

import kvstore
import store_harness as H
import faults_kit as torture
from kvstore.errors import KvstoreError, StoreMissing
from faults_kit import SETTINGS, VERBS


def sample(n_ops: int) -> list[int]:
    return sorted({n_ops // 4, n_ops // 2, 3 * n_ops // 4, n_ops - 1})


# -- SIGKILL before an operation ---------------------------------------------------------------------
@pytest.mark.parametrize("verb", VERBS)
def test_sigkill_at_a_sample_of_operations(kit, verb):
    ops, _ = kit.ops(verb)
    assert kit.kill(verb, None)[0] == "acked"  # the verb runs to the end in a child
    for k in sample(len(ops)):
        assert kit.kill(verb, k)[1] == k


@pytest.mark.slow
@pytest.mark.parametrize("verb", VERBS)
def test_sigkill_at_every_operation(kit, verb):
    ops, _ = kit.ops(verb)
    for k in range(len(ops)):
        kit.kill(verb, k, trace=k % 4 == 0)


# -- the kill oracle: SIGKILL at a random moment of a generation that checkpoints every token ----------
@pytest.mark.parametrize("round_", range(6))
def test_kill_oracle(kit, tmp_path, round_):
    torture.oracle_round(kit, tmp_path, random.Random(round_))


# -- the index and its log deleted after a kill -----------------------------------------------------------
def killed_mid_generation(kit, tmp_path, n_acks: int):
    home = tmp_path / "home"
    store = kvstore.open_store(home)
    with store.new("s", kit.model, **{**SETTINGS, "checkpoint_every": 1}) as s:
        s.append_text(torture.DOCUMENT)
    floor = store.info("s").n_tokens
    store.close()
    proc, conn = torture.start(H.child_generate, str(home), kit.model_path, "s", torture.N_TOTAL,
                              str(tmp_path / "t.jsonl"), 1)
    for _ in range(n_acks):
        H.wait_for(conn, "ack")
    H.kill_after(proc, conn, 0.0)
    return home, floor


def test_a_deleted_wal_after_a_kill_leaves_an_older_consistent_state(kit, tmp_path):
    home, floor = killed_mid_generation(kit, tmp_path, 5)
    wal = home / "kvstore.db-wal"
    assert wal.exists() and wal.stat().st_size > 0  # the acknowledged commits live there
    wal.unlink()
    store = kvstore.open_store(home)
    assert store.verify() == {"s": []}
    n = store.info("s").n_tokens
    assert floor <= n  # what was checkpointed into the main file is still there
    with store.open("s", kit.model) as s:  # bytes the lost commits had written are cut off
        assert s.tokens == kit.ref.tokens[:n]
        for layer, rows in enumerate(s.seq.cache.state()):
            assert torch.equal(rows.contiguous().view(-1).view(torch.uint8), kit.ref.kv[layer][:rows.numel()
                                                                                               * rows.element_size()])
        list(s.generate(len(kit.ref.tokens) - n, stop_at_eos=False))
        assert s.tokens == kit.ref.tokens
    assert store.verify() == {"s": []}


def test_a_deleted_index_after_a_kill_is_store_missing_and_nothing_is_recreated(kit, tmp_path):
    home, _ = killed_mid_generation(kit, tmp_path, 3)
    (home / "kvstore.db").unlink()
    before = sorted(p.name for p in home.iterdir())
    with pytest.raises(StoreMissing, match="kvstore.db is missing"):
        kvstore.open_store(home)
    assert sorted(p.name for p in home.iterdir()) == before


def test_a_deleted_wal_and_shm_after_a_kill_still_open(kit, tmp_path):
    home, floor = killed_mid_generation(kit, tmp_path, 2)
    for name in ("kvstore.db-wal", "kvstore.db-shm"):
        (home / name).unlink(missing_ok=True)
    try:
        store = kvstore.open_store(home)
    except KvstoreError:
        return  # a precise refusal is allowed; garbage is not
    assert store.verify() == {"s": []} and store.info("s").n_tokens >= floor
