"""Contract C4 under power loss: at every fsync point of every verb the store can be cut off, each
unsynced write kept, dropped or garbled and the unsynced directory changes kept or undone; the
store that comes back verifies, loads exactly the committed bytes, has lost no acknowledged state,
and is left with no file that gc does not clear (tests/faults.py simulates the disk)."""

from __future__ import annotations

import pytest

from faults_kit import VERBS

DATA = ("keep", "drop", "garble")
DIRS = ("undo", "keep")


def points(n_syncs: int, salt: int) -> list[int | None]:
    """A sample of sync points: the first, one that moves with `salt`, and the end (None)."""
    return sorted({0, salt % max(n_syncs, 1)} & set(range(n_syncs))) + [None]


@pytest.mark.parametrize("dirs", DIRS)
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("verb", VERBS)
def test_power_loss_at_a_sample_of_fsync_points(kit, verb, data, dirs):
    _, n_syncs = kit.ops(verb)
    salt = DATA.index(data) * 7 + DIRS.index(dirs) * 3 + 1
    for sync in points(n_syncs, salt):
        kit.power(verb, sync, data, dirs)


@pytest.mark.slow
@pytest.mark.parametrize("dirs", DIRS)
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("verb", VERBS)
def test_power_loss_at_every_fsync_point(kit, verb, data, dirs):
    _, n_syncs = kit.ops(verb)
    for sync in [*range(n_syncs), None]:
        kit.power(verb, sync, data, dirs)


@pytest.mark.parametrize("verb", VERBS)
def test_random_power_losses(kit, verb):
    """Each unsynced write independently kept, dropped or garbled; a random prefix of each
    directory's changes kept."""
    _, n_syncs = kit.ops(verb)
    for seed in range(3):
        kit.power(verb, seed % (n_syncs + 1) if seed % (n_syncs + 1) < n_syncs else None, "random", "random", seed)


def kill_points(ops: list[tuple[str, str]]) -> list[int]:
    """Right before the first fsyncs and the last: everything written, nothing yet durable."""
    syncs = [i for i, (name, _) in enumerate(ops) if name in ("fsync", "fsync_dir")]
    return sorted(set(syncs[:3] + syncs[-1:]))


@pytest.mark.parametrize("verb", ["create", "checkpoint", "fork", "pack", "import", "open"])
def test_process_death_then_recovery_then_power_loss(kit, verb):
    """ALICE's lesson: recovery must fsync what it did not write itself (a dead writer's files)."""
    ops, _ = kit.ops(verb)
    for op in kill_points(ops):
        kit.kill_then_power(verb, op)


@pytest.mark.slow
@pytest.mark.parametrize("dirs", DIRS)
@pytest.mark.parametrize("verb", ["create", "checkpoint", "fork", "pack", "import", "open", "gc", "export"])
def test_process_death_at_every_operation_then_power_loss(kit, verb, dirs):
    ops, _ = kit.ops(verb)
    for op in range(len(ops)):
        kit.kill_then_power(verb, op, "random", dirs, seed=op)
