"""ENOSPC and EIO at every file operation of a checkpoint (of an existing session, and the first of
a new one, which creates its files): a clear error (StoreFull for a full disk), the process alive,
the head unchanged, nothing left behind, and the next checkpoint succeeds once the disk is back —
durably: a power loss right after it keeps it. A failed fsync is never retried on the same data
(tests/faults.py drops the data of a failed fsync, as Linux does), so only a rewrite passes."""

from __future__ import annotations

import errno

import pytest
from sqlalchemy import select

import kvstore
import faults_kit as torture
from faults import SPACE, FaultyIO
from kvstore import fileio
from kvstore.errors import StoreFull
from kvstore.store.index import SegmentRow, SessionRow
from faults_kit import N_MORE, SETTINGS


def start(kit, root, first: bool):
    """A session with N_MORE new tokens computed but not checkpointed, under a FaultyIO; returns
    (store, session, layer, operations so far, committed token count)."""
    fs = FaultyIO()
    with fileio.use(fs):
        if first:  # a new session whose first checkpoint creates its files
            store = kvstore.open_store(root / "home")
            s = store.new("s", kit.model, **SETTINGS)
            s.seq.add(kit.model.tokenizer.encode(torture.DOCUMENT))
            list(s.seq.prefill())
        else:
            torture.copy_template(kit.template("checkpoint")[0], root)
            store = kvstore.open_store(root / "home")
            s = store.open("s", kit.model)
            list(s.seq.generate(s.settings, seed=s.seed, max_new_tokens=N_MORE))
    return store, s, fs, len(fs.log), store.info("s").n_tokens


def checkpoint_ops(kit, tmp_path, first: bool) -> list[tuple[str, str]]:
    store, s, fs, base, _ = start(kit, tmp_path / "dry", first)
    with fileio.use(fs):
        assert s.checkpoint()
        s.close()
    store.close()
    return fs.log[base:-1]  # the last is close()'s unlock


def head(store) -> tuple[int, int]:
    with store.db() as db:
        row = db.scalar(select(SessionRow).where(SessionRow.name == "s"))
        return row.head, db.get(SegmentRow, row.id).committed_end


def leftovers(store, committed_end: int) -> list[str]:
    """Temp files, and layer bytes past the committed end (space a failed write reserved)."""
    out = [str(p.relative_to(store.home)) for p in store.home.rglob("*.tmp")]
    out += [f"{p.name}: {p.stat().st_size} bytes" for p in store.sessions_dir.rglob("layer-*.kv")
            if p.stat().st_size > committed_end]
    return out


def fail_then_recover(kit, root, first: bool, index: int, err: int, *, sticky: bool = False) -> None:
    store, s, fs, base, n_before = start(kit, root, first)
    before = head(store)
    fs.fail(base + index, err, sticky=sticky)
    with fileio.use(fs):
        for _ in range(2 if sticky else 1):  # a disk that stays full fails every try, cleanly
            with pytest.raises(StoreFull if err == errno.ENOSPC else OSError) as raised:
                s.checkpoint()
            if err == errno.ENOSPC:
                assert "disk is full" in str(raised.value) and "intact" in str(raised.value)
            else:
                assert raised.value.errno == err
            assert head(store) == before, "a failed checkpoint moved the head"
            assert leftovers(store, before[1]) == []
        fs.heal()
        assert s.checkpoint()  # space is back: the same KV, rewritten from memory
        acked = len(s.tokens)
        s.close()
    assert acked > n_before
    fs.power_loss(data="drop", dirs="undo")  # everything not made durable is lost
    store.close()
    with kvstore.open_store(root / "home") as again:
        assert again.verify() == {"s": []}
        assert again.info("s").n_tokens == acked, "the acknowledged checkpoint was lost"
        with again.open("s", kit.model) as reopened:
            assert reopened.tokens == kit.ref.tokens[:acked]


@pytest.mark.parametrize("first", [False, True], ids=["existing-files", "first-checkpoint"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_an_error_at_every_operation_of_a_checkpoint(kit, tmp_path, err, first):
    ops = checkpoint_ops(kit, tmp_path, first)
    targets = [i for i, (name, _) in enumerate(ops) if err != errno.ENOSPC or name in SPACE]
    assert len(targets) >= 6
    for i in targets:
        try:
            fail_then_recover(kit, tmp_path / f"op{i}", first, i, err)
        except AssertionError as e:
            raise AssertionError(f"{errno.errorcode[err]} at operation {i} ({ops[i][0]}): {e}") from e


@pytest.mark.parametrize("first", [False, True], ids=["existing-files", "first-checkpoint"])
def test_a_disk_that_stays_full(kit, tmp_path, first):
    ops = checkpoint_ops(kit, tmp_path, first)
    first_write = next(i for i, (name, _) in enumerate(ops) if name == "pwrite")
    fail_then_recover(kit, tmp_path / "full", first, first_write, errno.ENOSPC, sticky=True)


def test_a_failed_fsync_is_never_retried_on_the_same_data(kit, tmp_path):
    """The fsyncgate lesson, directly: after an EIO from fsync the layer forgets the pages; a
    store that retried the fsync (or committed anyway) would lose the checkpoint at power loss."""
    ops = checkpoint_ops(kit, tmp_path, False)
    for i in [i for i, (name, _) in enumerate(ops) if name == "fsync"]:
        fail_then_recover(kit, tmp_path / f"fsync{i}", False, i, errno.EIO)


# -- a full disk during the other writing verbs ---------------------------------------------------------
def verb_ops(kit, verb: str) -> list[tuple[str, str]]:
    return kit.ops(verb)[0]


def enospc_during(kit, tmp_path, verb: str, every: bool) -> None:
    """StoreFull, nothing half-committed, no temp files; once space is back the verb succeeds."""
    ops = verb_ops(kit, verb)
    template, floors = kit.template(verb)
    targets = [i for i, (name, _) in enumerate(ops) if name in SPACE]
    for i in targets if every else targets[:: max(1, len(targets) // 12)]:
        root = tmp_path / f"op{i}"
        fs = FaultyIO()
        store, action, base = torture.start_verb(torture.copy_template(template, root), kit.model, verb, fs)
        fs.fail(base + i, errno.ENOSPC, sticky=True)
        with fileio.use(fs):
            try:
                action()
            except StoreFull:
                pass
            except OSError as e:
                raise AssertionError(f"ENOSPC at operation {i} of {verb} ({ops[i][0]}) came out as {e!r}") from e
            fs.heal()
        fs.process_death()  # a verb that failed half-way may hold its session open: let it go
        store.close()
        try:
            torture.check(root, kit.model, kit.ref, verb, floors, acked=False)
        except AssertionError as e:
            raise AssertionError(f"after ENOSPC at operation {i} of {verb} ({ops[i][0]}): {e}") from e


WRITING_VERBS = ["pack", "import", "fork", "create"]


@pytest.mark.parametrize("verb", WRITING_VERBS)
def test_enospc_during_a_writing_verb_is_store_full(kit, tmp_path, verb):
    enospc_during(kit, tmp_path, verb, every=False)


@pytest.mark.slow
@pytest.mark.parametrize("verb", WRITING_VERBS)
def test_enospc_at_every_operation_of_a_writing_verb_is_store_full(kit, tmp_path, verb):
    enospc_during(kit, tmp_path, verb, every=True)


def test_enospc_at_every_operation_of_an_export_says_the_archive_was_not_written(kit, tmp_path):
    """A full disk where the archive goes: an OSError naming the archive, no temp file and no archive
    (or, when only the folder's sync after the rename failed, the archive and a warning); the store
    untouched; with space back, the export succeeds."""
    ops = verb_ops(kit, "export")
    template, floors = kit.template("export")
    for i in [i for i, (name, _) in enumerate(ops) if name in SPACE]:
        root = tmp_path / f"op{i}"
        fs = FaultyIO()
        store, action, base = torture.start_verb(torture.copy_template(template, root), kit.model, "export", fs)
        fs.fail(base + i, errno.ENOSPC, sticky=True)
        with fileio.use(fs):
            with pytest.raises(OSError) as raised:
                action()
            fs.heal()
        error, renamed = raised.value, i == len(ops) - 1  # the last operation syncs the renamed name
        assert error.errno == errno.ENOSPC and error.filename == str(root / "out.kvs"), (ops[i], error)
        assert ("syncing its folder failed" if renamed else "archive was not written") in str(error), ops[i]
        assert (root / "out.kvs").exists() == renamed and not list(root.glob(".out.kvs.*")), ops[i]
        action()
        store.close()
        torture.check(root, kit.model, kit.ref, "export", floors, acked=True)
