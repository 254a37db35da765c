"""The prefix cache in the engine (contract C10): a request that names no session starts from the
longest stored prefix of its prompt, and its session is kept afterwards as a prefix-cache entry.

`open_session`: the request's own session, made by reference from the longest prefix of the
prompt's token ids that a stored session holds as a cold run computes it (`Store.find_prefix`:
whole chunks at absolute positions, same model, weights, dtype, kernels and chunk size; among the
tenant's sessions), so only the rest is prefilled and the reply is byte-identical to a cold run.
A source that fails to load (a corrupt or missing file) is dropped from the cache and the request
runs cold: never an error for the client.

`retain`: after the reply, the session is closed and kept as an entry; the least recently used
entries beyond the budget are deleted (named sessions never are: `Store.evict_prefix`).
"""

from __future__ import annotations

import logging
from typing import Any

import kvstore

log = logging.getLogger("kvstore.serve")


def open_session(engine, job: dict[str, Any], prompt: list[int]):
    """(session, how, restore, reused positions) for a request of its own (`job["create"]`: its
    settings) whose prompt is `prompt`: on a fork of the longest stored prefix, else new."""
    name, create = job["session"], dict(job["create"])
    chunk = create.get("chunk_size") or kvstore.DEFAULT_CHUNK
    hit = engine.store.find_prefix(engine.model, prompt, chunk, scope=job["prefix"].get("scope", ""))
    if hit is not None:
        settings = {k: v for k, v in create.items() if k != "chunk_size"}
        try:
            if engine.store.fork_prefix(hit, name, prompt, **settings):
                session, _, restore = engine.writer(name)
                return session, "reused", restore, hit.length
        except (kvstore.errors.KvstoreError, OSError) as e:
            log.warning("prefix cache: session %s failed to load (%s); answered cold", hit.name, e)
            _discard(engine, name)
            _drop_source(engine, hit)
    session, how, restore = engine.writer(name, create=create)
    return session, how, restore, 0


def _discard(engine, name: str) -> None:
    try:
        engine.delete(name)
    except kvstore.errors.SessionNotFound:
        pass


def _drop_source(engine, hit) -> None:
    try:
        engine.store.drop_prefix_source(hit)
    except (kvstore.errors.KvstoreError, OSError) as e:  # it stays a source; the next hit on it runs cold too
        log.warning("prefix cache: could not drop session %s from the cache: %s", hit.name, e)


def retain(engine, job: dict[str, Any]) -> dict[str, Any]:
    """Keep the request's session as an entry, evict beyond `job["budget"]` bytes; the cache's state."""
    engine.forget(job["session"])  # checkpointed and closed: an entry is only ever forked
    engine.store.retain_prefix(job["session"])
    evicted = engine.store.evict_prefix(job["budget"])
    entries, size = engine.store.prefix_held()
    return {"prefix_entries": entries, "prefix_bytes": size, "prefix_evicted": len(evicted)}
