"""POST /v1/completions: raw text continued (no chat template), on a named session or a session
of its own (`cmpl-...`, deleted once delivered), streamed with the same resumable event ids. A
list of prompts is answered as that many requests (n choices of each, in one answer: choice
k * n + i is the i-th of prompt k), each in a session of its own, in the engine's steps together.

`echo`: the reply's text begins with the prompt (streamed: in a first chunk of its own); with
`logprobs`, every prompt token has its entry too (`Session.append_scored`: the first token of a
session, which nothing predicts, has null ones), computed in the request's own prefill: a request
of its own then reads its prompt whole rather than from a stored prefix (whose KV has no logits),
and a named session scores what the request appends to it. A stream resumed with Last-Event-ID
does not send the prompt again."""

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
                        route="completions", job={"kind": "complete", "echo": body.echo},
                        inputs=[{"prompt": prompt} for prompt in body.prompts()])


class CompletionReply(Reply):
    prefix = "cmpl"
    object = "text_completion"
    offset = 0  # characters of the token texts already reported (text_offset)

    def __init__(self, run, model: str, trace: bool, first: list[dict[str, Any]] = ()):
        super().__init__(run, model, trace, first)
        # the prompt the reply begins with (`echo`): its text and entries (the engine sends it before any token)
        self.echoed = next((e for e in first if e["event"] == "prompt"), None)

    def opening(self) -> list[dict[str, Any]]:
        if self.echoed is None:
            return []
        return [self.piece(self.echoed["text"], logprobs=self.echoed["logprobs"])]

    def piece(self, text: str, finish: str | None = None, logprobs: list | None = None, **extra) -> dict[str, Any]:
        listed = legacy_logprobs(logprobs, self.offset)
        if listed:
            self.offset = listed["text_offset"][-1] + len(listed["tokens"][-1])
        return self.head(choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": listed}], **extra)

    def whole(self) -> dict[str, Any]:
        text, entries = "".join(self.text), self.logprobs
        if self.echoed is not None:
            text = self.echoed["text"] + text
            entries = None if entries is None else (self.echoed["logprobs"] or []) + entries
        return self.piece(text, self.end["finish_reason"], entries, usage=usage(self.end), kvstore=self.extras())


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
            "top_logprobs": [None if e["logprob"] is None else  # a prompt token nothing predicts (echo)
                             {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                             for e in entries],
            "text_offset": offsets}
