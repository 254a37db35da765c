"""The checkpoint protocol (contracts C2, C4, C5): what one checkpoint commits, and in what order.

A writer keeps the `Head` it last committed; a checkpoint hands `commit` the `Change` since then:
the token ids, the KV rows computed since (positions head.n_cached..n_cached), the last token's
final hidden state when every token is fed (else the last token is pending: C2), the chat messages
that changed, the generation in progress and the sampler settings. Then, in one index transaction:

1. the head moves with a compare-and-set on (session id, head seq): a second writer (one without
   the flock, say on shared storage) fails here, before writing a byte, so it can never overwrite
   an extent the winner committed (C7);
2. the new KV is appended to the session's own per-layer files, page-aligned after the committed
   end (C5), and their fsync (with the folder's when files were created) starts on the syncing
   thread (`segments.start_append`), while the transaction holds the index's write lock;
3. the rows that point at it, inserted while the files sync: the checkpoint, the extent and its
   place in the session, the new token ids, the messages, the prefix keys of the chunk boundaries
   that became reusable (C10);
4. commit, once the sync has finished (C4): a crash at any instant leaves the old head or the new
   one. A failed sync undoes the append and rolls back; a failed insert rolls back, and the bytes
   left past the committed end are dropped by the next open.

`commit_later` runs the same `commit` on the committing thread (one per process, commits in the
order handed over) and returns at once: a generation goes on decoding while its automatic
checkpoint's files and index sync, instead of waiting for two durable flushes every interval. The
checkpoints handed over while that thread was busy (sessions decoding in one batched step reach
theirs together) are committed together, steps 1-4 each taken once for all of them: one
transaction, one sync (`commit_group`), each checkpoint's outcome its own. The
change it is given must not move meanwhile: its KV rows are copied first. The checkpoint counts as
done (acknowledged) only once the future has its head: the session keeps the old head until then.

The statements are built once with bound parameters and run on the driver's cursor of the
transaction's connection (`store.prepared`): this runs at every checkpoint of a decode, on a thread
that takes CPU (and the GIL) from it, where the ORM's unit of work, or even `Connection.execute`,
costs more than the SQL. For the same reason the KV rows of all layers are copied into one tensor
(`commit_later`), whose bytes `segments.layer_bytes` takes at once.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from sqlalchemy import bindparam, delete, insert, update

from .errors import SessionBusy
from .store import segments
from .store.index import (CheckpointRow, ExtentRow, MessageRow, PrefixKeyRow, SegmentRow, SessionExtentRow, SessionRow,
                          TokenBlockRow, store_full_on_disk_full, utcnow)
from .store.prepared import Prepared
from .store.records import encode_tokens
from .store.workers import serial

COMMITTER = "kvstore-commit"  # the committing thread's name
MAX_GROUP = 64  # checkpoints committed together at most (`commit_group`)

# The head moves with a compare-and-set on (id, head); `p_` names the WHERE parameters (a SET
# column's own name is taken).
_S = SessionRow.__table__
HEAD_MOVES = Prepared(update(_S).where(_S.c.id == bindparam("p_id"), _S.c.head == bindparam("p_head")))
SEGMENT_GROWS = Prepared(update(SegmentRow.__table__).where(SegmentRow.__table__.c.id == bindparam("p_id")))
ADD_CHECKPOINT = Prepared(insert(CheckpointRow.__table__))
ADD_EXTENT = Prepared(insert(ExtentRow.__table__).returning(ExtentRow.__table__.c.id))
ADD_SESSION_EXTENT = Prepared(insert(SessionExtentRow.__table__))
ADD_TOKENS = Prepared(insert(TokenBlockRow.__table__))
ADD_PREFIX_KEYS = Prepared(insert(PrefixKeyRow.__table__))
_M = MessageRow.__table__
DROP_MESSAGE = Prepared(delete(_M).where(_M.c.session_id == bindparam("p_session"),
                                         _M.c.ordinal == bindparam("p_ordinal")))
ADD_MESSAGE = Prepared(insert(_M))


@dataclass(frozen=True)
class Head:
    """The session's head as this writer last committed it (or found it when opening)."""
    seq: int  # the head checkpoint's seq: what the compare-and-set expects
    n_tokens: int
    n_cached: int  # positions whose KV is on disk
    committed_end: int  # bytes of each of the session's own layer files in use
    n_reusable: int = 0  # leading positions whose KV is a cold run's (C10: keyed at chunk boundaries)
    names_synced: bool = False  # this writer has fsynced its segment's directory entries


@dataclass
class Change:
    """What one checkpoint commits on top of a Head."""
    reason: str  # recorded with the checkpoint: new, tokens, prefill, call, auto, end, fork, pack, close, ...
    tokens: list[int]  # every token id; those past head.n_tokens are new
    # the new KV rows: per layer `[n_cached - head.n_cached, 2, n_kv, hd]`, as a list or stacked in one tensor
    kv: list[torch.Tensor] | torch.Tensor | None
    n_cached: int
    hidden: bytes | None  # the last token's final state (`hidden_bytes`) when n_cached == len(tokens) > 0
    active_call: dict[str, Any] | None
    sampler: dict[str, Any]
    checkpoint_every: int
    messages: list[dict[str, Any]] = field(default_factory=list)  # the changed ones (MESSAGE_FIELDS)
    n_reusable: int = 0  # leading positions whose KV is a cold run's (`Sequence.reusable`)
    prefix_keys: list[tuple[int, str]] = field(default_factory=list)  # (boundary, key) new since the head
    kv_owned: bool = False  # kv holds copies of its own (a paged cache's `state`), not views of the cache


@dataclass(frozen=True)
class ToCommit:
    """One session's checkpoint handed to `commit_group`."""
    session_id: str
    name: str
    head: Head
    change: Change


def commit(store, session_id: str, name: str, head: Head, change: Change) -> Head:
    """Commit `change` (see the module's docstring); the new head. SessionBusy, with nothing
    written, when another writer moved the head since `head`; StoreFull when the disk is full."""
    outcome = _commit_together(store, [ToCommit(session_id, name, head, change)])[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def commit_group(store, checkpoints: list[ToCommit]) -> list[Head | Exception]:
    """Commit the checkpoints of several sessions of one store (a group commit): each one's outcome,
    its new head or its error, as `commit` gives it alone. Together they take one transaction and
    one sync (`segments.start_sync`), where each alone takes its own begin, commit and sync: the
    committing thread's CPU and the file system's journal commits, beside the decode, once for all
    the checkpoints that queued while the one before committed. A moved head (SessionBusy) fails its
    own checkpoint only; a failure of the begin (the index's lock not given in time) fails all of
    them; any other (a full disk, a failed insert) rolls the group back, and each is then committed
    alone, so that it fails the checkpoint it belongs to and no other."""
    if len(checkpoints) > 1:
        began: list[bool] = []
        try:
            return _commit_together(store, checkpoints, began)
        except Exception as e:  # noqa: BLE001 -- each one's own outcome below
            if not began:
                return [e] * len(checkpoints)
    outcomes: list[Head | Exception] = []
    for c in checkpoints:
        try:
            outcomes.append(commit(store, c.session_id, c.name, c.head, c.change))
        except Exception as e:  # noqa: BLE001 -- this checkpoint's outcome
            outcomes.append(e)
    return outcomes


def _commit_together(store, checkpoints: list[ToCommit], began: list[bool] | None = None) -> list[Head | SessionBusy]:
    """The module's steps 1-4 for all of `checkpoints` in one transaction: every head moved and every
    extent written, one sync started for all, every one's rows inserted while it runs, commit once
    it has finished. A head found moved is that checkpoint's outcome (SessionBusy) and the others
    go on; any other failure is raised, with nothing committed. `began` gets an item once the
    transaction has begun."""
    outcomes: list[Head | SessionBusy | None] = [None] * len(checkpoints)
    written: dict[int, segments.Appending] = {}
    what = (f"checkpoint of {checkpoints[0].name!r}" if len(checkpoints) == 1
            else f"checkpoints of {len(checkpoints)} sessions")
    try:
        with store_full_on_disk_full(what), store.engine.begin() as db:
            if began is not None:
                began.append(True)
            for i, c in enumerate(checkpoints):
                if not _head_moves(db, c):
                    outcomes[i] = SessionBusy(f"session {c.name!r} was changed or deleted by someone else since it "
                                              "was opened; nothing was committed. Open it again")
                elif c.change.kv is not None:  # on the CPU (`write_extent` takes the bytes of contiguous rows)
                    kv = c.change.kv
                    layers = kv.to("cpu") if isinstance(kv, torch.Tensor) else [t.to("cpu") for t in kv]
                    written[i] = segments.write_extent(store.session_dir(c.session_id), c.head.committed_end, layers,
                                                       names_synced=c.head.names_synced)
            segments.start_sync(list(written.values()))
            for i, c in enumerate(checkpoints):  # the rows, while the layer files sync
                if outcomes[i] is None:
                    _add_rows(db, c.session_id, c.head, c.change, written[i].written if i in written else None)
            for appending in written.values():
                appending.finish()  # durable before the commit (C4)
    except BaseException:
        for appending in written.values():
            appending.abandon()
        raise
    return [outcome if outcome is not None else _new_head(c, written.get(i))
            for i, (c, outcome) in enumerate(zip(checkpoints, outcomes))]


def _head_moves(db, c: ToCommit) -> bool:
    """Step 1: the compare-and-set of the head; False when another writer moved it."""
    change = c.change
    moved = HEAD_MOVES(db, {
        "p_id": c.session_id, "p_head": c.head.seq, "head": c.head.seq + 1, "n_tokens": len(change.tokens),
        "n_cached": change.n_cached, "active_call": change.active_call, "last_hidden": change.hidden,
        "sampler": change.sampler, "checkpoint_every": change.checkpoint_every, "n_reusable": change.n_reusable,
        "updated_at": utcnow()})
    return moved.rowcount == 1


def _new_head(c: ToCommit, appending: segments.Appending | None) -> Head:
    head, change = c.head, c.change
    return replace(head, seq=head.seq + 1, n_tokens=len(change.tokens), n_cached=change.n_cached,
                   committed_end=appending.written.end if appending is not None else head.committed_end,
                   n_reusable=change.n_reusable, names_synced=head.names_synced or change.kv is not None)


def commit_now(store, session_id: str, name: str, head: Head, change: Change) -> "Future[tuple[Head, float]]":
    """`commit` here: a done future of (the new head, the seconds the commit took), or of its error."""
    done: Future = Future()
    started = time.perf_counter()
    try:
        done.set_result((commit(store, session_id, name, head, change), time.perf_counter() - started))
    except BaseException as e:  # noqa: BLE001 -- the caller's, through the future
        done.set_exception(e)
    return done


def commit_later(store, session_id: str, name: str, head: Head, change: Change) -> "Future[tuple[Head, float]]":
    """`commit_now` on the committing thread: its future at once. The change's KV rows are copied
    here first, all layers into one CPU tensor (the cache they are views of may be trimmed and
    written again meanwhile), unless they are CPU copies of their own already (`kv_owned`); the rest
    of a Change is not changed by its maker. The committing thread takes every checkpoint handed
    over while it was busy at once, and commits those of one store together (`commit_group`).
    Once the interpreter is shutting down the commit runs here."""
    if change.kv is not None and not (change.kv_owned and _on_cpu(change.kv)):
        # a list is copied by the stack; a tensor (a paged cache's rows on a GPU) only on its way to the CPU
        kv = change.kv if isinstance(change.kv, torch.Tensor) else torch.stack(list(change.kv))
        change = replace(change, kv=kv.to("cpu", copy=kv is change.kv), kv_owned=True)
    done: Future = Future()
    with _handed_lock:
        _handed.append(_Handed(store, ToCommit(session_id, name, head, change), done))
    try:
        serial(COMMITTER).submit(_commit_handed)
    except RuntimeError:  # no new threads' work at shutdown
        _commit_handed()
    return done


@dataclass
class _Handed:
    store: Any
    checkpoint: ToCommit
    done: Future


_handed: list[_Handed] = []  # checkpoints handed over (`commit_later`) that the committing thread has not taken yet
_handed_lock = threading.Lock()


def _forget_handed() -> None:  # in a forked child: the parent's checkpoints are the parent's to commit
    global _handed, _handed_lock
    _handed, _handed_lock = [], threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_handed)


def _commit_handed() -> None:
    """Take every checkpoint handed over so far and commit them, in the order handed, in groups
    (`commit_group`) of one store and distinct sessions; each future gets its outcome, and as the
    seconds its commit took those of its group. A call that finds them taken by the one before does
    nothing."""
    with _handed_lock:
        taken, _handed[:] = list(_handed), []
    groups: list[list[_Handed]] = []
    for h in taken:
        group = groups[-1] if groups else None
        if (group is None or group[0].store is not h.store or len(group) >= MAX_GROUP
                or any(g.checkpoint.session_id == h.checkpoint.session_id for g in group)):
            groups.append([h])
        else:
            group.append(h)
    for group in groups:
        started = time.perf_counter()
        try:
            outcomes = commit_group(group[0].store, [h.checkpoint for h in group])
        except BaseException as e:  # noqa: BLE001 -- every caller's, through its future
            outcomes = [e] * len(group)
        seconds = time.perf_counter() - started
        for h, outcome in zip(group, outcomes):
            if isinstance(outcome, BaseException):
                h.done.set_exception(outcome)
            else:
                h.done.set_result((outcome, seconds))


def _on_cpu(kv: list[torch.Tensor] | torch.Tensor) -> bool:
    return kv.device.type == "cpu" if isinstance(kv, torch.Tensor) else all(t.device.type == "cpu" for t in kv)


def _add_rows(db, session_id: str, head: Head, change: Change, written: segments.Written | None) -> None:
    """Insert the checkpoint's rows (see the module's docstring, step 3)."""
    n_tokens = len(change.tokens)
    ADD_CHECKPOINT(db, {"session_id": session_id, "seq": head.seq + 1, "n_tokens": n_tokens,
                        "n_cached": change.n_cached, "reason": change.reason, "created_at": utcnow()})
    if written is not None:
        SEGMENT_GROWS(db, {"p_id": session_id, "committed_end": written.end})
        extent_id = ADD_EXTENT(db, {"segment_id": session_id, "offset": written.offset, "n_tokens": written.n_tokens,
                                    "checksums": written.checksums}).fetchone()[0]
        ADD_SESSION_EXTENT(db, {"session_id": session_id, "start": head.n_cached, "extent_id": extent_id,
                                "n_tokens": change.n_cached - head.n_cached})
    if n_tokens > head.n_tokens:
        ADD_TOKENS(db, {"session_id": session_id, "start": head.n_tokens,
                        "ids": encode_tokens(change.tokens[head.n_tokens:])})
    if change.prefix_keys:
        ADD_PREFIX_KEYS(db, [{"session_id": session_id, "position": b, "key": k} for b, k in change.prefix_keys])
    for m in change.messages:
        DROP_MESSAGE(db, {"p_session": session_id, "p_ordinal": m["ordinal"]})
        ADD_MESSAGE(db, {"session_id": session_id, **m})


def hidden_bytes(hidden: torch.Tensor) -> bytes:
    """A final hidden state `[hidden]` as the raw bytes the index keeps (`sessions.last_hidden`)."""
    return hidden.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
