"""POST /v1/completions: raw text continued (no chat template), on a named session or a session
of its own (`cmpl-...`, deleted once delivered), streamed with the same resumable event ids."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from ..deps import service, tenant
from ..protocol import CompletionRequest
from ..service import Run
from ..streams import chained, data, event_id, first_events, parse_last_event_id, trace_line, usage
from ..tenants import Tenant
from .chat import session_of

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, who: Tenant = Depends(tenant),
                      x_session_id: str | None = Header(None), last_event_id: str | None = Header(None)):
    svc = service(request)
    svc.check_model(body.model)
    resume = parse_last_event_id(last_event_id)
    request_id = uuid.uuid4().hex[:24]
    public, own = session_of(body.session, x_session_id, resume, f"cmpl-{request_id}")
    spec: dict[str, Any] = {
        "kind": "complete", "session": who.stored(public), "prompt": body.prompt,
        "max_tokens": svc.max_tokens(body.limit()), "stop": body.stop, "sampling": body.sampler(),
        "create": svc.new_session_settings(body.seed, body.sampler())}
    if resume:
        spec.update(after=resume.after, reply_start=resume.start)
    run = Run(spec, who, public, id=request_id, route="completions")
    events = svc.run(run)
    first = await first_events(events)
    out = Completion(run, svc.model_id, body.kvstore_trace)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(out.stream(chained(first, events), include_usage, svc if own else None), ping=15)
    async for event in chained(first, events):
        out.take(event)
    if own:
        await svc.drop_session(spec["session"])
    return JSONResponse(out.whole())


class Completion:
    def __init__(self, run: Run, model: str, trace: bool):
        self.run, self.model, self.trace = run, model, trace
        self.id = f"cmpl-{run.id}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.lines: list[dict[str, Any]] = []
        self.start: int | None = run.spec.get("reply_start")
        self.end: dict[str, Any] | None = None

    def take(self, event: dict[str, Any]) -> str:
        if event["event"] == "token":
            self.start = event["position"] if self.start is None else self.start
            self.lines.append(trace_line(event))
        elif event["event"] == "end":
            self.end = event
        else:
            return ""
        self.text.append(event["text"])
        return event["text"]

    def extras(self) -> dict[str, Any]:
        return {"session": self.run.public, "context": self.run.context, **({"trace": self.lines} if self.trace else {})}

    def body(self, text: str, finish: str | None, **extra) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], **extra}

    def whole(self) -> dict[str, Any]:
        return self.body("".join(self.text), self.end["finish_reason"], usage=usage(self.end), kvstore=self.extras())

    async def stream(self, events: AsyncIterator[dict[str, Any]], include_usage: bool, drop) -> AsyncIterator:
        public = self.run.public
        async for event in events:
            text = self.take(event)
            if event["event"] == "token" and (text or self.trace):
                extra = {"kvstore": {"trace": [trace_line(event)]}} if self.trace else {}
                yield ServerSentEvent(data(self.body(text, None, **extra)), id=event_id(public, self.start,
                                                                                      event["position"]))
        end = self.end
        yield ServerSentEvent(data(self.body(end["text"], end["finish_reason"], kvstore={"session": public})),
                              id=event_id(public, self.start, "end"))
        if include_usage:
            yield ServerSentEvent(data({**self.body("", None), "choices": [], "usage": usage(end)}))
        yield ServerSentEvent("[DONE]")
        if drop is not None:
            await drop.drop_session(self.run.spec["session"])
