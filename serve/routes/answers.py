"""What chat and completions share: the session a request runs on, its job, and its answer
(whole, or streamed with resumable ids); `Reply` holds a reply's pieces, its subclasses
(`chat.ChatReply`, `completions.CompletionReply`) give their API's shapes.

A request that names a session (`X-Session-Id`, or `session` in the body) runs on it; one that
names none runs in a session of its own (`chatcmpl-...`, `cmpl-...`), made from the longest
stored prefix of its prompt and kept as a prefix-cache entry once the reply is delivered (with
`--prefix-cache 0`: made new, and deleted). When the client leaves a stream before its end, the
session is kept as a prefix-cache entry too (deleted with `--prefix-cache 0`), so that
`Last-Event-ID` can finish it until the cache's budget evicts it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from ..deps import service
from ..failures import ApiError
from ..service import Run
from ..streams import (chained, data, event_id, event_stream, first_events, header_text, parse_last_event_id,
                       trace_line, usage)
from ..tenants import Tenant


def session_of(body_session: str | None, header: str | None, resume, own_name: str) -> tuple[str, bool]:
    """(the session's public name, whether this request made it up)."""
    named = body_session or header_text(header)
    if named and resume and resume.session != named:
        raise ApiError(400, f"Last-Event-ID names session {resume.session!r}, the request {named!r}",
                       param="Last-Event-ID", code="invalid_value")
    if named:
        return named, False
    if resume:
        return resume.session, True
    return own_name, True


async def answer(request: Request, body, who: Tenant, x_session_id: str | None, last_event_id: str | None, *,
                 job: dict[str, Any], reply_class: type["Reply"], route: str):
    """Run `job` (its kind and input; the rest comes from `body`'s common fields) on the request's
    session and answer it: JSON, or server-sent events when `body.stream`."""
    svc = service(request)
    svc.check_model(body.model)
    resume = parse_last_event_id(last_event_id)
    request_id = uuid.uuid4().hex[:24]
    public, own = session_of(body.session, x_session_id, resume, f"{reply_class.prefix}-{request_id}")
    spec: dict[str, Any] = {
        **job, "session": who.stored(public), "max_tokens": svc.max_tokens(body.limit()), "stop": body.stop,
        "sampling": body.sampler(), "create": svc.new_session_settings(body.seed, body.sampler()), "seed": body.seed,
        "trace": body.kvstore_trace, "logprobs": body.alternatives()}
    if resume:
        spec.update(after=resume.after, reply_start=resume.start)
    elif own and svc.config.prefix_cache:  # from the longest stored prefix of its prompt (C10)
        spec["prefix"] = {"scope": who.prefix}
    run = Run(spec, who, public, id=request_id, route=route)
    events = svc.run(run)
    try:
        first = await first_events(events)
    except ApiError:
        if own and not resume and run.started:  # refused before any output: its session is no one's
            await svc.drop_session(spec["session"], retain=False, missing_ok=True)
        raise
    reply = reply_class(run, svc.model_id, body.kvstore_trace, first)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(reply.stream(chained(first, events), include_usage, svc if own else None,
                                         resumed=resume is not None), svc.config.keep_alive)
    async for event in chained(first, events):
        reply.take(event)
    if own:
        await svc.drop_session(spec["session"])
    return JSONResponse(reply.whole())


class Reply:
    """The pieces of one reply as they come, and its two shapes: whole, or as server-sent chunks.
    Subclasses give the shapes of their API (`chat.ChatReply`, `completions.CompletionReply`)."""

    prefix: str  # of the reply's id and of the session a request of its own runs in
    object: str  # of a streamed chunk

    def __init__(self, run: Run, model: str, trace: bool, first: list[dict[str, Any]] = ()):
        self.run, self.model, self.trace = run, model, trace
        self.id = f"{self.prefix}-{run.id}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.lines: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any] | None] | None = None if run.spec.get("logprobs") is None else []
        self.start: int | None = run.spec.get("reply_start")  # else the first token's position, when known
        if self.start is None:
            self.start = next((e["position"] for e in first if e["event"] == "token"), None)
        self.end: dict[str, Any] | None = None

    def take(self, event: dict[str, Any]) -> str:
        """Record an event; the text it adds."""
        kind = event["event"]
        if kind == "token":
            if self.start is None:
                self.start = event["position"]
            self.lines.append(trace_line(event))
            if self.logprobs is not None:
                self.logprobs.append(event.get("logprobs"))
        elif kind == "end":
            self.end = event
        else:
            return ""
        self.text.append(event["text"])
        return event["text"]

    def extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session": self.run.public, "context": self.run.context}
        if self.trace:
            out["trace"] = self.lines
        return out

    def head(self, **fields) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **fields}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def piece(self, text: str, finish: str | None = None, logprobs: list | None = None, **extra) -> dict[str, Any]:
        """One chunk: `text`, and the logprobs entries of the tokens it reports (None: not asked for)."""
        raise NotImplementedError

    def stream(self, events: AsyncIterator[dict[str, Any]], include_usage: bool, drop, *,
               resumed: bool = False) -> AsyncIterator[ServerSentEvent]:
        """The reply as server-sent events; an error once the stream has begun is an
        `{"error": ...}` event, as OpenAI sends it, and ends the stream. `drop` (the service, for a
        session made for this request): that session is kept as a prefix-cache entry once the stream
        is over, delivered or left by its client (`Service.drop_after`)."""
        out = self._events(events, include_usage, resumed)
        return out if drop is None else drop.drop_after(out, self.run.spec["session"])

    async def _events(self, events: AsyncIterator[dict[str, Any]], include_usage: bool,
                      resumed: bool) -> AsyncIterator[ServerSentEvent]:
        public = self.run.public
        for chunk in [] if resumed else self.opening():  # its id: the reply's start, nothing received yet
            yield ServerSentEvent(data(chunk), id=event_id(public, self.start, (self.start or 0) - 1))
        try:
            async for event in events:
                text = self.take(event)
                if event["event"] == "token" and (text or self.trace or self.logprobs is not None):
                    extra = {"kvstore": {"trace": [trace_line(event)]}} if self.trace else {}
                    if self.logprobs is not None:  # a token that released no text yet still has its entry
                        extra["logprobs"] = self.logprobs[-1:]
                    yield ServerSentEvent(data(self.piece(text, **extra)),
                                          id=event_id(public, self.start, event["position"]))
        except ApiError as e:
            yield ServerSentEvent(data(e.body()))
            return
        end = self.end
        yield ServerSentEvent(data(self.piece(end["text"], end["finish_reason"], kvstore={"session": public})),
                              id=event_id(public, self.start, "end"))
        done = event_id(public, self.start, "end")
        if include_usage:
            yield ServerSentEvent(data(self.head(choices=[], usage=usage(end))), id=done)
        yield ServerSentEvent("[DONE]", id=done)
