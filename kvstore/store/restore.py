"""Reading a session back for a writer: the model check, the snapshot of its rows, its KV cache
rebuilt from its extents (every checksum verified) and the last token's state (C2, C6).

`snapshot` reads everything a writer needs in one transaction that holds the index's write lock,
after dropping bytes a killed writer left past the committed end (no other writer's checkpoint is
half written then); `load_cache` fills a fresh cache of the model's from the extents;
`stored_hidden` turns the head's state bytes into a tensor. torch is imported by the functions
that make tensors only: the rest of the store never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Row, bindparam, select
from sqlalchemy.orm import Session as DB

from ..errors import CorruptData, ModelMismatch, SessionNotFound
from . import segments
from .extents import ExtentRef, load_into, session_extents
from .index import ModelRow, SegmentRow, SessionRow
from .records import kv_layout, last_state_problem, read_messages, read_tokens


HEAD = (select(*SessionRow.__table__.c, SegmentRow.committed_end).join(SegmentRow, SegmentRow.id == SessionRow.id)
        .where(SessionRow.id == bindparam("session_id")))  # made once, as the other statements of an open


def warm_statements(db: Connection) -> None:
    """Run an open's queries (`snapshot`'s) once for a session id that no session has: they find
    nothing, and SQLAlchemy has compiled each of them for this engine, which it does the first time
    an engine runs a statement (a process's first open of a session paid for four). Reads only."""
    nobody = ""  # ids are generated, never empty
    db.execute(HEAD, {"session_id": nobody}).first()
    read_tokens(db, nobody)
    session_extents(db, nobody)
    read_messages(db, nobody)


@dataclass
class Snapshot:
    row: Row  # the session's row: its columns by name, as a SessionRow has them (and committed_end)
    tokens: list[int]
    refs: list[ExtentRef]
    messages: list[dict[str, Any]]
    committed_end: int  # bytes of each of the session's own layer files in use


def snapshot(store, session_id: str, model) -> Snapshot:
    """The session's rows as one writer sees them, once `model` is known to be its own.

    Plain column queries on a connection, not ORM objects: an open is a few milliseconds, and the
    ORM's bookkeeping was a good part of them."""
    with store.engine.begin() as db:  # one snapshot, and the index's write lock while truncating
        row = db.execute(HEAD, {"session_id": session_id}).first()
        if row is None:
            raise SessionNotFound("the session was deleted while it was being opened")
        check_model(db, row, model)
        committed_end = row.committed_end
        segments.truncate_uncommitted(store.session_dir(session_id), committed_end)
        try:
            tokens = read_tokens(db, session_id)
        except CorruptData as e:
            raise CorruptData(f"session {row.name!r}: {e}") from None
        snap = Snapshot(row, tokens, session_extents(db, session_id), read_messages(db, session_id), committed_end)
    if len(tokens) != row.n_tokens:
        raise CorruptData(f"session {row.name!r}: the index holds {len(tokens)} token ids, its head says "
                          f"{row.n_tokens}; run `kvstore verify {row.name}`")
    return snap


def check_model(db: DB | Connection, row: SessionRow | Row, model) -> None:
    """ModelMismatch naming what differs between the session's model and `model`."""
    problems = []
    if row.model_fingerprint != model.fingerprint:
        stored = db.execute(select(ModelRow.config, ModelRow.source)
                            .where(ModelRow.fingerprint == row.model_fingerprint)).first()
        mine = model.config.to_dict()
        changed = [f"{k}: {stored.config.get(k)!r} vs {mine.get(k)!r}" for k in sorted(mine)
                   if stored is not None and stored.config.get(k) != mine.get(k)]
        what = ", ".join(changed) if changed else "same architecture and shapes, other weights"
        source = stored.source if stored is not None else "?"
        problems.append(f"it was made with model {row.model_fingerprint[:12]} ({source}), this one is "
                        f"{model.fingerprint[:12]} ({model.source}): {what}")
    if row.weights != model.weights:
        problems.append(f"it was made with the weights held {row.weights!r} ({_HELD[row.weights]}) but this model "
                        f"holds them {model.weights!r}: load it with weights={row.weights!r} (CLI: --weights "
                        f"{row.weights}), or fork it with weights={model.weights!r} to go on that way")
    if row.dtype != model.dtype_name:
        problems.append(f"its KV is {row.dtype} but the model is loaded as {model.dtype_name} "
                        f"(load it with dtype={row.dtype})")
    elif row.kv_layout != kv_layout(model):
        problems.append(f"its KV layout is {row.kv_layout}, the model's is {kv_layout(model)}")
    if problems:
        raise ModelMismatch(f"session {row.name!r} cannot continue with this model: " + "; ".join(problems))


_HELD = {"stored": "the file's quantized blocks, integer kernels", "dense": "dequantized",
         "q8_0": "quantized to Q8_0 on load"}


def stored_hidden(row: SessionRow | Row, model):
    """The final hidden state the head checkpoint holds (C2), as a fresh tensor on the model's device;
    None when the last token is pending. CorruptData if it is missing or not one hidden vector of the
    model's dtype."""
    if not row.n_tokens or row.n_cached < row.n_tokens:
        return None
    if problem := last_state_problem(row.n_tokens, row.n_cached, row.last_hidden, model.hidden_bytes):
        raise CorruptData(f"session {row.name!r}: {problem}; run `kvstore verify {row.name}`")
    import torch

    # a copy into fresh (aligned) memory: the bits a kernel gives must not depend on where its input sits
    return torch.frombuffer(bytearray(row.last_hidden), dtype=model.dtype).clone().to(model.device)


def load_shared_cache(store, session_id: str, name: str, refs: list[ExtentRef], model, n_cached: int):
    """`load_cache`, once more from the index if it fails: a fork's extents belong to its parent, and
    a pack of the parent (which holds the parent's lock, not ours) may have moved them into blobs and
    freed their raw files since `refs` was read. Damage fails the same way twice: CorruptData."""
    try:
        return load_cache(store.home, name, refs, model, n_cached)
    except CorruptData:
        with store.db() as db:
            now = session_extents(db, session_id)
        if _placement(now) == _placement(refs):
            raise
        return load_cache(store.home, name, now, model, n_cached)


def _placement(refs: list[ExtentRef]) -> list[tuple[int, str | None]]:
    """Which extents, and the blob each is packed in (None: in its raw files)."""
    return [(r.extent_id, r.blob.hash if r.blob is not None else None) for r in refs]


def load_cache(home: Path, name: str, refs: list[ExtentRef], model, n_cached: int):
    """The session's KVCache rebuilt from its extents, every checksum verified."""
    from ..engine.cache import with_room

    cache = model.new_cache(capacity=with_room(n_cached))
    load_into(cache, refs, home, session=name)
    if cache.length != n_cached:
        raise CorruptData(f"session {name!r}: its extents cover {cache.length} positions, the head says {n_cached}")
    return cache
