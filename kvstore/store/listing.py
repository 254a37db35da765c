"""Listing sessions: `SessionInfo` records, a page at a time, in a fixed number of index queries.

Contracts:
- Order: by name, as the index database orders text (SQLite: bytewise; PostgreSQL: the database's
  collation). The ORDER BY and the `name > cursor` test use the same order, so pages never repeat
  or skip a session that exists while they are read (keyset pagination, not OFFSET: a page costs
  the same at the end of the store as at its start).
- Cost: a page is two queries whatever the store's size: one for its rows (checkpoint count,
  parent name, model source and disk bytes as subqueries on indexed columns), one for the forks of
  its sessions (by the page's range of names). `count` is one query. No file is touched.
- Disk bytes, from the index alone: the session's own raw segment, `committed_end` bytes in each of
  its `n_layers` files, while any extent of that segment is unpacked (once all are packed, pack or
  gc frees the files: `pack.free_packed_segment`), plus the size of each distinct blob holding an
  extent the session uses. A fork owns no raw bytes until it writes; the blobs of its parent's
  packed extents count for it too (it reads them).
- `read_infos(db, name=...)` is the same read for one session, so `show` and `list` agree.
- Each page is read in one transaction of its own; nothing is held between pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, exists, func, select
from sqlalchemy.orm import Session as DB, aliased

from ..errors import InvalidArgument
from .index import (BlobRow, CheckpointRow, ExtentBlobRow, ExtentRow, ModelRow, SegmentRow, SessionExtentRow,
                    SessionRow)

PAGE_SIZE = 1000  # sessions per query when everything is listed


@dataclass
class SessionInfo:
    name: str
    id: str
    model: str
    model_source: str
    dtype: str
    weights: str  # how the model held its weight matrices (defaults.WEIGHT_FORMATS)
    n_tokens: int
    n_cached: int
    checkpoints: int
    disk_bytes: int
    parent: str | None
    fork_position: int | None
    forks: list[str]
    seed: int
    sampler: dict[str, Any]
    chunk_size: int  # prefill chunk, in tokens (a checkpoint after each)
    checkpoint_every: int  # generated tokens between automatic checkpoints
    active_call: dict[str, Any] | None
    created_at: str
    updated_at: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SessionPage:
    """Sessions in name order, and the cursor of the page after them (`after=next`): this page's
    last name, or None when no session follows."""
    sessions: list[SessionInfo]
    next: str | None


def check_page(limit: Any, after: Any) -> None:
    """InvalidArgument unless `limit` is a positive int (or None) and `after` a str (or None)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgument(f"limit must be a positive number of sessions (got {limit!r})")
    if after is not None and not isinstance(after, str):
        raise InvalidArgument(f"after must be a session name, the last one of the previous page (got {after!r})")


def read_page(db: DB, limit: int, after: str | None) -> SessionPage:
    """The first `limit` sessions named after `after` (from the start when None)."""
    infos = read_infos(db, after=after, limit=limit + 1)  # one more row says whether a next page exists
    if len(infos) <= limit:
        return SessionPage(infos, None)
    return SessionPage(infos[:limit], infos[limit - 1].name)


def read_infos(db: DB, *, name: str | None = None, after: str | None = None,
               limit: int | None = None) -> list[SessionInfo]:
    """The session `name`, or the sessions after `after` in name order (at most `limit`)."""
    query = _rows_query()
    if name is not None:
        query = query.where(SessionRow.name == name)
    elif after is not None:
        query = query.where(SessionRow.name > after)
    query = query.order_by(SessionRow.name)
    if limit is not None:
        query = query.limit(limit)
    rows = db.execute(query).all()
    if not rows:
        return []
    forks = _forks(db, rows[0].name, rows[-1].name)
    return [_info(r, forks.get(r.id, [])) for r in rows]


def count(db: DB) -> int:
    return db.scalar(select(func.count()).select_from(SessionRow))


def _rows_query():
    parent = aliased(SessionRow)
    checkpoints = (select(func.count()).select_from(CheckpointRow)
                   .where(CheckpointRow.session_id == SessionRow.id).scalar_subquery())
    return (select(SessionRow.id, SessionRow.name, SessionRow.model_fingerprint, SessionRow.dtype, SessionRow.weights,
                   SessionRow.n_tokens, SessionRow.n_cached, SessionRow.fork_position, SessionRow.seed,
                   SessionRow.sampler, SessionRow.chunk_size, SessionRow.checkpoint_every, SessionRow.active_call,
                   SessionRow.created_at, SessionRow.updated_at, ModelRow.source,
                   parent.name.label("parent"), checkpoints.label("checkpoints"),
                   _raw_bytes().label("raw_bytes"), _packed_bytes().label("packed_bytes"))
            .outerjoin(ModelRow, ModelRow.fingerprint == SessionRow.model_fingerprint)
            .outerjoin(parent, parent.id == SessionRow.parent_id)
            .outerjoin(SegmentRow, SegmentRow.id == SessionRow.id))


def _raw_bytes():
    """committed_end x n_layers of the session's own segment while it has an unpacked extent, else 0."""
    unpacked = exists().where(ExtentRow.segment_id == SessionRow.id,
                              ~exists().where(ExtentBlobRow.extent_id == ExtentRow.id))
    return case((unpacked, SegmentRow.committed_end * SegmentRow.n_layers), else_=0)


def _packed_bytes():
    """The sizes of the distinct blobs that hold extents the session uses."""
    blobs_used = (select(ExtentBlobRow.blob_hash)
                  .join(SessionExtentRow, SessionExtentRow.extent_id == ExtentBlobRow.extent_id)
                  .where(SessionExtentRow.session_id == SessionRow.id).correlate(SessionRow))
    return select(func.coalesce(func.sum(BlobRow.size), 0)).where(BlobRow.hash.in_(blobs_used)).scalar_subquery()


def _forks(db: DB, first: str, last: str) -> dict[str, list[str]]:
    """Names of the forks (in name order) of each session named from `first` to `last`, by parent id."""
    parent, child = aliased(SessionRow), aliased(SessionRow)
    out: dict[str, list[str]] = {}
    for parent_id, name in db.execute(select(child.parent_id, child.name)
                                      .join(parent, parent.id == child.parent_id)
                                      .where(parent.name >= first, parent.name <= last)
                                      .order_by(child.name)):
        out.setdefault(parent_id, []).append(name)
    return out


def _info(r, forks: list[str]) -> SessionInfo:
    return SessionInfo(
        name=r.name, id=r.id, model=r.model_fingerprint, model_source=r.source or "", dtype=r.dtype,
        weights=r.weights,
        n_tokens=r.n_tokens, n_cached=r.n_cached, checkpoints=r.checkpoints,
        disk_bytes=int(r.raw_bytes or 0) + int(r.packed_bytes or 0), parent=r.parent,
        fork_position=r.fork_position, forks=forks, seed=r.seed, sampler=dict(r.sampler),
        chunk_size=r.chunk_size, checkpoint_every=r.checkpoint_every, active_call=r.active_call,
        created_at=r.created_at.isoformat(timespec="seconds"), updated_at=r.updated_at.isoformat(timespec="seconds"))
