"""POST /v1/completions: raw text continued (no chat template), on a named session or a session
of its own (`cmpl-...`, deleted once delivered), streamed with the same resumable event ids."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse

from ..deps import service, tenant
from ..protocol import CompletionRequest
from ..service import Run
from ..streams import event_stream, chained, first_events, parse_last_event_id, usage
from ..tenants import Tenant
from .chat import Reply, session_of

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
        "create": svc.new_session_settings(body.seed, body.sampler()), "seed": body.seed}
    if resume:
        spec.update(after=resume.after, reply_start=resume.start)
    run = Run(spec, who, public, id=request_id, route="completions")
    events = svc.run(run)
    first = await first_events(events)
    out = CompletionReply(run, svc.model_id, body.kvstore_trace, first)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(out.stream(chained(first, events), include_usage, svc if own else None), svc.config.keep_alive)
    async for event in chained(first, events):
        out.take(event)
    if own:
        await svc.drop_session(spec["session"])
    return JSONResponse(out.whole())


class CompletionReply(Reply):
    prefix = "cmpl"
    object = "text_completion"

    def piece(self, text: str, finish: str | None = None, **extra) -> dict[str, Any]:
        return self.head(choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], **extra)

    def whole(self) -> dict[str, Any]:
        return self.piece("".join(self.text), self.end["finish_reason"], usage=usage(self.end), kvstore=self.extras())
