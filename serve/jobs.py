"""What an engine process does for one request: a generator of events (dicts) per job.

The engine loop (`engine.py`) advances every running job by one event in turn, so replies on
different sessions interleave token by token. Kinds:

- `chat`: a conversation (OpenAI messages) on a named session. Stored messages that begin the
  request's are kept and only the new ones fed (`Session.chat`, as the library would); a request
  that differs from what the session holds is the cold run of its messages (`Session.respond`), on
  a fork of the session at the last position that both computed alike (`plan`: a chunk boundary
  unless the model computes every row alone), so the reply
  is byte-identical to the same request on a new session. The session's name then names the fork;
  the old branch stays as `NAME@N`. The same request sent again after its reply was cut (no
  Last-Event-ID: a retry, `retried`) is answered with that reply, finished (`replay`).
- `complete`: raw text appended to a session and continued (`/v1/completions`), as one call that
  records the prompt with the generation (`Session.begin`). The same completion sent again after
  its generation was cut (no Last-Event-ID: `retried_prompt`) is that generation, finished (`replay`),
  its prompt not appended again.
- any job with `after` (a resumed stream): the reply that was interrupted after that position is
  replayed from the store and, if it was cut short, finished (`Session.resume`): only what comes
  after `after` is sent. A job run again after its engine died (`pool.Pool._resubmit`: `after` -1
  where no token came) goes on from the call the dead engine recorded; a completion whose call had
  ended is replayed from `base` (the session's length when it began, from its first start event)
  instead of being appended again, and its echoed prompt is sent again where it never came
  (`prompt_sent`); one recorded nothing runs afresh.
- a `chat` or `complete` job with `prefix` (a request that names no session) starts its session
  from the longest stored prefix of its prompt (`prefix_cache.py`: contract C10);
- `create`, `fork`, `delete`, `import`: the writes on stored sessions that need the model or the
  writer's lock (create, fork, delete and import, run again after their engine died, answer a
  write found done as done: `manage`); `retain`: a request's own session kept as a prefix-cache entry, the
  entries evicted beyond the budget.

Events: `start` (how the context was obtained; a completion's on a named session: its `base`), `prompt` (a completion with `echo`: the prompt's
text, and its tokens' entries where logprobs were asked for), `token` (replies.token_events), `end`
(usage, finish reason) or `error` (an OpenAI-shaped error, `failures.py`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import kvstore

from . import prefix_cache
from .failures import ApiError, from_library
from .replies import ReplyText, Tokens, stored_pieces, token_events
from .streams import END

log = logging.getLogger("kvstore.serve")


@dataclass
class Plan:
    kind: str  # "continue" (feed the new messages) or "cold" (answer the whole request, maybe on a fork)
    new: list[dict[str, str]]  # continue: the messages past the stored ones
    fork_at: int = 0  # cold: reuse the session's first fork_at positions (0: a new session)


def held(session, end: int | None = None) -> list[dict[str, str]]:
    """The session's messages (the first `end`) as a request sends them: role and content."""
    return [{"role": m["role"], "content": m["text"]} for m in session.messages[:end]]


def plan(session, messages: list[dict[str, str]]) -> Plan:
    """How to answer `messages` on `session` (see the module's docstring)."""
    stored = held(session)
    if not session.tokens:
        return Plan("cold", [])
    new = messages[len(stored):]
    if stored == messages[:len(stored)] and new and new[-1]["role"] == "user" and not session.active_call:
        return Plan("continue", new)
    prompt = session.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    common = 0
    for a, b in zip(session.tokens, prompt):
        if a != b:
            break
        common += 1
    # KV computed as a cold run computes it (`Sequence.reusable`): whole chunks of the session's first
    # prefill, or every position where the model computes each row alone; a fork is cut at a chunk
    # boundary unless the rows are computed alone (then any position is one)
    reuse = min(common - 1, session.seq.reusable)
    if not session.model.row_invariant:
        reuse = reuse // session.chunk_size * session.chunk_size
    return Plan("cold", [], fork_at=max(reuse, 0))


def chat(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if job.get("after") is not None:
        yield from resume(engine, job)
        return
    check_sampling(engine, job)
    messages = job["messages"]
    if job.get("prefix") is not None:  # a request of its own: from the longest stored prefix (C10)
        prompt = engine.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        session, how, restore, cached = prefix_cache.open_session(engine, job, prompt)
        p, lookup = Plan("cold", []), {"prefix_queried": len(prompt), "prefix_hit": cached}
    else:
        session, how, restore = engine.writer(job["session"], create=job.get("create"))
        check_seed(session, job.get("seed"))
        if retried(session, job):  # the request of a reply that was cut, resent: that reply, finished
            yield from replay(engine, job, session, how, restore)
            return
        p, lookup = plan(session, messages), {"created": how == "computed"}
        cached = session.n_cached
        if p.kind == "cold" and session.tokens:
            session, cached = engine.branch(session, p.fork_at), p.fork_at
            how = "reused" if p.fork_at else "computed"
    yield {"event": "start", "context": how, **restore, **lookup}
    sampling = job.get("sampling") or {}
    tokens = Tokens.for_job(job, engine.model.tokenizer)
    args = dict(max_new_tokens=job["max_tokens"], trace=tokens, stop=tuple(job.get("stop") or ()),
                response_format=job.get("format"), **sampling)
    if p.kind == "continue":
        pieces = converse(session, p.new, **args)
    else:
        pieces = session.respond(messages, **args)
    yield from reply(engine, session, pieces, tokens, job, cached)


def retried(session, job: dict[str, Any]) -> bool:
    """Whether a chat request resent without Last-Event-ID is the one whose reply a cut left
    unfinished in the session (an engine that died, a full disk, a client that went away): the same
    messages and settings (`Session.unfinished_reply_to`). It is then answered with that reply, its
    stored tokens replayed and the rest generated, as the uninterrupted request would have been: a
    retry changes nothing (else it would be answered again, cold, on a branch). Not where
    log-probabilities are asked for: the stored tokens' were not kept."""
    return job.get("logprobs") is None and session.unfinished_reply_to(
        job["messages"], job["max_tokens"], stop=tuple(job.get("stop") or ()), response_format=job.get("format"),
        **(job.get("sampling") or {}))


def converse(session, new: list[dict[str, str]], **args) -> Iterator[str]:
    """The reply to `new` messages after the session's own: all but the last fed as context
    (`add_message`), the last, a user message, answered (`Session.chat`)."""
    for m in new[:-1]:
        session.add_message(m["role"], m["content"])
    return session.chat(new[-1]["content"], **args)


def check_sampling(engine, job: dict[str, Any]) -> None:
    """The request's sampler settings against the model (a logit_bias id past its vocabulary), before
    the job opens, makes or extends a session: a refused request leaves the session as it was."""
    if sampling := job.get("sampling"):
        kvstore.SamplerSettings(**sampling).check_vocab(engine.model.config.vocab_size)


def check_seed(session, seed: int | None) -> None:
    """A session draws with the seed it was made with (C3: a draw is a function of seed and position)."""
    if seed is not None and seed != session.seed:
        raise kvstore.errors.InvalidArgument(
            f"session {session.name!r} was made with seed {session.seed}: a session's seed is fixed when it is "
            "created; leave seed out, or pass that one")


def complete(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if job.get("after") is not None:
        yield from resume(engine, job)
        return
    check_sampling(engine, job)
    text = job["prompt"] if isinstance(job["prompt"], str) else None  # else token ids, as they are
    tokens = Tokens.for_job(job, engine.model.tokenizer)
    top = None
    if job.get("prefix") is not None:  # a request of its own: from the longest stored prefix (C10)
        prompt = job["prompt"] if text is None else engine.model.tokenizer.encode_at(text, 0)  # as a new session reads it
        session, how, restore, cached = prefix_cache.open_session(engine, job, prompt)
        yield {"event": "start", "context": how, **restore, "prefix_queried": len(prompt), "prefix_hit": cached}
        given: list[int] | str = prompt[len(session.tokens):]
    else:
        session, how, restore = engine.writer(job["session"], create=job.get("create"))
        check_seed(session, job.get("seed"))
        if (base := retried_prompt(session, job)) is not None:  # a cut completion's request, resent: it, finished
            yield from replay(engine, job, session, how, restore, base=base)
            return
        # base: where the request's tokens begin, should it be run again after its engine died (`recorded_reply`)
        yield {"event": "start", "context": how if session.tokens else "computed", **restore, "created": how == "computed",
               "base": len(session.tokens)}
        cached = session.n_cached
        given = list(job["prompt"]) if text is None else text
        if job.get("echo"):  # every prompt token's entry (a request of its own that scores reuses no prefix)
            top = tokens.top_logprobs
    # the prompt is recorded with the call (`Session.begin`): an engine that dies while it reads the
    # prompt leaves a call that `resume` finishes (a prompt recorded before its call stood without one
    # after such a death, and the request, run again, appended it a second time)
    scored = session.begin(given, job["max_tokens"], top=top, stop=tuple(job.get("stop") or ()),
                           response_format=job.get("format"), **(job.get("sampling") or {}))
    if job.get("echo"):
        yield prompt_event(engine, job, tokens, scored, session.tokens)
    yield from reply(engine, session, session.resume(trace=tokens), tokens, job, cached)


def retried_prompt(session, job: dict[str, Any]) -> int | None:
    """Where its prompt began, when a completion resent without Last-Event-ID is the one whose
    generation a cut left unfinished in the session (the same prompt just before it, the same
    settings: `Session.unfinished_generation_after`): it is then answered with that generation, its
    stored tokens replayed and the rest generated, rather than by appending its prompt a second time.
    Not where log-probabilities are asked for (the stored tokens' were not kept)."""
    if job.get("logprobs") is not None:
        return None
    return session.unfinished_generation_after(
        job["prompt"], job["max_tokens"], stop=tuple(job.get("stop") or ()), response_format=job.get("format"),
        **(job.get("sampling") or {}))


def prompt_event(engine, job: dict[str, Any], tokens: Tokens, scored: list | None, held: list[int]) -> dict[str, Any]:
    """The prompt as an echoing reply begins with it, and its tokens' entries where they were scored
    (`scored`: the last of the session's tokens `held`)."""
    text = job["prompt"] if isinstance(job["prompt"], str) else engine.model.tokenizer.decode(job["prompt"])
    return {"event": "prompt", "text": text, "logprobs": None if scored is None else [
        tokens.prompt_entry(e, token) for e, token in zip(scored, held[len(held) - len(scored):])]}


def reply(engine, session, pieces, tokens: Tokens, job: dict[str, Any], cached: int, *, after: int = -1,
          prompt_tokens: int | None = None, finish: str | None = None) -> Iterator[dict[str, Any]]:
    """The token events of a generation, then its end (usage, finish reason, where it ran)."""
    tail = ""
    for event in token_events(pieces, tokens, ReplyText(job.get("stop") or ()), after):
        if event["event"] == "tail":
            tail = event["text"]
        else:
            yield event
    lines = tokens.lines
    start = lines[0]["position"] if lines else len(session.tokens)
    reason = finish or {"eos": "stop", "stop": "stop"}.get(session.stop_reason or "", "length")
    prompt = prompt_tokens if prompt_tokens is not None else start
    # cached: of the prompt (a resumed reply's own stored tokens are restored too, but are no prompt)
    yield {"event": "end", "text": tail, "finish_reason": reason, "session": session.name,
           "prompt_tokens": prompt, "cached_tokens": min(cached, prompt), "completion_tokens": len(session.tokens) - start,
           "checkpoint_seconds": session.last_checkpoint_seconds,
           **engine.resident()}


def resume(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Replay the reply that began at `reply_start` after position `after`, finishing it if it was
    interrupted (the client resent its request with Last-Event-ID)."""
    try:
        session, how, restore = engine.writer(job["session"], wait=True)
    except kvstore.errors.SessionNotFound:
        if job.get("reply_start") is not None:
            raise
        session, how, restore = None, "computed", {}  # an engine that died before it created the session
    yield from replay(engine, job, session, how, restore)


def replay(engine, job: dict[str, Any], session, how: str, restore: dict[str, Any], *,
           base: int | None = None) -> Iterator[dict[str, Any]]:
    """`resume` on the session opened for it (None: there is none: the request is run afresh), and
    the whole of a cut reply where a request resent without Last-Event-ID is the one it answers
    (`chat`, `complete`: no `reply_start`, `after` None; a completion's `base`: where its prompt
    began, said in the start event as `complete` says it)."""
    call = session.active_call if session is not None else None
    sent = job.get("reply_start")  # where the reply the client has began (None: it has no token of it)
    if sent is not None:
        start = int(sent)
    elif call is not None:
        start = call["start"]
    else:
        start = recorded_reply(session, job)
    if start is None:  # it died before it recorded anything: nothing was sent
        yield from KINDS[job["kind"]](engine, {**job, "after": None})
        return
    yield {"event": "start", "context": how, **restore, **({"base": base} if base is not None else {})}
    tokens = Tokens.for_job(job, engine.model.tokenizer)
    if job.get("echo") and sent is None and not job.get("prompt_sent"):  # the echoed prompt never reached the API
        if tokens.top_logprobs is not None:
            raise ApiError(503, f"the engine stopped after it had read and scored the prompt, before it sent the "
                                f"scores; they cannot be sent again (the logits are gone once used). The prompt stands "
                                f"in session {session.name!r}: resend the request to a new session", type="server_error",
                           code="engine_failed")
        yield prompt_event(engine, job, tokens, None, session.tokens)
    after = int(job["after"]) if sent is not None else start - 1
    if after >= END and call is None:  # the client had the whole reply, up to its end event
        after = len(session.tokens) - 1
    known = call is not None or after + 1 <= len(session.tokens)  # a cut reply's client may be past its checkpoint
    if (call is not None and call["start"] != start) or not 0 <= start <= after + 1 or not known:
        raise kvstore.errors.InvalidArgument(
            f"Last-Event-ID does not name a position of the last reply of session {session.name!r}; "
            "resend the request without it")
    tok = session.model.tokenizer
    stored = session.tokens[start:]
    pieces = stored_pieces(kvstore.StreamDecoder(tok), stored, start, tokens, tok.eos_ids)
    finish = None
    if call is not None:
        pieces = itertools.chain(pieces, session.resume(trace=tokens))
    else:  # it had ended: say why, as the uninterrupted stream did
        finish = "stop" if (stored and stored[-1] in tok.eos_ids) or len(stored) < job["max_tokens"] else "length"
    yield from reply(engine, session, pieces, tokens, job, session.n_cached, after=after, prompt_tokens=start,
                     finish=finish)


def recorded_reply(session, job: dict[str, Any]) -> int | None:
    """Where the reply began of a completion whose prompt an engine that died had recorded, its call
    ended too (else `resume` goes on from the call): `base` (the session's length when the request
    began, from its start event) plus the prompt's tokens. None where the session holds nothing past
    `base`: nothing of the request was recorded."""
    base = job.get("base")
    if session is None or job["kind"] != "complete" or base is None or len(session.tokens) <= base:
        return None
    prompt = job["prompt"]
    ids = list(prompt) if not isinstance(prompt, str) else \
        session.model.tokenizer.encode_at(prompt, base)  # as `Session.begin` read it
    if session.tokens[base:base + len(ids)] != ids:
        raise kvstore.errors.SessionBusy(f"session {session.name!r} changed while this request was interrupted; "
                                         "resend it")
    return base + len(ids)


def manage(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """create / fork / delete / import / retain: the writes that need the model or the session's writer lock
    (held here while the session is open).

    create, fork, delete and import say `start` once their checks passed, just before they write:
    run again after their engine died (`base` given: the first run got that far), a write
    found done is answered as the first run would have answered it (the session made, the fork or
    import made, the session gone) instead of as a conflict (409) or a missing session (404) the
    client never caused."""
    op, name = job["kind"], job["session"]
    again = job.get("base") is not None
    if op == "create":
        if not (again and engine.store.exists(name)):
            engine.store.check_new_name(name)
            yield writing()
            engine.store.create(name, engine.model, **job["settings"])
    elif op == "fork":
        if not (again and engine.store.exists(job["new_name"])):
            engine.checkpoint(name)
            engine.store.check_new_name(job["new_name"])
            yield writing()
            engine.store.fork(name, job["new_name"], job.get("at"))
        name = job["new_name"]
    elif op == "delete":
        if not (again and not engine.store.exists(name)):
            engine.store.info(name)  # SessionNotFound, before the start that says it was there
            yield writing()
            engine.delete(name)
    elif op == "import":
        name = job.get("new_name") or engine.store.archive_name(job["path"])  # by default the archive's own
        if not (again and engine.store.exists(name)):
            engine.store.check_new_name(name)
            yield writing()
            engine.store.import_(job["path"], name, engine.model)
    elif op == "retain":
        yield {"event": "end", "session": name, **prefix_cache.retain(engine, job)}
        return
    yield {"event": "end", "session": name}


def writing() -> dict[str, Any]:
    """A management job's start: its checks passed, it writes now (`manage`)."""
    return {"event": "start", "base": 0}


def tokenize(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The ids the model reads for a prompt (as a completion's prompt on a new session, or without
    the model's BOS) or for chat messages (through its chat template, as a new session's chat)."""
    tok = engine.model.tokenizer
    if job.get("messages") is not None:
        ids = tok.apply_chat_template(job["messages"], add_generation_prompt=job["add_generation_prompt"])
    else:
        ids = tok.encode(job["prompt"], add_bos=None if job["add_special_tokens"] else False)
    yield {"event": "end", "tokens": ids, "max_model_len": engine.model.config.max_context}


def detokenize(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The text of token ids (ids outside the vocabulary: a ModelError, a 400)."""
    engine.model.check_ids(job["tokens"])
    yield {"event": "end", "prompt": engine.model.tokenizer.decode(job["tokens"])}


KINDS = {"chat": chat, "complete": complete, "tokenize": tokenize, "detokenize": detokenize,
         **{k: manage for k in ("create", "fork", "delete", "import", "retain")}}


def run(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The job's events; a library error becomes an `error` event, and the session is left as its
    last checkpoint left it: the engine drops what it held of it in memory (`Engine.discard`), so a
    turn that failed midway (a full disk) is not carried into the next request, which restores the
    session from the store (a stream cut by the error resumes from there with Last-Event-ID). A
    named session that the job made (its start event says `created`, kept here) and that failed
    before any token (a prompt beyond the context, say) is deleted first: it holds nothing anyone
    sent, and kept it would stay in the store, empty, for good. Here, in the job, no other request
    on that name can run in between (they wait for this one's turn)."""
    created = output = False
    try:
        for event in KINDS[job["kind"]](engine, job):
            if event["event"] == "start":
                created = event.pop("created", False)
            output = output or event["event"] == "token"
            yield event
    except GeneratorExit:
        raise
    except Exception as e:  # noqa: BLE001 -- every failure is an answer to the client, never a dead engine
        if job.get("session"):
            engine.discard(job["session"])
        if created and not output:
            delete_made(engine, job["session"])
        yield from_library(e).to_event()


def delete_made(engine, name: str) -> None:
    """Delete the session a failed job made; a failure to is logged (it is listed, empty: nothing lost)."""
    try:
        engine.delete(name)
    except Exception as e:  # noqa: BLE001 -- the job's own error is the answer
        log.warning("could not delete session %s, made by a request that failed before any output: %s", name, e)
