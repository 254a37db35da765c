"""What chat and completions share: the session a request runs on, its job, and its answer
(whole, or streamed with resumable ids); `Reply` holds a reply's pieces, its subclasses
(`chat.ChatReply`, `completions.CompletionReply`) give their API's shapes.

A request for n > 1 choices names no session: choice i runs in a session of its own (the first
`chatcmpl-ID`, then `chatcmpl-ID-1`, ...), its seed the request's seed + i where one is given (so it
is the reply of a one-choice request with that seed, bit for bit). The first choice reads the
prompt; the others start once it has (its first token came), fork its whole chunks from the prefix
cache and read only the rest, and all decode in the engine's steps together. The answer holds the
choices in order; the usage counts the prompt once and every choice's tokens; a stream interleaves
the choices' chunks as they come, each with its index, and carries no event ids (resuming is per
session: `Last-Event-ID` goes with one-choice requests). Each session is kept as a prefix-cache
entry afterwards, as a one-choice request's is. A completions request with a list of prompts is
answered the same way: n choices of each prompt, in order (choice k * n + i: prompt k's i-th), the
prompts read together (each one's first choice), its usage counting each prompt once.

A request that names a session (`X-Session-Id`, or `session` in the body) runs on it; one that
names none runs in a session of its own (`chatcmpl-...`, `cmpl-...`), made from the longest
stored prefix of its prompt and kept as a prefix-cache entry once the reply is delivered (with
`--prefix-cache 0`: made new, and deleted). When the client leaves a stream before its end, the
session is kept as a prefix-cache entry too (deleted with `--prefix-cache 0`), so that
`Last-Event-ID` can finish it until the cache's budget evicts it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from ..deps import service
from ..failures import ApiError
from ..service import Run
from ..streams import (chained, data, event_id, event_stream, first_events, header_text, parse_last_event_id,
                       trace_line, usage)
from ..tenants import Tenant

T = TypeVar("T")


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
                 job: dict[str, Any], reply_class: type["Reply"], route: str, inputs: list[dict[str, Any]] = ({},)):
    """Run `job` (its kind and input; the rest comes from `body`'s common fields) on the request's
    session and answer it: JSON, or server-sent events when `body.stream`. `inputs`: the job's input
    per prompt, where a request gives several (the completions API's list of prompts): each prompt's
    `n` choices then follow the one before's, as separate requests would answer them."""
    svc = service(request)
    svc.check_model(body.model)
    resume = parse_last_event_id(last_event_id)
    request_id = uuid.uuid4().hex[:24]
    public, own = session_of(body.session, x_session_id, resume, f"{reply_class.prefix}-{request_id}")
    common: dict[str, Any] = {
        **job, "max_tokens": svc.max_tokens(body.limit()), "stop": body.stop, "sampling": body.sampler(),
        "format": body.format(),
        "trace": body.kvstore_trace, "logprobs": body.alternatives()}
    if (body.n or 1) > 1 or len(inputs) > 1:
        param, what, instead = ("n", f"n is {body.n}", "resend with n: 1") if len(inputs) == 1 else \
            ("prompt", f"{len(inputs)} prompts", "resend them one by one")
        if resume:
            raise ApiError(400, f"Last-Event-ID resumes the stream of one session; {what}, which streams several: "
                                f"{instead} (or leave Last-Event-ID out)", param=param, code="invalid_value")
        if not own:
            raise ApiError(400, f"{what}, but a stored session holds one continuation: leave the session out "
                                "(each choice runs in a session of its own), or fork the session for each "
                                "one (POST /v1/sessions/{name}/fork)", param=param, code="invalid_value")
        return await answer_choices(request, body, who, common, request_id, reply_class=reply_class, route=route,
                                    inputs=inputs)
    common.update(inputs[0])
    spec = session_job(svc, who, common, public, body.seed, from_prefix=own and not resume and not body.scores_prompt())
    if resume:
        spec.update(after=resume.after, reply_start=resume.start)
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


def session_job(svc, who: Tenant, common: dict[str, Any], name: str, seed: int | None, *,
                from_prefix: bool) -> dict[str, Any]:
    """`common` (the job without its session) on the tenant's session `name`, made with `seed` where
    it is new; `from_prefix` (a session of the request's own): from the longest stored prefix of its
    prompt (C10), where the prefix cache is on."""
    spec = {**common, "session": who.stored(name), "seed": seed,
            "create": svc.new_session_settings(seed, common["sampling"])}
    if from_prefix and svc.config.prefix_cache:
        spec["prefix"] = {"scope": who.prefix}
    return spec


async def answer_choices(request: Request, body, who: Tenant, common: dict[str, Any], request_id: str, *,
                         reply_class: type["Reply"], route: str, inputs: list[dict[str, Any]]):
    """`answer` for several choices (see the module's comment): n of each input (`inputs`: a prompt's),
    choice k * n + i the i-th of input k; `common` is the job without its input, session and seed."""
    svc = service(request)
    runs, n = [], body.n or 1
    for index, (given, i) in enumerate((given, i) for given in inputs for i in range(n)):
        name = f"{reply_class.prefix}-{request_id}" + (f"-{index}" if index else "")
        seed = None if body.seed is None else (body.seed + i) % 2**63
        runs.append(Run(session_job(svc, who, {**common, **given}, name, seed, from_prefix=not body.scores_prompt()),
                        who, name, id=request_id, route=route))
    streams = [svc.run(run) for run in runs]
    try:  # each prompt's first choice reads it (and stores it, chunk by chunk), then the others: they fork it
        firsts: list = [None] * len(streams)
        for group in ([j for j in range(len(streams)) if j % n == 0], [j for j in range(len(streams)) if j % n]):
            for j, got in zip(group, await all_of([first_events(streams[j]) for j in group])):
                firsts[j] = got
    except BaseException as e:
        await closed(streams)
        for run in (r for r in runs if r.started):
            if isinstance(e, ApiError):  # refused before any output: its session is no one's
                await svc.drop_session(run.spec["session"], retain=False, missing_ok=True)
            else:  # the client left: kept as an entry (or deleted) once its job's cancel is through
                svc.drop_soon(run.spec["session"])
        raise
    replies = [reply_class(run, svc.model_id, body.kvstore_trace, first) for run, first in zip(runs, firsts)]
    events = [chained(first, s) for first, s in zip(firsts, streams)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        out = choices_stream(replies, events, include_usage, n)
        for run in runs:
            out = svc.drop_after(out, run.spec["session"])
        return event_stream(out, svc.config.keep_alive)

    async def take_all(reply: Reply, stream: AsyncIterator[dict[str, Any]]) -> None:
        async for event in stream:
            reply.take(event)

    try:
        await all_of([take_all(r, e) for r, e in zip(replies, events)])
    except BaseException:
        await closed(streams)
        for run in runs:  # kept as entries (or deleted) once their jobs' cancels are through
            svc.drop_soon(run.spec["session"])
        raise
    await all_of([svc.drop_session(run.spec["session"]) for run in runs])
    wholes = [r.whole() for r in replies]
    whole = {**wholes[0], "choices": [{**w["choices"][0], "index": i} for i, w in enumerate(wholes)],
             "usage": usage(*(r.end for r in replies), per_prompt=n)}
    whole["kvstore"] = {**wholes[0]["kvstore"], "choices": [w["kvstore"] for w in wholes]}
    return JSONResponse(whole)


async def choices_stream(replies: list["Reply"], events: list[AsyncIterator[dict[str, Any]]],
                         include_usage: bool, n: int) -> AsyncIterator[ServerSentEvent]:
    """The chunks of several choices as they come, each with its index, without event ids; an error
    ends the stream with an `{"error": ...}` event, as one choice's would."""
    try:
        async for chunk in merged([indexed(i, r.chunks(e)) for i, (r, e) in enumerate(zip(replies, events))]):
            yield ServerSentEvent(data(chunk))
    except ApiError as e:
        yield ServerSentEvent(data(e.body()))
        return
    if include_usage:
        yield ServerSentEvent(data(replies[0].head(choices=[], usage=usage(*(r.end for r in replies), per_prompt=n))))
    yield ServerSentEvent("[DONE]")


async def indexed(i: int, chunks: AsyncIterator[tuple[dict[str, Any], Any]]) -> AsyncIterator[dict[str, Any]]:
    """A choice's chunks (`Reply.chunks`) as choice i's."""
    async for chunk, _ in chunks:
        chunk["choices"] = [{**c, "index": i} for c in chunk["choices"]]
        yield chunk


async def all_of(steps: list) -> list:
    """The coroutines' results, run at once; the first error raised once the others are cancelled."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several async iterators as each gives them (each one's in its order); the first
    error is raised once the others are stopped."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as e:  # noqa: BLE001 -- handed to the reader, which raises it
            await queue.put((None, e))
            return
        await queue.put((done, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def closed(streams: list) -> None:
    """Close async generators (a run's `finally` cancels its job and writes its log line)."""
    for s in streams:
        await s.aclose()


class Reply:
    """The pieces of one reply as they come, and its two shapes: whole, or as server-sent chunks.
    Subclasses give the shapes of their API (`chat.ChatReply`, `completions.CompletionReply`)."""

    prefix: str  # of the reply's id and of the session a request of its own runs in
    object: str  # of a streamed chunk
    buffered = False  # whether the reply is shaped from its whole text, streamed as one last chunk (`last`)

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

    def last(self, **extra) -> dict[str, Any]:
        """A buffered reply's one chunk, once its end has come."""
        raise NotImplementedError

    def stream(self, events: AsyncIterator[dict[str, Any]], include_usage: bool, drop, *,
               resumed: bool = False) -> AsyncIterator[ServerSentEvent]:
        """The reply as server-sent events; an error once the stream has begun is an
        `{"error": ...}` event, as OpenAI sends it, and ends the stream. `drop` (the service, for a
        session made for this request): that session is kept as a prefix-cache entry once the stream
        is over, delivered or left by its client (`Service.drop_after`)."""
        out = self._events(events, include_usage, resumed)
        return out if drop is None else drop.drop_after(out, self.run.spec["session"])

    async def chunks(self, events: AsyncIterator[dict[str, Any]],
                     resumed: bool = False) -> AsyncIterator[tuple[dict[str, Any], Any]]:
        """The reply's chunks as its events come, each with what its event id names after the reply's
        start: the position before it (the opening), a token's position, or "end" (the last chunk)."""
        for chunk in [] if resumed else self.opening():  # nothing received yet
            yield chunk, (self.start or 0) - 1
        async for event in events:
            text = self.take(event)
            if self.buffered:  # shaped from the whole text (`last`)
                continue
            if event["event"] == "token" and (text or self.trace or self.logprobs is not None):
                extra = {"kvstore": {"trace": [trace_line(event)]}} if self.trace else {}
                if self.logprobs is not None:  # a token that released no text yet still has its entry
                    extra["logprobs"] = self.logprobs[-1:]
                yield self.piece(text, **extra), event["position"]
        end = self.end
        if self.buffered:
            yield self.last(kvstore={"session": self.run.public}), "end"
            return
        yield self.piece(end["text"], end["finish_reason"], kvstore={"session": self.run.public}), "end"

    async def _events(self, events: AsyncIterator[dict[str, Any]], include_usage: bool,
                      resumed: bool) -> AsyncIterator[ServerSentEvent]:
        public = self.run.public
        try:
            async for chunk, at in self.chunks(events, resumed):
                yield ServerSentEvent(data(chunk), id=event_id(public, self.start, at))
        except ApiError as e:
            yield ServerSentEvent(data(e.body()))
            return
        end = self.end
        done = event_id(public, self.start, "end")
        if include_usage:
            yield ServerSentEvent(data(self.head(choices=[], usage=usage(end))), id=done)
        yield ServerSentEvent("[DONE]", id=done)
