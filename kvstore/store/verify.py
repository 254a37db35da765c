"""`verify`: read back every byte a session depends on and check the index agrees with itself.

Per session: its head checkpoint exists, its token blocks are contiguous and count n_tokens, its
extents tile [0, n_cached) without gaps, it holds the last token's state exactly when every token is
cached (C2), every extent's bytes (raw files or packed blob) match their checksums, and its model
is recorded. Problems are reported per session, never raised, so one damaged session does not hide
the others; a session deleted while it is checked is left out.

Cost: the index is read CHUNK sessions at a time (in name order, a transaction of five queries
each, so writers wait at most that long), and each extent is read and checksummed once per run,
however many sessions use it (forks share their parent's): a damaged extent is reported for every
session that uses it, named as that session's. Progress counts each extent's KV bytes once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from ..errors import CorruptData
from .codec import ITEMSIZE
from .extents import ExtentRef, extent_label, kv_bytes, read_layers_unlocked
from .index import (BlobRow, CheckpointRow, ExtentBlobRow, ExtentRow, ModelRow, SegmentRow, SessionExtentRow,
                    SessionRow, TokenBlockRow)
from .progress import Progress, Tally
from .records import TOKEN_ID_BYTES, last_state_problem, token_gap

CHUNK = 1000  # sessions whose index rows one transaction reads


@dataclass
class Chunk:
    """The index rows verify needs of up to CHUNK sessions, by session id."""
    rows: list[Any]  # (id, name, model_fingerprint, dtype, head, n_tokens, n_cached, last_hidden)
    tops: dict[str, int] = field(default_factory=dict)  # newest checkpoint seq
    blocks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # token blocks: (start, bytes)
    refs: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)  # (start, n, extent, its n)
    extents: dict[int, ExtentRef] = field(default_factory=dict)  # the extents they use


class Users:
    """The distinct extents of the sessions checked, each with the sessions (id, name, dtype) that use it."""

    def __init__(self) -> None:
        self.refs: dict[int, ExtentRef] = {}
        self.users: dict[int, list[tuple[str, str, str]]] = {}

    def add(self, row, extent_id: int, ref: ExtentRef) -> None:
        self.refs.setdefault(extent_id, ref)
        self.users.setdefault(extent_id, []).append((row.id, row.name, row.dtype))

    def total(self) -> int:
        return sum(kv_bytes(ref) for ref in self.refs.values())


def verify_store(store, name: str | None = None, progress: Progress | None = None) -> dict[str, list[str]]:
    """Problems per session (`name`, or every one); `progress(done, total)` gets the KV bytes of the
    distinct extents checked so far."""
    with store.db() as db:
        if name is not None:
            store.row(db, name)  # SessionNotFound, with what to do
        hidden_sizes = {m.fingerprint: m.config.get("hidden_size") for m in db.scalars(select(ModelRow))}
    users, problems, names = Users(), {}, {}
    after = None
    while (chunk := read_chunk(store, name, after)) is not None:
        for row in chunk.rows:
            names[row.id] = row.name
            problems[row.id] = index_problems(row, chunk, hidden_sizes)
            for _, _, extent_id, _ in chunk.refs.get(row.id, []):
                users.add(row, extent_id, chunk.extents[extent_id])
        after = chunk.rows[-1].name
        if name is not None:
            break
    checked = Tally(progress, users.total())
    for extent_id, ref in sorted(users.refs.items(), key=lambda e: (e[1].segment_id, e[1].offset)):
        for session_id, problem in read_problems(store, ref, users.users[extent_id]):
            problems[session_id].append(problem)
        checked.add(kv_bytes(ref))
    return {names[sid]: found for sid, found in problems.items()
            if not found or store.still_there(sid)}  # deleted while being read: nothing to report


def read_chunk(store, name: str | None, after: str | None) -> Chunk | None:
    """The session `name`, or the next CHUNK sessions after `after`, with their rows (one transaction)."""
    query = select(SessionRow.id, SessionRow.name, SessionRow.model_fingerprint, SessionRow.dtype, SessionRow.head,
                   SessionRow.n_tokens, SessionRow.n_cached, SessionRow.last_hidden).order_by(SessionRow.name)
    if name is not None:
        query = query.where(SessionRow.name == name)
    elif after is not None:
        query = query.where(SessionRow.name > after)
    with store.db() as db:
        rows = db.execute(query.limit(CHUNK)).all()
        if not rows:
            return None
        span = SessionRow.name.between(rows[0].name, rows[-1].name)
        chunk = Chunk(rows)
        chunk.tops = dict(db.execute(select(CheckpointRow.session_id, func.max(CheckpointRow.seq))
                                     .join(SessionRow, SessionRow.id == CheckpointRow.session_id).where(span)
                                     .group_by(CheckpointRow.session_id)).all())
        for sid, start, size in db.execute(select(TokenBlockRow.session_id, TokenBlockRow.start,
                                                  func.length(TokenBlockRow.ids))
                                           .join(SessionRow, SessionRow.id == TokenBlockRow.session_id).where(span)
                                           .order_by(TokenBlockRow.session_id, TokenBlockRow.start)):
            chunk.blocks.setdefault(sid, []).append((start, size))
        used = (select(SessionExtentRow.session_id, SessionExtentRow.start, SessionExtentRow.n_tokens,
                       SessionExtentRow.extent_id)
                .join(ExtentRow, ExtentRow.id == SessionExtentRow.extent_id)
                .join(SegmentRow, SegmentRow.id == ExtentRow.segment_id)  # as extents.session_extents reads them
                .join(SessionRow, SessionRow.id == SessionExtentRow.session_id).where(span))
        for sid, start, n, extent_id, extent_tokens in db.execute(
                used.add_columns(ExtentRow.n_tokens).order_by(SessionExtentRow.session_id, SessionExtentRow.start)):
            chunk.refs.setdefault(sid, []).append((start, n, extent_id, extent_tokens))
        chunk.extents = _extents(db, used.with_only_columns(SessionExtentRow.extent_id))
    return chunk


def _extents(db, extent_ids) -> dict[int, ExtentRef]:
    """The extents whose ids `extent_ids` selects, each once, with where their bytes are."""
    rows = db.execute(select(ExtentRow.id, ExtentRow.segment_id, ExtentRow.offset, ExtentRow.n_tokens,
                             ExtentRow.checksums, SegmentRow.token_bytes, BlobRow)
                      .join(SegmentRow, SegmentRow.id == ExtentRow.segment_id)
                      .outerjoin(ExtentBlobRow, ExtentBlobRow.extent_id == ExtentRow.id)
                      .outerjoin(BlobRow, BlobRow.hash == ExtentBlobRow.blob_hash)
                      .where(ExtentRow.id.in_(extent_ids)))
    return {r.id: ExtentRef(0, r.n_tokens, r.id, r.segment_id, r.offset, r.n_tokens, list(r.checksums), r.token_bytes,
                            r.BlobRow) for r in rows}


def index_problems(row, chunk: Chunk, hidden_sizes: dict[str, int | None]) -> list[str]:
    """What is wrong with the session's rows."""
    problems: list[str] = []
    if row.model_fingerprint not in hidden_sizes:
        problems.append(f"model {row.model_fingerprint} is not recorded in the index")
    top = chunk.tops.get(row.id)
    if top != row.head:
        problems.append(f"head is checkpoint {row.head} but the newest recorded is {top}")
    problems += token_problems(chunk.blocks.get(row.id, []), row.n_tokens)
    hidden_size = hidden_sizes.get(row.model_fingerprint)
    if problem := last_state_problem(row.n_tokens, row.n_cached, row.last_hidden,
                                     hidden_size * ITEMSIZE[row.dtype] if hidden_size else None):
        problems.append(problem)
    return problems + tiling_problems(chunk.refs.get(row.id, []), row.n_cached)


def token_problems(blocks: list[tuple[int, int]], n_tokens: int) -> list[str]:
    """The token blocks (start, bytes) must follow each other exactly and hold n_tokens ids."""
    count = 0
    for start, size in blocks:
        if start != count:
            return [token_gap(start, count)]
        if size % TOKEN_ID_BYTES:
            return [f"the token block at position {start} holds {size} bytes, not whole token ids; the index is "
                    "damaged"]
        count += size // TOKEN_ID_BYTES
    return [] if count == n_tokens else [f"{count} token ids stored, head says {n_tokens}"]


def tiling_problems(refs: list[tuple[int, int, int, int]], n_cached: int) -> list[str]:
    """The extents (start, n_tokens, extent id, its tokens) must tile [0, n_cached)."""
    problems, position = [], 0
    for start, n, extent_id, extent_tokens in refs:
        if start != position:
            problems.append(f"KV gap or overlap at position {position} (extent {extent_id} starts at {start})")
        if n > extent_tokens:
            problems.append(f"extent {extent_id} is used for {n} tokens but holds {extent_tokens}")
        position = start + n
    if position != n_cached:
        problems.append(f"extents cover {position} positions, head says {n_cached}")
    return problems


def read_problems(store, ref: ExtentRef, users: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """Read the extent once (checksums verified); when it is damaged, (session id, problem) for each
    user, in that session's name."""
    _, first, dtype = users[0]
    try:
        read_layers_unlocked(store, ref, ITEMSIZE[dtype], session=first)
    except CorruptData as e:
        message, own = str(e), extent_label(first, ref.extent_id)
        return [(sid, message.replace(own, extent_label(user, ref.extent_id), 1)) for sid, user, _ in users]
    return []
