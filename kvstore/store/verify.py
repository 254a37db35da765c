"""`verify`: read back every byte a session depends on and check the index agrees with itself.

Per session: its head checkpoint exists, its token blocks are contiguous and count n_tokens, its
extents tile [0, n_cached) without gaps, it holds the last token's state exactly when every token is
cached (C2), every extent's bytes (raw files or packed blob) match their checksums, and its model
is recorded. Problems are reported per session, never raised, so one damaged session does not hide
the others; a session deleted while it is checked is left out.

Each extent is read and checksummed once per run, however many sessions use it (forks share their
parent's): a damaged extent is reported for every session that uses it, named as that session's.
Progress counts each extent's KV bytes once.
"""

from __future__ import annotations

from sqlalchemy import func, select

from ..errors import CorruptData
from .codec import ITEMSIZE
from .extents import ExtentRef, extent_label, kv_bytes, read_layers_unlocked, session_extents
from .index import CheckpointRow, ModelRow, SessionRow
from .progress import Progress, Tally
from .records import last_state_problem, read_tokens


class Extents:
    """The distinct extents of the sessions checked, each with the sessions that use it."""

    def __init__(self) -> None:
        self.refs: dict[int, ExtentRef] = {}
        self.users: dict[int, list[SessionRow]] = {}

    def add(self, row: SessionRow, ref: ExtentRef) -> None:
        self.refs.setdefault(ref.extent_id, ref)
        self.users.setdefault(ref.extent_id, []).append(row)

    def total(self) -> int:
        return sum(kv_bytes(ref) for ref in self.refs.values())


def verify_store(store, name: str | None = None, progress: Progress | None = None) -> dict[str, list[str]]:
    """Problems per session (`name`, or every one); `progress(done, total)` gets the KV bytes of the
    distinct extents checked so far."""
    with store.db() as db:
        rows = [store.row(db, name)] if name is not None else \
            list(db.scalars(select(SessionRow).order_by(SessionRow.name)))
        models = {m.fingerprint: m for m in db.scalars(select(ModelRow))}
    extents = Extents()
    problems = {row.id: index_problems(store, row, models.get(row.model_fingerprint), extents) for row in rows}
    checked = Tally(progress, extents.total())
    for extent_id, ref in sorted(extents.refs.items(), key=lambda e: (e[1].segment_id, e[1].offset)):
        users = extents.users[extent_id]
        for user, problem in read_problems(store, ref, users):
            problems[user.id].append(problem)
        checked.add(kv_bytes(ref))
    return {row.name: problems[row.id] for row in rows
            if not problems[row.id] or store.still_there(row.id)}  # deleted while being read: nothing to report


def index_problems(store, row: SessionRow, model_row: ModelRow | None, extents: Extents) -> list[str]:
    """What is wrong with the session's rows; its extent references go into `extents`, to be read."""
    problems: list[str] = []
    with store.db() as db:
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
        extents.add(row, ref)
    if position != row.n_cached:
        problems.append(f"extents cover {position} positions, head says {row.n_cached}")
    return problems


def read_problems(store, ref: ExtentRef, users: list[SessionRow]) -> list[tuple[SessionRow, str]]:
    """Read the extent once (checksums verified); when it is damaged, the problem for each user,
    in that session's name."""
    first = users[0]
    try:
        read_layers_unlocked(store, ref, ITEMSIZE[first.dtype], session=first.name)
    except CorruptData as e:
        message, own = str(e), extent_label(first.name, ref.extent_id)
        return [(user, message.replace(own, extent_label(user.name, ref.extent_id), 1)) for user in users]
    return []
