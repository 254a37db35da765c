"""The engine's side of the Responses and Conversations APIs: jobs on the sessions behind them.

A conversation is a session; its items are the session's messages, appended only. A response id
names a session that holds the context up to the end of that response and is never written again:

- `conversation`: the input is chatted on the conversation's session (the job's `session`), and at
  the end the conversation is forked, at rest, into the response's session (`response`): its KV
  shared on disk, not copied. Only the committed rows of the conversation are read, so the fork
  needs no writer lock and C7 holds whichever engine the response is pinned to;
- `previous_response_id`: the response's session is a fork of the earlier one's (`base`), made at
  rest by the engine the new session is pinned to, which then opens it and chats the input on it.
  Continuing from an older response is forking an older session: nothing else changes. On either
  path the input's instructions, when they are the ones in effect, are restated, not read again
  (`unrepeated`);
- neither: a new session (`create` gives its settings), made by reference from the longest stored
  prefix of the input's prompt where the prefix cache is on (`prefix`: as a chat request that names
  no session; a client that resends the whole history each turn, as agent frameworks do by default,
  reads only what is new), the input then answered as one conversation (`Session.respond`, a cold
  run's bits).

A request sent again after its reply was cut, without Last-Event-ID (the same input and settings
on the same conversation: `retried_input`), is answered with that reply, finished, rather than
appending its input a second time.

Kinds (added to `jobs.KINDS` by `engine.py`): `response` (a generation: `jobs.reply`'s events), `conversation`
(create one, with its first items) and `items` (append items to one). A resumed `response`
(`after`, from Last-Event-ID or an engine restart) is `jobs.resume` on the written session,
followed by the snapshot if it was not made yet.
"""

from __future__ import annotations

from typing import Any, Iterator

from kvstore import errors

from . import prefix_cache
from .jobs import converse, held, replay, reply, resume, retried
from .replies import Tokens


def response(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    events = resume(engine, job) if job.get("after") is not None else _fresh(engine, job)
    for event in events:
        if event["event"] == "end":
            _snapshot(engine, job)
        if event["event"] in ("start", "end") and "message" not in event:
            event = {**event, "message": _reply_ordinal(engine.sessions.get(job["session"]))}
        yield event


def _reply_ordinal(session) -> int | None:
    """The ordinal of the message the reply is (or was last) written to: the output item's id."""
    if session is None:
        return None
    if session.active_call and "message" in session.active_call:
        return session.active_call["message"]
    return next((m["ordinal"] for m in reversed(session.messages) if m["role"] == "assistant"), None)


def _fresh(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    name, messages = job["session"], job["messages"]
    tokens = Tokens.for_job(job, engine.model.tokenizer)
    args = dict(max_new_tokens=job["max_tokens"], trace=tokens, response_format=job.get("format"),
                **(job.get("sampling") or {}))
    if job.get("prefix") is not None:  # a response on no earlier state: from the longest stored prefix (C10)
        prompt = engine.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        session, how, restore, cached = prefix_cache.open_session(engine, job, prompt)
        yield {"event": "start", "context": how, "message": len(messages), **restore,
               "prefix_queried": len(prompt), "prefix_hit": cached}
        yield from reply(engine, session, session.respond(messages, **args), tokens, job, cached)
        return
    if job.get("base"):
        try:
            engine.store.fork(job["base"], name)
        except errors.SessionExists:
            pass  # an engine that died before the reply began had forked it; nothing was written since
    session, how, restore = engine.writer(name, create=job.get("create"))
    if retried_input(session, job):  # the input of a reply that was cut, sent again: that reply, finished
        yield from replay(engine, job, session, how, restore)
        return
    cached = session.n_cached
    yield {"event": "start", "context": how if session.tokens else "computed", "message":
           len(session.messages) + len(messages), **restore}
    yield from reply(engine, session, converse(session, unrepeated(session, messages), **args), tokens, job, cached)


def retried_input(session, job: dict[str, Any]) -> bool:
    """Whether the input is that of the reply a cut left unfinished on the session (a client that
    lost the response, or got an error, and sends the same request again): the messages just before
    that reply are the input (instructions restated included) and the settings are the same
    (`jobs.retried`). Appended again, the input would stand twice in the conversation."""
    call, given = session.active_call, job["messages"]
    if not call or "message" not in call or call["message"] < len(given):
        return False
    before = held(session, call["message"])
    return before[-len(given):] == given and retried(session, {**job, "messages": before})


def unrepeated(session, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The input past a leading system message that restates the one in effect: the Responses API asks
    clients that continue a response or a conversation to send their instructions (and tools) with
    every turn; read again each turn they would fill the context. Restated, the message stands in the
    turn (its instructions and tools read back from it) and adds no token (`Session.restate_system`)."""
    first = messages[0] if messages else None
    if first is None or first["role"] != "system" or len(messages) < 2 or not session.tokens \
            or first["content"] != session.system_in_effect:
        return messages
    session.restate_system(first["content"])
    return messages[1:]


def _snapshot(engine, job: dict[str, Any]) -> None:
    """The response's own session, when the reply was written on the conversation's."""
    if job.get("response") and job["response"] != job["session"]:
        try:
            engine.store.fork(job["session"], job["response"])  # the reply's end is committed (checkpoint "end")
        except errors.SessionExists:
            pass  # made before an engine restart or a resumed stream


def conversation(engine, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A new conversation (a new session) holding `items`, or `items` appended to one.

    Its start says how many messages the session held before the items (`base`). Run again after its
    engine died (`base` given), the conversation the first run made is taken as made, and items that
    stand at `base` already are the first run's, committed before its end event was lost (or the
    same items, added there meanwhile by another request): answered as such, not added twice."""
    name, items, base = job["session"], job.get("items") or [], job.get("base")
    if job["kind"] == "conversation" and not (base is not None and engine.store.exists(name)):
        engine.store.check_new_name(name)
        yield {"event": "start", "base": 0}  # a new conversation holds no message
        session, _, _ = engine.writer(name, create=job["create"])
    else:
        session, _, _ = engine.writer(name, wait=base is not None)  # run again: its dead engine's lock goes
        if base is None:
            yield {"event": "start", "base": len(session.messages)}
    if base is not None and _written(session.messages[base:base + len(items)], items):
        yield {"event": "end", "session": name, "first": base, "count": len(items)}
        return
    first = len(session.messages)
    for m in items:
        session.add_message(m["role"], m["content"])  # pending: fed with the next response's input
    session.checkpoint("items")
    yield {"event": "end", "session": name, "first": first, "count": len(session.messages) - first}


def _written(stored: list[dict[str, Any]], items: list[dict[str, str]]) -> bool:
    """Whether the stored messages are the items, role and text."""
    return len(stored) == len(items) and all(s["role"] == m["role"] and s["text"] == m["content"]
                                             for s, m in zip(stored, items))


KINDS = {"response": response, "conversation": conversation, "items": conversation}
