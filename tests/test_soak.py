"""The soak: thousands of random kill points, simulated power losses and byte flips in one run, with
the counts that must all be zero. Run it with `pytest -m slow tests/test_soak.py -s`.

- kill points: half are the kill oracle (a child generating with a checkpoint per token, SIGKILLed
  at a random moment, every acknowledged checkpoint checked, the session continued and compared
  bit for bit with the uninterrupted run), half a SIGKILL before a random file operation of a
  random verb (checkpoint, create, fork, pack, export, import, gc, delete, open);
- power losses: at a random fsync point of a random verb, each unsynced write kept, dropped or
  garbled and directory changes kept or undone at random; a fifth of them after a process death
  and a recovery that acknowledged new checkpoints;
- flips: one random byte of a committed extent, a blob or an archive.

KVSTORE_SOAK_KILLS, KVSTORE_SOAK_POWER_LOSSES, KVSTORE_SOAK_FLIPS and KVSTORE_SOAK_SEED change the
sizes and the seed.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections import Counter

import pytest
import torch

import kvstore
import faults_kit as torture
from kvstore.errors import KvstoreError
from faults_kit import VERBS, Corrupt, Lost

KILLS = int(os.environ.get("KVSTORE_SOAK_KILLS", 1000))
POWER_LOSSES = int(os.environ.get("KVSTORE_SOAK_POWER_LOSSES", 1000))
FLIPS = int(os.environ.get("KVSTORE_SOAK_FLIPS", 1000))
SEED = int(os.environ.get("KVSTORE_SOAK_SEED", 20261130))


class Tally:
    def __init__(self):
        self.counts, self.failures = Counter(), []

    def run(self, kind: str, trial) -> None:
        self.counts[f"{kind} trials"] += 1
        try:
            trial()
        except Lost as e:
            self.counts["acknowledged checkpoints lost"] += 1
            self.failures.append(f"{kind}: {e}")
        except Corrupt as e:
            self.counts["corrupt loads"] += 1
            self.failures.append(f"{kind}: {e}")
        except Exception as e:  # noqa: BLE001 — anything else is a failure to report too
            self.counts["other failures"] += 1
            self.failures.append(f"{kind}: {type(e).__name__}: {e}")


def kills(kit, tally: Tally, rng: random.Random, tmp) -> None:
    for i in range(KILLS):
        if i % 2 == 0:
            def trial(i=i):
                root = tmp / f"oracle-{i}"
                try:
                    tally.counts["acknowledged checkpoints seen"] += torture.oracle_round(kit, root, rng)["acks"]
                finally:
                    shutil.rmtree(root, ignore_errors=True)
            tally.run("kill", trial)
        else:
            verb = rng.choice(VERBS)
            op = rng.randrange(len(kit.ops(verb)[0]))
            tally.run("kill", lambda: kit.kill(verb, op, trace=rng.random() < 0.25))


def power_losses(kit, tally: Tally, rng: random.Random) -> None:
    for i in range(POWER_LOSSES):
        verb = rng.choice(VERBS)
        ops, n_syncs = kit.ops(verb)
        data = rng.choice(["keep", "drop", "garble", "random", "random"])
        dirs = rng.choice(["keep", "undo", "random", "random"])
        if i % 5 == 4 and verb not in ("delete",):
            op = rng.randrange(len(ops))
            tally.run("power loss", lambda: kit.kill_then_power(verb, op, data, dirs, seed=i))
        else:
            sync = rng.choice([*range(n_syncs), None])
            tally.run("power loss", lambda: kit.power(verb, sync, data, dirs, seed=i))


def flips(kit, tally: Tally, rng: random.Random, tmp) -> None:
    """Flip one random byte of a committed extent, a blob or an archive; load; count what slips by."""
    store = kvstore.open_store(tmp / "home")
    with store.new("s", kit.model, seed=1, chunk_size=3) as s:
        s.append_tokens([5, 17, 42, 99, 7, 8, 9])
        tokens, state = list(s.tokens), [t.clone() for t in s.seq.cache.state()]
    store.export("s", tmp / "s.kvs")
    shutil.copytree(tmp / "home", tmp / "packed")
    packed = kvstore.open_store(tmp / "packed")
    packed.pack("s")
    layer_files = sorted(store.session_dir(store.info("s").id).glob("layer-*.kv"))
    token_bytes = state[0][0].numel() * state[0].element_size()
    extents = [(0, 3), (4096, 3)]  # chunk_size 3: 6 cached tokens in two page-aligned extents
    target_store = {"extent": store, "blob": packed}

    def loads_the_same(st) -> bool:
        with st.open("s", kit.model) as again:
            return again.tokens == tokens and all(torch.equal(a, b) for a, b in zip(again.seq.cache.state(), state))

    def imports_the_same() -> bool:
        other = kvstore.open_store(tmp / "import-target")
        try:
            other.import_(tmp / "s.kvs", name="s")
            return loads_the_same(other)
        finally:
            if "s" in other.names():
                other.delete("s")
            other.close()

    for _ in range(FLIPS):
        kind = rng.choice(["extent", "blob", "archive"])
        if kind == "extent":
            path = rng.choice(layer_files)
            start, n = rng.choice(extents)
            offset = start + rng.randrange(n * token_bytes)
        else:
            path = tmp / "s.kvs" if kind == "archive" else next((tmp / "packed" / "blobs").glob("*.kvz"))
            offset = rng.randrange(path.stat().st_size)
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[offset] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(damaged))
        tally.counts["flip trials"] += 1
        try:
            same = imports_the_same() if kind == "archive" else loads_the_same(target_store[kind])
            tally.counts["flips harmless" if same else "undetected flips"] += 1
            if not same:
                tally.failures.append(f"flip of {kind} byte {offset} loaded other bytes")
        except KvstoreError:
            tally.counts["flips detected"] += 1
        finally:
            path.write_bytes(original)
    store.close()
    packed.close()


@pytest.mark.slow
def test_soak(kit, tmp_path_factory):
    rng, tally, started = random.Random(SEED), Tally(), time.monotonic()
    for verb in VERBS:  # build every template before the clock matters
        kit.ops(verb)
    kills(kit, tally, rng, tmp_path_factory.mktemp("kills"))
    after_kills = time.monotonic()
    power_losses(kit, tally, rng)
    after_power = time.monotonic()
    flips(kit, tally, rng, tmp_path_factory.mktemp("flips"))
    c = tally.counts
    lines = [f"soak (seed {SEED}) in {time.monotonic() - started:.0f} s "
             f"(kills {after_kills - started:.0f} s, power losses {after_power - after_kills:.0f} s)",
             *(f"  {key:32s} {c[key]}" for key in [
                 "kill trials", "acknowledged checkpoints seen", "power loss trials", "flip trials",
                 "flips detected", "flips harmless", "acknowledged checkpoints lost", "corrupt loads",
                 "undetected flips", "other failures"]),
             *(f"  ! {f[:300]}" for f in tally.failures[:20])]
    print("\n" + "\n".join(lines))
    assert c["kill trials"] >= KILLS and c["power loss trials"] >= POWER_LOSSES
    assert (c["acknowledged checkpoints lost"], c["corrupt loads"], c["undetected flips"], c["other failures"]) == (
        0, 0, 0, 0), "\n".join(lines)
