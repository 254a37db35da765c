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
change it is given must not move meanwhile: its KV rows are copied first. The checkpoint counts as
done (acknowledged) only once the future has its head: the session keeps the old head until then.

The statements are built once with bound parameters and run on the driver's cursor of the
transaction's connection (`store.prepared`): this runs at every checkpoint of a decode, on a thread
that takes CPU (and the GIL) from it, where the ORM's unit of work, or even `Connection.execute`,
costs more than the SQL. For the same reason the KV rows of all layers are copied into one tensor
(`commit_later`), whose bytes `segments.layer_bytes` takes at once.
"""

from __future__ import annotations

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


def commit(store, session_id: str, name: str, head: Head, change: Change) -> Head:
    """Commit `change` (see the module's docstring); the new head. SessionBusy, with nothing
    written, when another writer moved the head since `head`; StoreFull when the disk is full."""
    n_tokens = len(change.tokens)
    with store_full_on_disk_full(f"checkpoint of {name!r}"), store.engine.begin() as db:
        moved = HEAD_MOVES(db, {
            "p_id": session_id, "p_head": head.seq, "head": head.seq + 1, "n_tokens": n_tokens,
            "n_cached": change.n_cached, "active_call": change.active_call, "last_hidden": change.hidden,
            "sampler": change.sampler, "checkpoint_every": change.checkpoint_every, "n_reusable": change.n_reusable,
            "updated_at": utcnow()})
        if moved.rowcount != 1:
            raise SessionBusy(f"session {name!r} was changed or deleted by someone else since it was "
                              "opened; nothing was committed. Open it again")
        end, appending = head.committed_end, None
        if change.kv is not None:
            layers = (change.kv.to("cpu").contiguous() if isinstance(change.kv, torch.Tensor)
                      else [t.to("cpu").contiguous() for t in change.kv])
            appending = segments.start_append(store.session_dir(session_id), head.committed_end, layers,
                                              names_synced=head.names_synced)
            end = appending.written.end
        try:  # the rows, while the layer files sync
            _add_rows(db, session_id, head, change, appending.written if appending else None)
        except Exception:
            if appending is not None:
                appending.abandon()
            raise
        if appending is not None:
            appending.finish()  # durable before the commit (C4)
    return replace(head, seq=head.seq + 1, n_tokens=n_tokens, n_cached=change.n_cached, committed_end=end,
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
    of a Change is not changed by its maker. Once the interpreter is shutting down the commit runs
    here."""
    if change.kv is not None and not (change.kv_owned and _on_cpu(change.kv)):
        # a list is copied by the stack; a tensor (a paged cache's rows on a GPU) only on its way to the CPU
        kv = change.kv if isinstance(change.kv, torch.Tensor) else torch.stack(list(change.kv))
        change = replace(change, kv=kv.to("cpu", copy=kv is change.kv), kv_owned=True)
    try:
        return serial(COMMITTER).submit(lambda: commit_now(store, session_id, name, head, change).result())
    except RuntimeError:  # no new threads' work at shutdown
        return commit_now(store, session_id, name, head, change)


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
