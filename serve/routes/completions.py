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
    offset = 0  # characters of the token texts already reported (text_offset)

    def piece(self, text: str, finish: str | None = None, logprobs: list | None = None, **extra) -> dict[str, Any]:
        listed = legacy_logprobs(logprobs, self.offset)
        if listed:
            self.offset = listed["text_offset"][-1] + len(listed["tokens"][-1])
        return self.head(choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": listed}], **extra)

    def whole(self) -> dict[str, Any]:
        return self.piece("".join(self.text), self.end["finish_reason"], self.logprobs, usage=usage(self.end),
                          kvstore=self.extras())


def legacy_logprobs(entries: list | None, offset: int = 0) -> dict[str, Any] | None:
    """The completions API's `logprobs` of the tokens with entries (None where there are none): each
    token's text, logprob, a dict of the likeliest tokens' (with the sampled one: up to logprobs + 1
    of them) and its text's offset, counted from the reply's first token."""
    entries = [e for e in entries or () if e is not None]
    if not entries:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                             for e in entries],
            "text_offset": offsets}
