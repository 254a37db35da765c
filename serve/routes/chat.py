"""POST /v1/chat/completions: OpenAI's chat API on stored sessions.

A request that names a session (`X-Session-Id`, or `session` in the body) continues it: the
client resends the whole history, the engine feeds only what is new (`jobs.plan`). The rest (the
session of a request that names none, the streams, `Last-Event-ID`) is `answers.py`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Request

from .. import tools
from ..deps import tenant
from ..protocol import ChatRequest
from ..streams import usage
from ..tenants import Tenant
from .answers import Reply, answer

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, who: Tenant = Depends(tenant),
                           x_session_id: str | None = Header(None), last_event_id: str | None = Header(None)):
    return await answer(request, body, who, x_session_id, last_event_id, reply_class=ChatReply,
                        route="chat.completions", job={"kind": "chat", "messages": body.plain_messages(),
                                                       "tools": bool(body.tools)})


class ChatReply(Reply):
    """A chat reply; one that could call tools (`tools.py`) is shaped from its whole text: streamed,
    its message comes in the last chunk (before it, only the opening: a stream cut before the end
    resumes from the reply's start)."""
    prefix = "chatcmpl"
    object = "chat.completion.chunk"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffered = bool(self.run.spec.get("tools"))  # a reply that could call tools

    def message(self) -> tuple[dict[str, Any], str]:
        """The reply's message fields (content, tool_calls) and finish reason."""
        text, finish = "".join(self.text), self.end["finish_reason"]
        if not self.buffered:
            return {"content": text}, finish
        return tools.shape(text, finish, f"{self.run.public}:{self.start}")  # a resumed reply's calls: the same ids

    def shown_logprobs(self) -> dict[str, Any] | None:
        """The choice's logprobs: of every token, or of a tool-format response's own text (`tools.response_entries`)."""
        if not self.buffered or self.logprobs is None:
            return chat_logprobs(self.logprobs)
        return chat_logprobs(tools.response_entries(self.logprobs, "".join(self.text), self.end["finish_reason"]))

    def whole(self) -> dict[str, Any]:
        fields, finish = self.message()
        return self.head(object="chat.completion", choices=[
            {"index": 0, "message": {"role": "assistant", **fields}, "finish_reason": finish,
             "logprobs": self.shown_logprobs()}], usage=usage(self.end), kvstore=self.extras())

    def last(self, **extra) -> dict[str, Any]:
        """A buffered reply's one chunk with its message (the tool calls, with their index, or the text)."""
        fields, finish = self.message()
        delta = {"content": fields["content"]} if fields.get("content") else {}
        if fields.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(fields["tool_calls"])]
        if self.trace:
            extra["kvstore"] = {**extra.get("kvstore", {}), "trace": self.lines}
        return self.head(choices=[{"index": 0, "delta": delta, "finish_reason": finish,
                                   "logprobs": self.shown_logprobs()}], **extra)

    def opening(self) -> list[dict[str, Any]]:
        return [self.head(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                    "logprobs": None}])]

    def piece(self, text: str, finish: str | None = None, logprobs: list | None = None, **extra) -> dict[str, Any]:
        delta = {"content": text} if text or finish is None else {}
        return self.head(choices=[{"index": 0, "delta": delta, "finish_reason": finish,
                                   "logprobs": chat_logprobs(logprobs)}], **extra)


def chat_logprobs(entries: list | None) -> dict[str, Any] | None:
    """A choice's `logprobs`: `{"content": [entry per token], "refusal": None}`, or None where none
    was asked for or none was computed (tokens a resumed stream replays from the store)."""
    content = [e for e in entries or () if e is not None]
    return {"content": content, "refusal": None} if content else None
