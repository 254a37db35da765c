"""Turning a job's events into what OpenAI clients read: event ids, resumable streams, usage.

Every streamed event carries an id `SESSION/START/POSITION`: the session, the position where the
reply began and the position of the token the event carries (START-1 for what comes before the
first token, `SESSION/START/end` for the last chunk, the usage and `[DONE]`). A client that lost its stream resends the same request with `Last-Event-ID: <the last id it
received>` and gets the rest of the reply, from the same session (`parse_last_event_id`).
`first_events` reads a job up to its first token, so that an error before any output is an HTTP
error with its status, not an event inside a 200 stream.

A session's name may hold letters of any script (the store's rule), and so may the ids of its
events, which go out as UTF-8 like the rest of the stream. The headers that carry them back
(`Last-Event-ID`, `X-Session-Id`) are read as UTF-8 too (`header_text`), as the SSE standard has
EventSource send the last id: a name means the same in a header as in the body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent

from .failures import ApiError

END = 2**62  # `after` for a stream whose last event was received: nothing left but the end


@dataclass(frozen=True)
class ResumePoint:
    session: str
    start: int
    after: int


def header_text(value: str | None) -> str | None:
    """A header's value as the client wrote it: the server hands its bytes over as Latin-1
    characters (ASGI), and clients write text beyond ASCII in UTF-8. Bytes that are not UTF-8 stay as
    they came: Latin-1, as HTTP always read them."""
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def parse_last_event_id(value: str | None) -> ResumePoint | None:
    value = header_text(value)
    if not value:
        return None
    try:
        session, start, position = value.strip().rsplit("/", 2)
        after = END if position == "end" else int(position)
        point = ResumePoint(session, int(start), after)
    except ValueError:
        raise ApiError(400, f"Last-Event-ID {value[:80]!r} is not an id this server sent (SESSION/START/POSITION)",
                       param="Last-Event-ID", code="invalid_value") from None
    if not session or point.start < 0 or point.after < point.start - 1:
        raise ApiError(400, f"Last-Event-ID {value[:80]!r} names no position of a reply", param="Last-Event-ID",
                       code="invalid_value")
    return point


def event_id(public: str, start: int | None, position: int | str) -> str:
    return f"{public}/{start if start is not None else 0}/{position}"


async def first_events(events: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events up to and including the first token (or the end); ApiError raised as is."""
    got = []
    async for event in events:
        got.append(event)
        if event["event"] in ("token", "end"):
            break
    return got


async def chained(first: list[dict[str, Any]], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """The events `first_events` took, then the rest of the run's. A run whose end came among the first
    ones is still run to its return (nothing follows its end event): until then it holds its session's
    turn, and a request of its own that generated nothing (max_tokens 0), dropping its session after
    the answer, waited for that turn for good."""
    for event in first:
        yield event
    async for event in rest:
        if first and first[-1]["event"] == "end":
            continue
        yield event


def usage(end: dict[str, Any], *more: dict[str, Any], per_prompt: int | None = None) -> dict[str, Any]:
    """A reply's usage from its end event; with the end events of a request's other choices (`more`),
    each prompt counted once (its first choice's: every `per_prompt` ends share one prompt; None: all
    of them) and every choice's tokens."""
    ends = [end, *more]
    firsts = ends[::per_prompt or len(ends)]
    prompt = sum(e["prompt_tokens"] for e in firsts)
    completion = sum(e["completion_tokens"] for e in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(e["cached_tokens"] for e in firsts)}}


def trace_line(event: dict[str, Any]) -> dict[str, Any]:
    return {"position": event["position"], "token": event["token"], "logits_sha256": event["logits_sha256"]}


def data(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


class KeepAlive(ServerSentEvent):
    """What an idle stream sends every `--keep-alive` seconds, so that proxies keep it open: a
    comment line without the blank line that would end an event. (A blank line after an event
    with an id is an empty event to clients that keep the last id, as SSE says they must: the
    openai client then fails to parse it.)"""

    def encode(self) -> bytes:
        return b": keep-alive\r\n"


def event_stream(events, keep_alive: float) -> EventSourceResponse:
    """The response for a generator of ServerSentEvent."""
    return EventSourceResponse(events, ping=keep_alive, ping_message_factory=KeepAlive)
