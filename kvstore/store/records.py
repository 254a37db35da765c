"""A session's rows in the index, built and read in one place (torch-free, like the whole store).

- names: `check_name` (labels only, never paths: C8) and `claim_name` (SessionExists, with what to
  do, when the name is taken);
- the one builder of a session's rows, `add_session` (new, fork, import: the session, its segment,
  its first checkpoint, its tokens), and `fork_rows` on top of it (KV extents and prefix keys
  shared by `share`, C5, C10);
- reading: `read_tokens` (CorruptData when the blocks do not tile), `read_messages` (columns, not
  ORM objects: they serve an ORM session or a plain connection, e.g. the open path's), `restated`
  (a message that restates the system message in effect and holds no tokens);
- contract C2 on a head: `last_state_problem`;
- what a session records of its model: `register_model`, `kv_layout`, `token_bytes`.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, select
from sqlalchemy.orm import Session as DB

from ..defaults import WEIGHT_FORMATS
from ..errors import CorruptData, InvalidArgument, InvalidName, SessionExists
from .index import (CheckpointRow, MessageRow, ModelRow, PrefixKeyRow, SegmentRow, SessionExtentRow, SessionRow,
                    TokenBlockRow, utcnow)

NAME = re.compile(r"[^\W_][\w.:@+-]{0,127}")
MESSAGE_FIELDS = ("ordinal", "role", "text", "token_start", "token_end")


def restated(message: dict[str, Any]) -> bool:
    """Whether a stored message (a dict of `MESSAGE_FIELDS`) restates the system message in effect
    (`Session.restate_system`): a system message past the first token that holds none. (A system
    message that a session was made with, pending until its first turn, sits at 0. One that a chat
    template rendered as nothing reads the same: left out of the history, it changes no rendering of
    a template that renders each message alone.)"""
    return message["role"] == "system" and message["token_start"] == message["token_end"] > 0


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) < 60 else repr(name)[:57] + "..."
        raise InvalidName(f"invalid session name {shown}: use 1-128 letters, digits and . _ : @ + -, "
                          "starting with a letter or digit")
    return name


def claim_name(db: DB, name: str, what_to_do: str = "pick another name") -> str:
    """`name`, checked and free in the index (in the caller's transaction); else SessionExists."""
    check_name(name)
    if db.scalar(select(SessionRow.id).where(SessionRow.name == name)) is not None:
        raise SessionExists(f"a session named {name!r} exists; {what_to_do}")
    return name


def kv_layout(model) -> dict[str, Any]:
    c = model.config
    return {"order": "token-major", "n_layers": c.n_layers, "per_token": [2, c.n_kv_heads, c.head_dim],
            "dtype": model.dtype_name}


def token_bytes(model) -> int:
    """Bytes of one token's K and V in one layer."""
    c = model.config
    return 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize


def register_model(db: DB, model) -> None:
    """Record `model` (fingerprint, architecture, config, where it was loaded from) once."""
    if db.get(ModelRow, model.fingerprint) is None:
        db.add(ModelRow(fingerprint=model.fingerprint, arch=model.config.arch, config=model.config.to_dict(),
                        source=model.source, created_at=utcnow()))
        db.flush()


def add_session(db: DB, *, name: str, model_fingerprint: str, dtype: str, weights: str, kv_layout: dict[str, Any],
                seed: int,
                sampler: dict[str, Any], chunk_size: int, checkpoint_every: int, token_bytes: int, reason: str,
                tokens: list[int] = (), n_cached: int = 0, last_hidden: bytes | None = None,
                active_call: dict[str, Any] | None = None, parent_id: str | None = None,
                fork_position: int | None = None, committed_end: int = 0,
                session_id: str | None = None) -> SessionRow:
    """Insert a session's rows in the caller's transaction: the session at head 0 holding `tokens`,
    its own (empty, or `committed_end` bytes long) segment, its first checkpoint (`reason`) and its
    token ids. The name must be claimed first (`claim_name`). Returns the session row."""
    if chunk_size < 1 or checkpoint_every < 1:
        raise InvalidArgument(f"chunk_size and checkpoint_every must be at least 1 (got {chunk_size} and "
                              f"{checkpoint_every})")
    now = utcnow()
    row = SessionRow(id=session_id or uuid.uuid4().hex, name=name, model_fingerprint=model_fingerprint, dtype=dtype,
                     weights=weights, kv_layout=kv_layout, seed=int(seed), sampler=sampler, chunk_size=chunk_size,
                     checkpoint_every=checkpoint_every, head=0, n_tokens=len(tokens), n_cached=n_cached,
                     last_hidden=last_hidden, active_call=active_call, parent_id=parent_id,
                     fork_position=fork_position, created_at=now, updated_at=now)
    db.add(row)
    db.flush()  # rows that reference the session go in after it
    db.add(SegmentRow(id=row.id, n_layers=kv_layout["n_layers"], token_bytes=token_bytes,
                      committed_end=committed_end))
    db.add(CheckpointRow(session_id=row.id, seq=0, n_tokens=len(tokens), n_cached=n_cached, reason=reason,
                         created_at=now))
    if len(tokens):
        db.add(TokenBlockRow(session_id=row.id, start=0, ids=encode_tokens(tokens)))
    db.flush()
    return row


def fork_rows(db: DB, parent: SessionRow, new_name: str, at: int | None, weights: str | None = None) -> SessionRow:
    """Insert the child's rows (inside the caller's transaction); KV extents and prefix keys shared,
    tokens copied.
    At the parent's head the child holds what the parent does; earlier, its last token is pending.
    `weights`: the child continues under another way of holding the model's weights (its own choice:
    its KV up to the fork was computed under the parent's)."""
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise InvalidArgument(f"weights {weights!r}: use one of {', '.join(WEIGHT_FORMATS)}")
    claim_name(db, new_name)
    n = parent.n_tokens if at is None else int(at)
    if not 1 <= n <= parent.n_tokens:
        raise InvalidArgument(f"fork position must be between 1 and {parent.n_tokens} (the tokens of "
                              f"{parent.name!r})")
    at_head = n == parent.n_tokens == parent.n_cached  # the child gets the last token's state too (C2)
    n_cached = n if at_head else min(parent.n_cached, n - 1)
    seg = db.get(SegmentRow, parent.id)
    child = add_session(db, name=new_name, model_fingerprint=parent.model_fingerprint, dtype=parent.dtype,
                        weights=weights or parent.weights, kv_layout=parent.kv_layout, seed=parent.seed, sampler=parent.sampler,
                        chunk_size=parent.chunk_size, checkpoint_every=parent.checkpoint_every,
                        token_bytes=seg.token_bytes, reason="fork", tokens=read_tokens(db, parent.id)[:n],
                        n_cached=n_cached, last_hidden=parent.last_hidden if at_head else None,
                        parent_id=parent.id, fork_position=n)
    share(db, parent, child, n_cached, keys=child.weights == parent.weights)
    for m in db.scalars(select(MessageRow).where(MessageRow.session_id == parent.id)
                        .where(MessageRow.token_end <= n).order_by(MessageRow.ordinal)):
        db.add(MessageRow(session_id=child.id, **message_dict(m)))
    db.flush()
    return child


def share(db: DB, parent: SessionRow, child: SessionRow, n_cached: int, *, keys: bool = True) -> None:
    """The child's first `n_cached` positions: the parent's extents (by reference) and, with `keys`
    (the child computes as its parent does), the parent's prefix keys within them (C10)."""
    for ref in db.scalars(select(SessionExtentRow).where(SessionExtentRow.session_id == parent.id)
                          .where(SessionExtentRow.start < n_cached).order_by(SessionExtentRow.start)):
        db.add(SessionExtentRow(session_id=child.id, start=ref.start, extent_id=ref.extent_id,
                                n_tokens=min(ref.n_tokens, n_cached - ref.start)))
    child.n_reusable = min(parent.n_reusable, n_cached) if keys else 0
    for position, key in db.execute(select(PrefixKeyRow.position, PrefixKeyRow.key)
                                    .where(PrefixKeyRow.session_id == parent.id)
                                    .where(PrefixKeyRow.position <= child.n_reusable)):
        db.add(PrefixKeyRow(session_id=child.id, position=position, key=key))


# statements of an open, made once (building one costs about as much as running it)
TOKEN_BLOCKS = (select(TokenBlockRow.start, TokenBlockRow.ids).where(TokenBlockRow.session_id == bindparam("session_id"))
                .order_by(TokenBlockRow.start))
MESSAGES = (select(*[getattr(MessageRow, k) for k in MESSAGE_FIELDS])
            .where(MessageRow.session_id == bindparam("session_id")).order_by(MessageRow.ordinal))


def read_tokens(db: DB | Connection, session_id: str) -> list[int]:
    """The session's token ids; CorruptData when its blocks do not follow each other exactly."""
    out: list[int] = []
    for start, ids in db.execute(TOKEN_BLOCKS, {"session_id": session_id}):
        if start != len(out):
            raise CorruptData(token_gap(start, len(out)))
        out.extend(np.frombuffer(ids, dtype="<i4").tolist())
    return out


def token_gap(start: int, count: int) -> str:
    """What is wrong when a token block starts at `start` after `count` token ids."""
    return (f"the token blocks are not contiguous: one starts at position {start}, after {count} token ids; "
            "the index is damaged (`kvstore verify` lists what else is)")


TOKEN_ID_BYTES = 4  # a token id in a block: int32, little-endian


def encode_tokens(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def message_dict(m: MessageRow) -> dict[str, Any]:
    return {k: getattr(m, k) for k in MESSAGE_FIELDS}


def read_messages(db: DB | Connection, session_id: str) -> list[dict[str, Any]]:
    """The session's chat messages in order, as dicts of MESSAGE_FIELDS."""
    return [dict(zip(MESSAGE_FIELDS, m)) for m in db.execute(MESSAGES, {"session_id": session_id})]


def last_state_problem(n_tokens: int, n_cached: int, state: bytes | None, size: int | None) -> str | None:
    """Contract C2 on a head: with every token's KV cached, it holds the last token's final hidden
    state, `size` bytes (one vector of the KV dtype; None: size not checked); with the last token
    pending, none. What is wrong, or None."""
    if n_cached > n_tokens:
        return f"{n_cached} cached positions for {n_tokens} tokens"
    if n_cached < n_tokens:
        return "a last-token state is stored, but the last token is pending" if state is not None else None
    if not n_tokens:
        return None
    if state is None:
        return "every token's KV is cached, but the last token's state is missing"
    if size is not None and len(state) != size:
        return f"the last token's state has {len(state)} bytes, the model's is {size}"
    return None
