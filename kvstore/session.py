"""Session: one persistent generation context, open for writing by this process.

A session owns its model handle, its `Sequence` (token ids + KVCache) and its sampler settings.
`checkpoint()` commits (contracts C2, C4, C5): the KV computed since the last checkpoint is
appended to the session's own per-layer files and fsynced, then one index transaction moves the
head with a compare-and-set, recording the new tokens, the last token's final hidden state when
every token is fed (else the last token is pending), the extent, the chat messages and any
generation still in progress. Prefill checkpoints after every chunk, generation every
`checkpoint_every` tokens (once the last of them is fed, so a resume samples the next token from
the stored state at once) and at the end of each call (its last token pending). Opening verifies
the model and every checksum, and reloads the cache without recomputing anything.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from sqlalchemy import bindparam, delete, insert, select, update

from .cache import with_room
from .chat import turn_ids
from .errors import CorruptData, KvstoreError, ModelMismatch, SessionBusy
from .extents import load_into, session_extents
from .generate import Sequence, TokenEvent
from .index import (CheckpointRow, store_full_on_disk_full, ExtentRow, MessageRow, ModelRow, SegmentRow, SessionExtentRow, SessionRow,
                    TokenBlockRow, utcnow)
from .locking import SessionLock
from .sampling import SamplerSettings
from . import segments
from .progress import Progress
from .store import encode_tokens, fork_rows, kv_layout, last_state_problem, read_tokens
from .tokenizer import StreamDecoder
from .trace import TraceWriter


# A checkpoint's statements, built once: the values come with each execution. The head moves with a
# compare-and-set on (id, head); `p_` names the WHERE parameters (a SET column's own name is taken).
_S = SessionRow.__table__
HEAD_MOVES = update(_S).where(_S.c.id == bindparam("p_id"), _S.c.head == bindparam("p_head"))
SEGMENT_GROWS = update(SegmentRow.__table__).where(SegmentRow.__table__.c.id == bindparam("p_id"))
ADD_CHECKPOINT = insert(CheckpointRow.__table__)
ADD_EXTENT = insert(ExtentRow.__table__).returning(ExtentRow.__table__.c.id)
ADD_SESSION_EXTENT = insert(SessionExtentRow.__table__)
ADD_TOKENS = insert(TokenBlockRow.__table__)


class Session:
    def __init__(self, store, row: SessionRow, model, seq: Sequence, lock: SessionLock, committed_end: int,
                 messages: list[dict[str, Any]]):
        self.store, self.model, self.seq, self.lock = store, model, seq, lock
        self.id, self.name, self.seed = row.id, row.name, row.seed
        self.settings = SamplerSettings.from_dict(row.sampler)
        self.checkpoint_every = row.checkpoint_every
        self.active_call: dict[str, Any] | None = row.active_call
        self.messages = messages
        self._head, self._n_tokens, self._n_cached = row.head, row.n_tokens, row.n_cached
        self._committed_end = committed_end
        self._names_synced = False  # this writer has fsynced its segment's directory entries
        self._dirty_messages: set[int] = set()
        self._call_dirty = False
        self.on_checkpoint: Callable[[int, int, int], None] | None = None  # (head, n_tokens, n_cached)

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, store, name: str, model=None, *, device: str = "cpu") -> "Session":
        with store.db() as db:
            session_id = store.row(db, name).id
        lock = SessionLock(store.session_dir(session_id), name).acquire()
        try:
            if model is None:
                model = store.resolve_model(name, device)
            with store.db() as db, db.begin():  # one snapshot, and the index's write lock while truncating:
                row = db.get(SessionRow, session_id)  # no other writer's checkpoint is half written then
                check_model(db, row, model)
                seg = db.get(SegmentRow, session_id)
                segments.truncate_uncommitted(store.session_dir(session_id), seg.committed_end)
                tokens = read_tokens(db, session_id)
                refs = session_extents(db, session_id)
                messages = [message_dict(m) for m in db.scalars(
                    select(MessageRow).where(MessageRow.session_id == session_id).order_by(MessageRow.ordinal))]
            if len(tokens) != row.n_tokens:
                raise CorruptData(f"session {name!r}: the index holds {len(tokens)} token ids, its head says "
                                  f"{row.n_tokens}; run `kvstore verify {name}`")
            hidden = stored_hidden(row, model)
            cache = load_shared_cache(store, session_id, name, refs, model, row.n_cached)
            seq = Sequence(model, cache, tokens, chunk_size=row.chunk_size, hidden=hidden)
            return cls(store, row, model, seq, lock, seg.committed_end, messages)
        except BaseException:
            lock.release()
            raise

    # -- state -----------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens

    @property
    def pending(self) -> list[int]:
        return self.seq.pending

    @property
    def directory(self) -> Path:
        return self.store.session_dir(self.id)

    def _check_open(self) -> None:
        if not self.lock.held:
            raise KvstoreError(f"session {self.name!r} is closed; open it again with store.open()")

    # -- the commit protocol ---------------------------------------------------------------------
    def checkpoint(self, reason: str = "manual") -> bool:
        """Commit everything since the last checkpoint; False when there was nothing new.

        The head's compare-and-set runs first, in the index transaction, and the new extent is
        written and fsynced while that transaction holds the index's write lock: a second writer
        (one without the flock, say on shared storage) fails before writing a byte, so it can never
        overwrite an extent the winner committed. The transaction commits after the fsyncs.
        """
        self._check_open()
        if self.active_call and self.active_call.get("kind") == "chat":
            self._refresh_reply()
        a, b = self._n_cached, self.seq.cache.length
        old_tokens, n_tokens = self._n_tokens, len(self.seq.tokens)
        if a == b and old_tokens == n_tokens and not self._dirty_messages and not self._call_dirty:
            return False
        assert b < n_tokens or n_tokens == 0 or self.seq.hidden is not None, "C2: all fed, and the last one's state"
        hidden = hidden_bytes(self.seq.hidden) if b == n_tokens > 0 else None
        with self.store.db() as db, store_full_on_disk_full(f"checkpoint of {self.name!r}"), db.begin():
            moved = db.connection().execute(HEAD_MOVES, {  # Core, like _record: the checkpoint's hot path
                "p_id": self.id, "p_head": self._head, "head": self._head + 1, "n_tokens": n_tokens, "n_cached": b,
                "active_call": self.active_call, "last_hidden": hidden, "sampler": self.settings.to_dict(),
                "updated_at": utcnow()})
            if moved.rowcount != 1:
                raise SessionBusy(f"session {self.name!r} was changed or deleted by someone else since it was "
                                  "opened; nothing was committed. Open it again")
            written = None
            if b > a:
                layers = [t.to("cpu").contiguous() for t in self.seq.cache.state(a, b)]
                written = segments.append(self.directory, self._committed_end, layers,
                                          names_synced=self._names_synced)
                self._names_synced = True
            self._record(db, reason, a, b, old_tokens, written)
        self._head, self._n_tokens, self._n_cached = self._head + 1, n_tokens, b
        if written is not None:
            self._committed_end = written.end
        self._dirty_messages.clear()
        self._call_dirty = False
        if self.on_checkpoint is not None:
            self.on_checkpoint(self._head, n_tokens, b)
        return True

    def _record(self, db, reason: str, a: int, b: int, old_tokens: int, written) -> None:
        """The rows of a checkpoint besides the head: the checkpoint, the extent, new tokens, messages.

        Core statements built once (below), not ORM objects: this runs at every checkpoint of a
        decode, and the unit of work's flushes, or building the statements anew, cost more than the SQL."""
        n_tokens = len(self.seq.tokens)
        run = db.connection().execute
        run(ADD_CHECKPOINT, {"session_id": self.id, "seq": self._head + 1, "n_tokens": n_tokens, "n_cached": b,
                             "reason": reason, "created_at": utcnow()})
        if written is not None:
            run(SEGMENT_GROWS, {"p_id": self.id, "committed_end": written.end})
            extent_id = run(ADD_EXTENT, {"segment_id": self.id, "offset": written.offset, "n_tokens": written.n_tokens,
                                         "checksums": written.checksums}).scalar_one()
            run(ADD_SESSION_EXTENT, {"session_id": self.id, "start": a, "extent_id": extent_id, "n_tokens": b - a})
        if n_tokens > old_tokens:
            run(ADD_TOKENS, {"session_id": self.id, "start": old_tokens,
                             "ids": encode_tokens(self.seq.tokens[old_tokens:])})
        self._write_messages(db)

    def _write_messages(self, db) -> None:
        for ordinal in sorted(self._dirty_messages):
            m = self.messages[ordinal]
            db.execute(delete(MessageRow).where(MessageRow.session_id == self.id, MessageRow.ordinal == ordinal))
            db.add(MessageRow(session_id=self.id, **m))

    # -- feeding text and tokens -----------------------------------------------------------------
    def append_text(self, text: str, *, progress: Progress | None = None) -> int:
        """Tokenize `text` as is (no chat template) and prefill it; returns the number of tokens added."""
        ids = self.model.tokenizer.encode(text, add_bos=None if not self.seq.tokens else False)
        return self.append_tokens(ids, progress=progress)

    def append_tokens(self, ids: list[int], *, progress: Progress | None = None) -> int:
        """Append ids and prefill them chunk by chunk, checkpointing after each chunk."""
        self._check_open()
        self._seal_call()
        self.seq.add(ids)
        self.checkpoint("tokens")  # the whole input is recorded first: a killed prefill resumes from it
        self.finish_prefill(progress=progress)
        return len(ids)

    def finish_prefill(self, *, progress: Progress | None = None) -> None:
        """Feed pending tokens (all but the last), e.g. those of a prefill that was killed."""
        total = len(self.seq.tokens) - 1
        for done in self.seq.prefill():
            self.checkpoint("prefill")
            if progress is not None:
                progress(done, total)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, max_new_tokens: int = 256, *, trace=None, stop: tuple[str, ...] = (), stop_at_eos: bool = True,
                 **sampling) -> Iterator[int]:
        """Sample up to max_new_tokens token ids (stops at EOS or a stop string); checkpoints as it goes."""
        call = self._start_call("raw", max_new_tokens, stop, sampling, stop_at_eos=stop_at_eos)
        for event in self._run(call, trace):
            yield event.token

    def chat(self, message: str, max_new_tokens: int = 256, *, trace=None, **sampling) -> Iterator[str]:
        """Add a user turn through the chat template and stream the reply as text pieces."""
        self._check_open()
        self._seal_call()
        history = [{"role": m["role"], "content": m["text"]} for m in self.messages]
        ids = turn_ids(self.model.tokenizer, history, {"role": "user", "content": message}, self.seq.tokens)
        start = len(self.seq.tokens)
        self.seq.add(ids)
        self._set_message(len(self.messages), "user", message, start, start + len(ids))
        reply = len(self.messages)
        self._set_message(reply, "assistant", "", len(self.seq.tokens), len(self.seq.tokens))
        # the call is recorded with the prompt, before its prefill: a turn killed anywhere can be resumed
        call = self._start_call("chat", max_new_tokens, (), sampling, message=reply)
        yield from self._pieces(call, trace)

    def resume(self, *, trace=None) -> Iterator[str]:
        """Finish a generation that was interrupted (killed, Ctrl-C); text pieces. Nothing if none was."""
        self._check_open()
        if not self.active_call:
            return
        self.finish_prefill()
        yield from self._pieces(self.active_call, trace)

    def _pieces(self, call: dict[str, Any], trace) -> Iterator[str]:
        decoder = StreamDecoder(self.model.tokenizer)
        for token in self.seq.tokens[call["start"]:]:
            decoder.push(token)  # already shown before the interruption
        eos = self.model.tokenizer.eos_ids
        for event in self._run(call, trace):
            if event.token not in eos:
                if piece := decoder.push(event.token):
                    yield piece
        if tail := decoder.flush():
            yield tail

    def _start_call(self, kind: str, max_new_tokens: int, stop, sampling: dict[str, Any], **extra) -> dict[str, Any]:
        self._check_open()
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if kind != "chat":
            self._seal_call()
        if sampling:
            self.settings = dataclasses.replace(self.settings, **sampling)
        self.active_call = {"kind": kind, "start": len(self.seq.tokens), "max_new_tokens": int(max_new_tokens),
                            "stop": list(stop), **extra}
        self._call_dirty = True
        self.checkpoint("call")
        self.finish_prefill()
        return self.active_call

    def _run(self, call: dict[str, Any], trace) -> Iterator[TokenEvent]:
        remaining = call["start"] + call["max_new_tokens"] - len(self.seq.tokens)
        stops = call.get("stop") or []
        tok = self.model.tokenizer
        should_stop = (lambda _: any(s in tok.decode(self.seq.tokens[call["start"]:]) for s in stops)) if stops else None
        writer, since = TraceWriter(trace), 0

        def fed() -> None:  # the tokens so far are in the cache: a resume from here samples at once
            nonlocal since
            if since >= self.checkpoint_every:
                self.checkpoint("auto")
                since = 0

        try:
            for event in self.seq.generate(self.settings, seed=self.seed, max_new_tokens=max(remaining, 0),
                                           stop_ids=tok.eos_ids if call.get("stop_at_eos", True) else (),
                                           should_stop=should_stop, fed=fed):
                writer.write(event.position, event.token, event.logits)
                yield event
                since += 1
            self._end_call()
        finally:
            writer.close()
            if self.lock.held:
                self.checkpoint("end")

    def _end_call(self) -> None:
        if self.active_call and self.active_call.get("kind") == "chat":
            self._refresh_reply()
        self.active_call = None
        self._call_dirty = True

    def _seal_call(self) -> None:
        """A new turn after an interrupted one: keep the partial reply as it is."""
        if self.active_call:
            self._end_call()

    def _refresh_reply(self) -> None:
        call = self.active_call
        generated = self.seq.tokens[call["start"]:]
        text = self.model.tokenizer.decode([t for t in generated if t not in self.model.tokenizer.eos_ids],
                                           skip_special=True)
        self._set_message(call["message"], "assistant", text, call["start"], len(self.seq.tokens))

    def _set_message(self, ordinal: int, role: str, text: str, start: int, end: int) -> None:
        entry = {"ordinal": ordinal, "role": role, "text": text, "token_start": start, "token_end": end}
        if ordinal < len(self.messages):
            if self.messages[ordinal] == entry:
                return
            self.messages[ordinal] = entry
        else:
            assert ordinal == len(self.messages)
            self.messages.append(entry)
        self._dirty_messages.add(ordinal)

    # -- fork, pack, close ------------------------------------------------------------------------
    def fork(self, name: str, at: int | None = None) -> "Session":
        """A new session from this one's first `at` tokens (all by default), sharing the KV on disk."""
        self.checkpoint("fork")
        with self.store.db() as db, db.begin():
            child = fork_rows(db, db.get(SessionRow, self.id), name, at)
            messages = [message_dict(m) for m in db.scalars(
                select(MessageRow).where(MessageRow.session_id == child.id).order_by(MessageRow.ordinal))]
        lock = SessionLock(self.store.session_dir(child.id), name).acquire()
        cache = self.model.new_cache(capacity=with_room(child.n_cached))
        if child.n_cached:
            cache.load(0, self.seq.cache.state(0, child.n_cached))
        hidden = self.seq.hidden if child.n_cached == child.n_tokens else None  # a fork at the head
        seq = Sequence(self.model, cache, self.seq.tokens[:child.n_tokens], chunk_size=self.seq.chunk_size,
                       hidden=hidden)
        return Session(self.store, child, self.model, seq, lock, 0, messages)

    def pack(self, *, progress: Progress | None = None) -> dict[str, int]:
        """Checkpoint, then move this session's extents into compressed blobs and free its KV files;
        `progress(done, total)` gets the KV bytes packed so far after each extent."""
        from .pack import pack_session

        self.checkpoint("pack")
        return pack_session(self.store, self.id, self.name, progress)

    def close(self) -> None:
        """Checkpoint, release the lock, and hand the cache's memory to the next session opened."""
        if self.lock.held:
            try:
                self.checkpoint("close")
            finally:
                self.lock.release()
                self.seq.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def message_dict(m: MessageRow) -> dict[str, Any]:
    return {"ordinal": m.ordinal, "role": m.role, "text": m.text, "token_start": m.token_start,
            "token_end": m.token_end}


def check_model(db, row: SessionRow, model) -> None:
    """ModelMismatch naming what differs between the session's model and `model`."""
    problems = []
    if row.model_fingerprint != model.fingerprint:
        stored = db.get(ModelRow, row.model_fingerprint)
        mine = model.config.to_dict()
        changed = [f"{k}: {stored.config.get(k)!r} vs {mine.get(k)!r}" for k in sorted(mine)
                   if stored is not None and stored.config.get(k) != mine.get(k)]
        what = ", ".join(changed) if changed else "same architecture and shapes, other weights"
        source = stored.source if stored is not None else "?"
        problems.append(f"it was made with model {row.model_fingerprint[:12]} ({source}), this one is "
                        f"{model.fingerprint[:12]} ({model.source}): {what}")
    if row.dtype != model.dtype_name:
        problems.append(f"its KV is {row.dtype} but the model is loaded as {model.dtype_name} "
                        f"(load it with dtype={row.dtype})")
    elif row.kv_layout != kv_layout(model):
        problems.append(f"its KV layout is {row.kv_layout}, the model's is {kv_layout(model)}")
    if problems:
        raise ModelMismatch(f"session {row.name!r} cannot continue with this model: " + "; ".join(problems))


def hidden_bytes(hidden: torch.Tensor) -> bytes:
    """A final hidden state `[hidden]` as the raw bytes the index keeps (`sessions.last_hidden`)."""
    return hidden.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def stored_hidden(row: SessionRow, model) -> torch.Tensor | None:
    """The final hidden state the head checkpoint holds (C2), as a fresh tensor on the model's device;
    None when the last token is pending. CorruptData if it is missing or not one hidden vector of the
    model's dtype."""
    if not row.n_tokens or row.n_cached < row.n_tokens:
        return None
    if problem := last_state_problem(row.n_tokens, row.n_cached, row.last_hidden, model.hidden_bytes):
        raise CorruptData(f"session {row.name!r}: {problem}; run `kvstore verify {row.name}`")
    # a copy into fresh (aligned) memory: the bits a kernel gives must not depend on where its input sits
    return torch.frombuffer(bytearray(row.last_hidden), dtype=model.dtype).clone().to(model.device)


def load_shared_cache(store, session_id: str, name: str, refs, model, n_cached: int):
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


def _placement(refs) -> list[tuple[int, str | None]]:
    """Which extents, and the blob each is packed in (None: in its raw files)."""
    return [(r.extent_id, r.blob.hash if r.blob is not None else None) for r in refs]


def load_cache(home: Path, name: str, refs, model, n_cached: int):
    """The session's KVCache rebuilt from its extents, every checksum verified."""
    cache = model.new_cache(capacity=with_room(n_cached))
    load_into(cache, refs, home, session=name)
    if cache.length != n_cached:
        raise CorruptData(f"session {name!r}: its extents cover {cache.length} positions, the head says {n_cached}")
    return cache
