"""`verify`: read back every byte a session depends on and check the index agrees with itself.

Per session: its head checkpoint exists, its token blocks are contiguous and count n_tokens, its
extents tile [0, n_cached) without gaps, it holds the last token's state exactly when every token is
cached (C2), every extent's bytes (raw files or packed blob) match
their checksums, and its model is recorded. Problems are reported per session, never raised, so
one damaged session does not hide the others.
"""

from __future__ import annotations

from sqlalchemy import func, select

from ..errors import CorruptData
from .codec import ITEMSIZE
from .extents import kv_bytes, read_layers_unlocked, session_extents
from .index import CheckpointRow, ModelRow, SessionRow
from .progress import Progress, Tally
from .records import last_state_problem, read_tokens


def verify_store(store, name: str | None = None, progress: Progress | None = None) -> dict[str, list[str]]:
    """Problems per session; `progress(done, total)` gets the KV bytes checked so far, all sessions
    together (an extent shared by forks counts once per session: each reads it)."""
    with store.db() as db:
        if name is not None:
            rows = [store.row(db, name)]
        else:
            rows = list(db.scalars(select(SessionRow).order_by(SessionRow.name)))
        total = sum(kv_bytes(ref) for row in rows for ref in session_extents(db, row.id))
    checked = Tally(progress, total)
    report = {}
    for row in rows:
        problems = verify_session(store, row, checked)
        if problems and not store.still_there(row.id):  # deleted while being read: nothing to report
            continue
        report[row.name] = problems
    return report


def verify_session(store, row: SessionRow, checked: Tally | None = None) -> list[str]:
    problems: list[str] = []
    with store.db() as db:
        model_row = db.get(ModelRow, row.model_fingerprint)
        if model_row is None:
            problems.append(f"model {row.model_fingerprint} is not recorded in the index")
        top = db.scalar(select(func.max(CheckpointRow.seq)).where(CheckpointRow.session_id == row.id))
        if top != row.head:
            problems.append(f"head is checkpoint {row.head} but the newest recorded is {top}")
        try:
            n_tokens = len(read_tokens(db, row.id))
        except CorruptData as e:
            n_tokens = -1
            problems.append(str(e))
        if n_tokens >= 0 and n_tokens != row.n_tokens:
            problems.append(f"{n_tokens} token ids stored, head says {row.n_tokens}")
        hidden_size = model_row.config.get("hidden_size") if model_row is not None else None
        if problem := last_state_problem(row.n_tokens, row.n_cached, row.last_hidden,
                                         hidden_size * ITEMSIZE[row.dtype] if hidden_size else None):
            problems.append(problem)
        refs = session_extents(db, row.id)
    position = 0
    for ref in refs:
        if ref.start != position:
            problems.append(f"KV gap or overlap at position {position} (extent {ref.extent_id} starts at {ref.start})")
        if ref.n_tokens > ref.extent_tokens:
            problems.append(f"extent {ref.extent_id} is used for {ref.n_tokens} tokens but holds {ref.extent_tokens}")
        position = ref.start + ref.n_tokens
        try:
            read_layers_unlocked(store, ref, ITEMSIZE[row.dtype], session=row.name)
        except CorruptData as e:
            problems.append(str(e))
        if checked is not None:
            checked.add(kv_bytes(ref))
    if position != row.n_cached:
        problems.append(f"extents cover {position} positions, head says {row.n_cached}")
    return problems

