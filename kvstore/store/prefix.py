"""The exact prefix cache in the index (contract C10): keys, lookup, forks by reference, entries.

Keys. A session's KV at positions [0, n_reusable) is what a cold run computes for its tokens: a
prefill from position 0 in chunks at multiples of its chunk size (the session keeps the count:
`Sequence.reusable`). At each chunk boundary b = k*C within it, the index holds the key

    key(b) = blake2b-128(key(b - C) || int32-le tokens[b - C:b]),   key(0) = blake2b-128(identity)

where the identity is the model's fingerprint, dtype, weight format (C6), kernels and the chunk
size. Equal keys mean equal tokens at the same absolute positions, computed alike: a fork of such a
session at b holds, bit for bit, the KV a cold run of any prompt beginning with those tokens would
compute (the lookup compares the tokens too, so a hash collision costs a miss, never a wrong hit).

Where the model computes every row alone (`Model.row_invariant`: the default model on the CPU's
native kernels), how the tokens were fed changes no bit, so any position is a cold run's boundary:
keys then stand every KEY_BLOCK positions (or the chunk size, if smaller), whatever the chunk size,
which takes C's place above (`key_block`). A conversation resent each turn reuses all but the last
few tokens before what is new, where with C = 512 one shorter than 512 tokens reused nothing.

Lookup (`find`): the longest boundary b <= len(tokens) - 1 whose key a session holds (one token at
least is left to feed: the last prompt token's state is computed, never stored). `fork` makes a
session from the hit by reference: its rows share the source's extents below b (C5: committed
bytes never change, gc keeps what a session references), its token b is the prompt's, pending.

Entries. A session kept only for the cache (a stateless request's, after its reply) has a
`prefix_entries` row: its own KV bytes and when it last served a hit. `evict` deletes the least
recently used entries until their bytes fit a budget; a named session has no such row and is
never deleted here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session as DB

from ..errors import SessionBusy
from .index import PrefixEntryRow, PrefixKeyRow, SegmentRow, SessionRow, utcnow
from .locking import SessionLock
from .records import add_session, claim_name, read_tokens, share

LOOKUP_CANDIDATES = 8  # sessions whose tokens a lookup compares at most (one hit suffices)
# positions between two keys of a model that computes every row alone: a key row and a 16-byte hash
# per block in the index, and what a request reads again before the tokens it does not share (16 on
# average)
KEY_BLOCK = 32


def key_block(model, chunk_size: int) -> int:
    """Positions between two prefix keys of a session of `model` read in chunks of `chunk_size`: the
    chunk size, where the bits depend on how the tokens were fed; at most KEY_BLOCK where every row is
    computed alone (`Model.row_invariant`)."""
    return min(int(chunk_size), KEY_BLOCK) if getattr(model, "row_invariant", False) else int(chunk_size)


@dataclass(frozen=True)
class Identity:
    """What, besides the tokens, decides a session's KV bits: its prefix keys' root."""
    fingerprint: str
    dtype: str
    weights: str
    kernels: str  # which kernels computed it (`Model.kernels`)
    chunk_size: int  # positions between two keys (`key_block`: the chunk size, or less where it changes no bit)

    @classmethod
    def of(cls, model, chunk_size: int) -> "Identity":
        return cls(model.fingerprint, model.dtype_name, model.weights, model.kernels, key_block(model, chunk_size))

    def root(self) -> bytes:
        return _digest(json.dumps(self.__dict__, sort_keys=True).encode())


@dataclass(frozen=True)
class PrefixHit:
    session_id: str
    name: str
    length: int  # positions of the source's KV a fork reuses: a chunk boundary


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def chain(root: bytes, tokens: list[int], chunk: int, upto: int) -> list[tuple[int, str]]:
    """(boundary, key) for every chunk boundary in (0, upto], hex keys."""
    out, key = [], root
    ids = np.asarray(tokens[:upto // chunk * chunk], dtype="<i4")
    for b in range(chunk, upto + 1, chunk):
        key = _digest(key + ids[b - chunk:b].tobytes())
        out.append((b, key.hex()))
    return out


def new_keys(root: bytes, tokens: list[int], chunk: int, old: int, new: int) -> list[tuple[int, str]]:
    """The keys a session whose reusable positions grew from `old` to `new` adds."""
    if new // chunk <= old // chunk:
        return []
    return [(b, k) for b, k in chain(root, tokens, chunk, new) if b > old]


def find(db: DB, identity: Identity, tokens: list[int], scope: str = "") -> PrefixHit | None:
    """The longest stored prefix of `tokens` (see the module's docstring) among sessions whose name
    starts with `scope` (a tenant's), or None."""
    keys = dict(chain(identity.root(), tokens, identity.chunk_size, len(tokens) - 1))
    if not keys:
        return None
    rows = db.execute(select(PrefixKeyRow.session_id, PrefixKeyRow.position, PrefixKeyRow.key, SessionRow.name)
                      .join(SessionRow, SessionRow.id == PrefixKeyRow.session_id)
                      .where(PrefixKeyRow.key.in_(list(keys.values())))
                      .where(SessionRow.name.startswith(scope, autoescape=True))
                      .order_by(PrefixKeyRow.position.desc()).limit(LOOKUP_CANDIDATES))
    for session_id, position, key, name in rows:
        if keys.get(position) == key and read_tokens(db, session_id)[:position] == tokens[:position]:
            return PrefixHit(session_id, name, position)
    return None


def fork(db: DB, hit: PrefixHit, new_name: str, tokens: list[int], *, seed: int, sampler: dict,
         checkpoint_every: int) -> SessionRow | None:
    """A new session `new_name` holding `tokens[:hit.length + 1]`, the KV of the first hit.length
    shared with the hit's source (no byte copied), the last token pending; None when the source is
    gone. Marks the source's entry (if it is one) as just used."""
    source = db.get(SessionRow, hit.session_id)
    if source is None or source.n_reusable < hit.length:
        return None
    claim_name(db, new_name)
    n = hit.length
    child = add_session(db, name=new_name, model_fingerprint=source.model_fingerprint, dtype=source.dtype,
                        weights=source.weights, kv_layout=source.kv_layout, seed=seed, sampler=sampler,
                        chunk_size=source.chunk_size, checkpoint_every=checkpoint_every,
                        token_bytes=db.get(SegmentRow, source.id).token_bytes, reason="prefix",
                        tokens=tokens[:n + 1], n_cached=n, parent_id=source.id, fork_position=n)
    share(db, source, child, n)
    db.execute(update(PrefixEntryRow).where(PrefixEntryRow.session_id == source.id).values(last_used=utcnow()))
    db.flush()
    return child


def forget_keys(db: DB, session_id: str) -> None:
    """The session is no prefix source any more (its KV failed to load, say); it stays as it is."""
    db.execute(delete(PrefixKeyRow).where(PrefixKeyRow.session_id == session_id))


# -- entries -----------------------------------------------------------------------------------
def retain(db: DB, session_id: str) -> None:
    """Keep the session as a prefix-cache entry (its bytes: what it wrote itself)."""
    seg = db.get(SegmentRow, session_id)
    size = seg.committed_end * seg.n_layers if seg is not None else 0
    db.merge(PrefixEntryRow(session_id=session_id, bytes=size, last_used=utcnow()))


def held(db: DB) -> tuple[int, int]:
    """(entries, their bytes)."""
    n, size = db.execute(select(func.count(), func.coalesce(func.sum(PrefixEntryRow.bytes), 0))).one()
    return int(n), int(size)


def evict(store, budget: int) -> list[str]:
    """Delete the least recently used entries until their bytes fit `budget`; the names deleted. An
    entry a writer has open (SessionBusy) is skipped; named sessions are never candidates (they have
    no entry row). Files go at the end, in one gc."""
    with store.db() as db:
        _, total = held(db)
        entries = [] if total <= budget else list(db.execute(
            select(PrefixEntryRow.session_id, SessionRow.name, PrefixEntryRow.bytes)
            .join(SessionRow, SessionRow.id == PrefixEntryRow.session_id).order_by(PrefixEntryRow.last_used)))
    gone = []
    for session_id, name, size in entries:
        if total <= budget:
            break
        try:
            lock = SessionLock(store.session_dir(session_id), name).acquire(patience_s=0)
        except SessionBusy:
            continue
        try:
            with store.db() as db, db.begin():
                if db.get(PrefixEntryRow, session_id) is not None:  # not deleted by another engine meanwhile
                    db.execute(delete(SessionRow).where(SessionRow.id == session_id))
                    gone.append(name)
                    total -= size
        finally:
            lock.release()
    if gone:
        store.gc()
    return gone
