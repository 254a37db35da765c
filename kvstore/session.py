"""Session: one persistent generation context, open for writing by this process.

A session joins the engine and the store: it owns its model handle, its `Sequence` (token ids +
KVCache) and its sampler settings, and holds the session's writer lock (C7). `checkpoint()` hands
what changed since the last one to the checkpoint protocol (`commit.py`: C2, C4, C5), with the
prefix keys of the chunk boundaries its cold-run KV reached since (C10, `store.prefix`). Prefill
checkpoints after every chunk, generation every `checkpoint_every` tokens (once the last of them is
fed, so a resume samples the next token from the stored state at once; committed while the next
tokens decode, acknowledged once durable) and at the end of each call (its last token pending,
durable when the call returns). A generation call in progress is recorded (`active_call`) before its
prompt is read, so one killed anywhere is finished by `resume()` with its own settings.

Opening (`Session.open`) verifies the model and every checksum and reloads the cache without
recomputing anything (`store.restore`). A session left open when the interpreter exits (a script
that dropped an unfinished `generate`) is closed, with a checkpoint, before Python tears down.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterator

from .commit import Change, Head, commit_later, commit_now, hidden_bytes
from .defaults import DEFAULT_MAX_NEW_TOKENS
from .engine import grammar
from .engine.chat import turn_ids
from .engine.sampling import SamplerSettings
from .engine.sequence import Sequence, TokenEvent
from .engine.tokenizer import StreamDecoder
from .engine.trace import TraceWriter, token_logprobs
from .errors import InvalidArgument, KvstoreError
from .store.index import SessionRow
from .store.locking import SessionLock
from .store.pack import pack_session
from .store.prefix import Identity, new_keys
from .store.progress import Progress
from .store.records import fork_rows, read_messages, restated
from .store.restore import load_shared_cache, snapshot, stored_hidden

_OPEN: "weakref.WeakSet[Session]" = weakref.WeakSet()  # closed at exit, while the interpreter still works


class Session:
    def __init__(self, store, row: SessionRow, model, seq: Sequence, lock: SessionLock, committed_end: int,
                 messages: list[dict[str, Any]]):
        self.store, self.model, self.seq, self.lock = store, model, seq, lock
        self.id, self.name, self.seed = row.id, row.name, row.seed
        self.settings = SamplerSettings.from_dict(row.sampler)
        self._checkpoint_every = row.checkpoint_every
        self.active_call: dict[str, Any] | None = row.active_call
        self.messages = messages
        self.head = Head(row.head, row.n_tokens, row.n_cached, committed_end, row.n_reusable)
        identity = Identity.of(model, row.chunk_size)
        self._prefix_root, self._key_block = identity.root(), identity.chunk_size  # its prefix keys' (C10)
        self._dirty_messages: set[int] = set()
        self._dirty = False  # settings or the call in progress changed since the last checkpoint
        self.on_checkpoint: Callable[[int, int, int], None] | None = None  # (head, n_tokens, n_cached)
        self.last_checkpoint_seconds = 0.0  # how long the last commit took (a service's metric)
        self._in_flight: tuple[Future, list[int]] | None = None  # a commit not waited for; its messages
        # chat/respond/resume yield "" after each prefill chunk (a scheduler's turn to run another session)
        self.prefill_yields = False
        _OPEN.add(self)

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, store, name: str, model=None, *, device: str = "cpu") -> "Session":
        session_id = store.session_id(name)
        lock = SessionLock(store.session_dir(session_id), name).acquire()
        try:
            if model is None:
                model = store.resolve_model(name, device)
            snap = snapshot(store, session_id, model)
            hidden = stored_hidden(snap.row, model)
            cache = load_shared_cache(store, session_id, name, snap.refs, model, snap.row.n_cached)
            seq = Sequence(model, cache, snap.tokens, chunk_size=snap.row.chunk_size, hidden=hidden,
                           reusable=snap.row.n_reusable)
            return cls(store, snap.row, model, seq, lock, snap.committed_end, snap.messages)
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
    def n_cached(self) -> int:
        """Positions whose KV is in the cache (fed); the rest of `tokens` is `pending`."""
        return self.seq.cache.length

    @property
    def checkpoint_every(self) -> int:
        """Generated tokens between automatic checkpoints; a new value is saved with the next checkpoint."""
        return self._checkpoint_every

    @checkpoint_every.setter
    def checkpoint_every(self, n: int) -> None:
        if n < 1:
            raise InvalidArgument(f"checkpoint_every must be at least 1 (got {n})")
        if n != self._checkpoint_every:
            self._checkpoint_every, self._dirty = int(n), True

    @property
    def stop_reason(self) -> str | None:
        """Why the last generation call ended: "eos", "stop" (a stop string), "length", "context"."""
        return self.seq.stop_reason

    @property
    def chunk_size(self) -> int:
        """Prefill chunks end at multiples of this, in absolute positions (fixed at creation)."""
        return self.seq.chunk_size

    @property
    def directory(self) -> Path:
        return self.store.session_dir(self.id)

    def _check_open(self) -> None:
        if not self.lock.held:
            raise KvstoreError(f"session {self.name!r} is closed; open it again with store.open()")

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, reason: str = "manual", *, wait: bool = True) -> bool:
        """Commit everything since the last checkpoint (`commit.py`); False when there was nothing new.

        With wait=False (generation's automatic checkpoints) the commit runs on the committing
        thread while the caller goes on (`commit.commit_later`); it is acknowledged (`head`,
        `on_checkpoint`) only once durable, when a later call finds it done (`settle`). Every
        checkpoint first waits for the one before, so they commit in order, and its error, if it
        failed, is raised here (what it would have committed is committed by the next one)."""
        self._check_open()
        self.settle()
        if self.active_call and self.active_call.get("kind") == "chat":
            self._refresh_reply()
        head, n_cached, tokens = self.head, self.seq.cache.length, self.seq.tokens
        if (head.n_cached, head.n_tokens) == (n_cached, len(tokens)) and not self._dirty_messages and not self._dirty:
            return False
        assert n_cached < len(tokens) or not tokens or self.seq.hidden is not None, "C2: all fed, and the last one's state"
        dirty_messages = sorted(self._dirty_messages)
        change = Change(reason, list(tokens), self.seq.cache.state(head.n_cached, n_cached) if n_cached > head.n_cached
                        else None, n_cached, hidden_bytes(self.seq.hidden) if n_cached == len(tokens) > 0 else None,
                        self.active_call and dict(self.active_call), self.settings.to_dict(), self._checkpoint_every,
                        [self.messages[i] for i in dirty_messages], self.seq.reusable,
                        new_keys(self._prefix_root, tokens, self._key_block, head.n_reusable, self.seq.reusable),
                        kv_owned=getattr(self.seq.cache, "STATE_COPIES", False))
        self._dirty_messages.clear()
        self._dirty = False
        committing = commit_now if wait else commit_later
        self._in_flight = (committing(self.store, self.id, self.name, head, change), dirty_messages)
        if wait:
            self.settle()
        return True

    def settle(self, *, block: bool = True) -> None:
        """Acknowledge the checkpoint that is being committed behind the caller (`checkpoint(wait=False)`)
        once it is durable: waits for it (block=False: only when it is done already); raises its
        error when it failed."""
        if self._in_flight is None or (not block and not self._in_flight[0].done()):
            return
        (future, dirty_messages), self._in_flight = self._in_flight, None
        try:
            new_head, seconds = future.result()
        except BaseException:
            self._undone(dirty_messages)
            raise
        self._acknowledge(new_head, seconds)

    def _undone(self, dirty_messages: list[int]) -> None:
        """A commit failed: what it carried is still to be committed."""
        self._dirty_messages.update(dirty_messages)
        self._dirty = True

    def _acknowledge(self, head: Head, seconds: float) -> None:
        self.head = head
        self.last_checkpoint_seconds = seconds
        if self.on_checkpoint is not None:
            self.on_checkpoint(head.seq, head.n_tokens, head.n_cached)

    # -- feeding text and tokens -----------------------------------------------------------------
    def append_text(self, text: str, *, progress: Progress | None = None) -> int:
        """Tokenize `text` as is (no chat template) and prefill it; returns the number of tokens added."""
        return self.append_tokens(self._encoded(text), progress=progress)

    def _encoded(self, text: str) -> list[int]:
        """`text`'s ids as appended here: the model's BOS first only in an empty session."""
        return self.model.tokenizer.encode_at(text, len(self.seq.tokens))

    def append_tokens(self, ids: list[int], *, progress: Progress | None = None) -> int:
        """Append ids and prefill them chunk by chunk, checkpointing after each chunk."""
        self._check_open()
        self._seal_call()
        self.seq.add(ids)
        self.checkpoint("tokens")  # the whole input is recorded first: a killed prefill resumes from it
        self.finish_prefill(progress=progress)
        return len(ids)

    def append_scored(self, ids: list[int] | str, *, top: int = 0,
                      progress: Progress | None = None) -> list[dict[str, Any] | None]:
        """`append_tokens` (or, for text, `append_text`) that also scores what it appends: per token,
        `{"position", "token", "logprob", "top_logprobs"}`, its log-probability given everything
        before it and the `top` likeliest tokens' there (`engine.trace.token_logprobs`: float32
        log-softmax of the logits row that predicts it), or None where no logits predict it (the
        session's first token; a session whose cache holds its last token without its state).
        The prefill is the one `append_tokens` runs (the same chunks, K/V and state), its rows'
        logits taken as it goes; where the model computes every row alone (`Model.row_invariant`) a
        token's entry is the one a generation sampling it there would report, bit for bit."""
        self._check_open()
        self._seal_call()
        scoring = _Scoring(self, self._encoded(ids) if isinstance(ids, str) else list(ids), top)
        self.seq.add(scoring.ids)
        self.checkpoint("tokens")
        for done in self._fed_chunks(scoring.rows):
            if progress is not None:
                progress(done, len(self.seq.tokens))
        self.settle()
        return scoring.entries()

    def begin(self, prompt: list[int] | str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, top: int | None = None,
              stop: tuple[str, ...] = (), stop_at_eos: bool = True, response_format=None,
              progress: Progress | None = None, **sampling) -> list[dict[str, Any] | None] | None:
        """Append `prompt` (ids, or text as `append_text` reads it) and start a generation after it
        (`generate`'s settings), as one call: its tokens then come from `resume()`. The prompt is
        recorded with the call, so a call stopped anywhere (a killed process) is finished by
        `resume()` and its prompt is never appended twice (`append_tokens` then `generate` record
        the prompt first and the call after: stopped in between, the prompt stands without a call).

        With `top`, the prompt is scored as `append_scored` scores it and its entries are returned
        (else None); a scored prompt is read first and recorded with the call once read (its rows'
        logits are gone once computed, so a scoring stopped midway cannot be resumed): stopped
        before, the session is as it was, and the same call can be made again. `progress(done, total)`
        gets the tokens read after each chunk of the prompt."""
        self._check_open()
        settings, fmt = self._call_settings(max_new_tokens, sampling, response_format)
        self._seal_call()
        ids = self._encoded(prompt) if isinstance(prompt, str) else list(prompt)
        if top is None:
            self.seq.add(ids)
            self._start_call("raw", max_new_tokens, stop, settings, feed=False, stop_at_eos=stop_at_eos,
                             **_format(fmt))
            self.finish_prefill(progress=progress)
            return None
        scoring = _Scoring(self, ids, top)
        hidden, cached, reusable = self.seq.hidden, self.seq.cache.length, self.seq.reusable
        self.seq.add(ids)
        try:
            for done in self.seq.prefill(scoring.rows):
                if progress is not None:
                    progress(done, len(self.seq.tokens))
        except BaseException:  # nothing of it was recorded: the session goes back to where it was
            del self.seq.tokens[scoring.first:]
            self.seq.cache.trim(cached)
            self.seq.hidden, self.seq.reusable = hidden, reusable
            raise
        self._start_call("raw", max_new_tokens, stop, settings, feed=False, stop_at_eos=stop_at_eos, **_format(fmt))
        return scoring.entries()

    def finish_prefill(self, *, progress: Progress | None = None) -> None:
        """Feed the pending tokens (a prefill that was killed, say), a checkpoint after each chunk;
        returns once the last one is durable."""
        total = len(self.seq.tokens)
        for done in self._fed_chunks():
            if progress is not None:
                progress(done, total)
        self.settle()

    def _fed_chunks(self, rows: Callable[[int, Any], None] | None = None) -> Iterator[int]:
        """Feed the pending tokens a chunk at a time, a checkpoint after each, committed while the next
        chunk computes (`checkpoint(wait=False)`; each waits for the one before); yields the cache
        length. A reply's last one commits while its first token is computed: that token is sent
        before the prefill is durable, as later tokens are before the checkpoints that cover them
        (a crash then loses the prefill, and the resumed call computes it, and that token, again).
        `rows`: `Sequence.prefill`'s (each chunk's logits)."""
        for done in self.seq.prefill(rows):
            self.checkpoint("prefill", wait=False)
            yield done

    # -- generation ------------------------------------------------------------------------------
    def generate(self, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, trace=None, stop: tuple[str, ...] = (),
                 stop_at_eos: bool = True, response_format=None, **sampling) -> Iterator[int]:
        """Sample up to max_new_tokens token ids (stops at EOS or a stop string); checkpoints as it goes.
        `response_format`: what the generated text must be (`engine.grammar`: JSON, a JSON schema's,
        a regular expression's match); it ends once complete."""
        settings, fmt = self._call_settings(max_new_tokens, sampling, response_format)
        call = self._start_call("raw", max_new_tokens, stop, settings, stop_at_eos=stop_at_eos, **_format(fmt))
        for event in self._run(call, trace):
            yield event.token

    def chat(self, message: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, trace=None,
             stop: tuple[str, ...] = (), response_format=None, **sampling) -> Iterator[str]:
        """Add a user turn through the chat template and stream the reply as text pieces (it ends
        at EOS, at a stop string or after max_new_tokens; `response_format`: as in `generate`)."""
        self._check_open()
        settings, fmt = self._call_settings(max_new_tokens, sampling, response_format)
        self._seal_call()
        history = self._history()
        ids = turn_ids(self.model.tokenizer, history, {"role": "user", "content": message}, self.seq.tokens)
        start = len(self.seq.tokens)
        self.seq.add(ids)
        self._set_message(len(self.messages), "user", message, start, start + len(ids))
        yield from self._reply(max_new_tokens, stop, settings, trace, fmt)

    def add_message(self, role: str, content: str) -> int:
        """Add a message as context, through the chat template, without answering it (an assistant
        reply written by the caller, a system note): its tokens are pending until the next call feeds
        them with the rest. Returns how many tokens it added."""
        self._check_open()
        self._seal_call()
        ids = turn_ids(self.model.tokenizer, self._history(), {"role": role, "content": content}, self.seq.tokens,
                       add_generation_prompt=False)
        start = len(self.seq.tokens)
        self.seq.add(ids)
        self._set_message(len(self.messages), role, content, start, start + len(ids))
        self._dirty = True
        return len(ids)

    @property
    def system_in_effect(self) -> str | None:
        """The text of the last system message (the one the model reads as its instructions), or None."""
        return next((m["text"] for m in reversed(self.messages) if m["role"] == "system"), None)

    def restate_system(self, content: str) -> None:
        """Record a system message that restates the one in effect without feeding it again: a client
        that sends its instructions with every turn (OpenAI's Responses API asks that of clients that
        continue a response) leaves them once in the context, not once per turn. The message stands
        in the history with the turn (what reads the turn back, its instructions and tools, sees it)
        and holds no tokens: a system message past the first token whose range is empty
        (`restated`), which the chat template is never given again. InvalidArgument when `content`
        is not the system message in effect, or the session holds no tokens yet."""
        self._check_open()
        self._seal_call()
        if not self.seq.tokens or content != self.system_in_effect:
            raise InvalidArgument(f"session {self.name!r}: only the system message in effect can be restated, "
                                  "once the session holds tokens; add it with add_message")
        at = len(self.seq.tokens)
        self._set_message(len(self.messages), "system", content, at, at)
        self._dirty = True

    def respond(self, messages: list[dict[str, str]], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, trace=None,
                stop: tuple[str, ...] = (), response_format=None, **sampling) -> Iterator[str]:
        """Answer a whole conversation (`{"role", "content"}` dicts, as an OpenAI request sends it)
        as one prompt: the chat template's rendering of all of it, prefilled in chunks at absolute
        positions. This is the cold run of such a request. The session must hold nothing yet, or a
        prefix of exactly those prompt ids (a fork of a session that read the same beginning: its
        KV is reused, the rest computed); its messages become `messages` and the reply
        (`response_format`: as in `generate`)."""
        self._check_open()
        settings, fmt = self._call_settings(max_new_tokens, sampling, response_format)
        self._seal_call()
        tok = self.model.tokenizer
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        have = len(self.seq.tokens)
        if self.seq.tokens != ids[:have]:
            raise InvalidArgument(f"session {self.name!r} does not begin with this conversation's prompt; "
                                  "fork it where they agree, or start a new session")
        if len(self.messages) > len(messages):
            raise InvalidArgument(f"session {self.name!r} holds more messages than this conversation")
        ends = [len(tok.apply_chat_template(messages[:i + 1], add_generation_prompt=False))
                for i in range(len(messages) - 1)] + [len(ids)]
        start = 0
        for ordinal, (m, end) in enumerate(zip(messages, ends)):
            end = max(start, min(end, len(ids)))
            self._set_message(ordinal, m["role"], m["content"], start, end)
            start = end
        self.seq.add(ids[have:])
        yield from self._reply(max_new_tokens, stop, settings, trace, fmt)

    def _history(self) -> list[dict[str, str]]:
        """The messages the chat template has rendered into the context (restated ones left out)."""
        return [{"role": m["role"], "content": m["text"]} for m in self.messages if not restated(m)]

    def _reply(self, max_new_tokens: int, stop, settings: SamplerSettings, trace, fmt: str) -> Iterator[str]:
        reply = len(self.messages)
        self._set_message(reply, "assistant", "", len(self.seq.tokens), len(self.seq.tokens))
        # the call is recorded with the prompt, before its prefill: a turn killed anywhere can be resumed
        call = self._start_call("chat", max_new_tokens, stop, settings, feed=False, message=reply, **_format(fmt))
        yield from self._prefill_steps()
        yield from self._pieces(call, trace)

    def _prefill_steps(self) -> Iterator[str]:
        """`finish_prefill`, as part of a reply's generator: with `prefill_yields`, an empty piece
        after each chunk, so that a scheduler running several sessions can interleave them."""
        for _ in self._fed_chunks():
            if self.prefill_yields:
                yield ""

    def resume(self, *, trace=None) -> Iterator[str]:
        """Finish a generation that was interrupted (killed, Ctrl-C); text pieces. Nothing if none was."""
        self._check_open()
        if not self.active_call:
            return
        yield from self._prefill_steps()
        yield from self._pieces(self.active_call, trace)

    def unfinished_reply_to(self, messages: list[dict[str, str]], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                            stop: tuple[str, ...] = (), response_format=None, **sampling) -> bool:
        """Whether the reply that was interrupted here (a chat call still recorded) is the reply to
        this request: the session's messages before that reply are `messages` (role and text) and
        the call was made with these settings. A request resent after its reply was cut (its client
        got an error, or lost the response) is then answered by finishing that reply (`resume`):
        the reply it would have had, not a second one."""
        call = self._interrupted("chat", max_new_tokens, stop, True, response_format, sampling)
        asked = [{"role": m["role"], "content": m["content"]} for m in messages]
        return call is not None and [{"role": m["role"], "content": m["text"]}
                                     for m in self.messages[:call["message"]]] == asked

    def unfinished_generation_after(self, prompt: list[int] | str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                                    stop: tuple[str, ...] = (), stop_at_eos: bool = True, response_format=None,
                                    **sampling) -> int | None:
        """Where `prompt` begins, when the generation that was interrupted here (a raw call still
        recorded, `begin`'s or `generate`'s) is the one `begin(prompt, ...)` with these settings
        started: the session's tokens just before that generation are the prompt's (ids, or text as
        `begin` read it where it began) and the call was made with these settings. Else None. A
        completion resent after its reply was cut is then answered by finishing that generation
        (`resume`), not by appending its prompt a second time."""
        call = self._interrupted("raw", max_new_tokens, stop, stop_at_eos, response_format, sampling)
        if call is None:
            return None
        end = call["start"]
        tok = self.model.tokenizer
        # (ids, whether they are read at a session's start): text has the model's BOS first there only (`encode_at`)
        if isinstance(prompt, str):
            readings = [(tok.encode_at(prompt, 0), True), (tok.encode_at(prompt, 1), False)]
        else:
            readings = [(list(prompt), None)]
        for ids, at_start in readings:
            base = end - len(ids)
            if base >= 0 and at_start in (None, base == 0) and self.seq.tokens[base:end] == ids:
                return base
        return None

    def _interrupted(self, kind: str, max_new_tokens: int, stop: tuple[str, ...], stop_at_eos: bool, response_format,
                     sampling: dict[str, Any]) -> dict[str, Any] | None:
        """The call interrupted here (still recorded) when it is a `kind` call made with these settings:
        its limit, stops, stopping at EOS, format and sampler settings. Else None."""
        self._check_open()
        call = self.active_call
        if not call or call.get("kind") != kind:
            return None
        settings, fmt = self._call_settings(max_new_tokens, sampling, response_format)
        made = (call["max_new_tokens"], call["stop"], call.get("stop_at_eos", True), call.get("format", ""), self.settings)
        return call if made == (max_new_tokens, list(stop), stop_at_eos, fmt, settings) else None

    def text(self, ids: Iterator[int]) -> Iterator[str]:
        """Text pieces of generated token ids (`generate`'s), no character split across two pieces."""
        decoder = StreamDecoder(self.model.tokenizer)
        for token in ids:
            if piece := decoder.push(token):
                yield piece
        if tail := decoder.flush():
            yield tail

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

    def _call_settings(self, max_new_tokens: int, sampling: dict[str, Any],
                       response_format) -> tuple[SamplerSettings, str]:
        """A call's sampler settings (the session's, with the call's `sampling` over them) and its
        response format (`grammar.canonical`'s text), checked with its max_new_tokens against the
        model before the call changes anything: a bad one is an InvalidArgument that leaves the
        session as it was (no turn added, no call recorded)."""
        fmt = grammar.canonical(response_format)
        if max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
        settings = dataclasses.replace(self.settings, **sampling) if sampling else self.settings
        settings.check_vocab(self.model.config.vocab_size)
        return settings, fmt

    def _start_call(self, kind: str, max_new_tokens: int, stop, settings: SamplerSettings, *, feed: bool = True,
                    **extra) -> dict[str, Any]:
        """Record a call (`_call_settings` checked its settings) and, with `feed`, prefill what is pending."""
        self._check_open()
        if kind != "chat":
            self._seal_call()
        self.settings = settings
        self.active_call = {"kind": kind, "start": len(self.seq.tokens), "max_new_tokens": int(max_new_tokens),
                            "stop": list(stop), **extra}
        self._dirty = True
        self.checkpoint("call")
        if feed:
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
            self.settle(block=False)  # acknowledged as soon as it is durable
            if since >= self._checkpoint_every:
                self.checkpoint("auto", wait=False)  # committed while the next tokens decode
                since = 0

        constraint = None
        if call.get("format"):  # where the reply has got to (a resumed call's tokens so far, replayed)
            constraint = grammar.Constraint(tok, self.model.config.vocab_size, call["format"],
                                            self.seq.tokens[call["start"]:])
        try:
            for event in self.seq.generate(self.settings, seed=self.seed, max_new_tokens=max(remaining, 0),
                                           reply_start=call["start"],
                                           stop_ids=tok.eos_ids if call.get("stop_at_eos", True) else (),
                                           should_stop=should_stop, fed=fed, constraint=constraint):
                writer.write(event.position, event.token, event.logits)
                yield event
                since += 1
            self._end_call()
        finally:
            writer.close()
            if self.lock.held and not sys.is_finalizing():  # at teardown the exit hook has closed it
                self.checkpoint("end")

    def _end_call(self) -> None:
        if self.active_call and self.active_call.get("kind") == "chat":
            self._refresh_reply()
        self.active_call = None
        self._dirty = True

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
            messages = read_messages(db, child.id)
        lock = SessionLock(self.store.session_dir(child.id), name).acquire()
        cache = self.seq.cache.copy_prefix(child.n_cached)  # a paged cache shares its whole blocks
        hidden = self.seq.hidden if child.n_cached == child.n_tokens else None  # a fork at the head
        seq = Sequence(self.model, cache, self.seq.tokens[:child.n_tokens], chunk_size=self.seq.chunk_size,
                       hidden=hidden, reusable=child.n_reusable)
        return Session(self.store, child, self.model, seq, lock, 0, messages)

    def pack(self, *, progress: Progress | None = None) -> dict[str, int]:
        """Checkpoint, then move this session's extents into compressed blobs and free its KV files;
        `progress(done, total)` gets the KV bytes packed so far after each extent."""
        self.checkpoint("pack")
        return pack_session(self.store, self.id, self.name, progress)

    def close(self) -> None:
        """Checkpoint, release the lock, and hand the cache's memory to the next session opened."""
        if self.lock.held:
            try:
                self.checkpoint("close")
            finally:
                self._release()

    def discard(self) -> None:
        """Close without a checkpoint: what changed since the last one is dropped, the store keeps the
        session as that checkpoint left it, and the next `open` restores it from there. For a session
        whose writes failed (a full disk): its memory may hold a turn the store never took. A commit
        still in flight is waited for first (it writes under this session's lock); its error, the
        one the caller already had, is not raised again."""
        if self.lock.held:
            try:
                self.settle()
            except Exception:  # noqa: BLE001 -- that commit failed; the checkpoint before it stands
                pass
            finally:
                self._release()

    def _release(self) -> None:
        """The lock released and the cache's memory handed to the next session opened."""
        self.lock.release()
        self.seq.close()
        _OPEN.discard(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_open_sessions() -> None:
    """Checkpoint and unlock what a script left open (an unfinished `generate`, a missing `close`)
    while the interpreter still works: the generator's own cleanup runs later, at teardown, when
    imports fail."""
    for s in list(_OPEN):
        try:
            s.close()
        except Exception as e:  # noqa: BLE001 -- one line, not a traceback at exit
            print(f"kvstore: session {s.name!r} could not be checkpointed at exit ({e}); its last "
                  "checkpoint stands", file=sys.stderr)


def _format(fmt: str) -> dict[str, str]:
    """A call record's response format (`grammar.canonical`'s text), where the call has one."""
    return {"format": fmt} if fmt else {}


class _Scoring:
    """The entries of tokens a session is about to read (`append_scored`, `begin`): the first one's
    from the state the session holds, each later one's from the logits row its prefill computes
    before it (`rows`, `Sequence.prefill`'s callback)."""

    def __init__(self, session: Session, ids: list[int], top: int):
        self.session, self.ids, self.top = session, ids, top
        self.first = len(session.seq.tokens)
        self.scored: dict[int, dict[str, Any]] = {}  # position -> its token's entry
        if ids and self.first and session.seq.hidden is not None:  # the state the first one is predicted from
            self.scored[self.first] = token_logprobs(session.model.head(session.seq.hidden).to("cpu"), ids[0], top)

    def rows(self, a: int, logits) -> None:
        """`[b - a, vocab]`: row i predicts position a + i + 1."""
        tokens, end = self.session.seq.tokens, self.first + len(self.ids)
        for i in range(logits.shape[0]):
            if self.first <= a + i + 1 < end:  # (row i alone, in memory of its own: as a sampled token's row)
                self.scored[a + i + 1] = token_logprobs(logits[i].clone(), tokens[a + i + 1], self.top)

    def entries(self) -> list[dict[str, Any] | None]:
        tokens = self.session.seq.tokens
        return [None if p not in self.scored else {"position": p, "token": tokens[p], **self.scored[p]}
                for p in range(self.first, self.first + len(self.ids))]
