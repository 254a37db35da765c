"""POST /v1/completions: raw text continued (no chat template), on a named session or a session
of its own (`cmpl-...`, deleted once delivered), streamed with the same resumable event ids."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Request

from ..deps import tenant
from ..protocol import CompletionRequest
from ..streams import usage
from ..tenants import Tenant
from .answers import Reply, answer

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, who: Tenant = Depends(tenant),
                      x_session_id: str | None = Header(None), last_event_id: str | None = Header(None)):
    return await answer(request, body, who, x_session_id, last_event_id, reply_class=CompletionReply,
                        route="completions", job={"kind": "complete", "prompt": body.prompt})


class CompletionReply(Reply):
    prefix = "cmpl"
    object = "text_completion"

    def piece(self, text: str, finish: str | None = None, **extra) -> dict[str, Any]:
        return self.head(choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], **extra)

    def whole(self) -> dict[str, Any]:
        return self.piece("".join(self.text), self.end["finish_reason"], usage=usage(self.end), kvstore=self.extras())
