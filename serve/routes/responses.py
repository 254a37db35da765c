"""OpenAI's Responses and Conversations APIs: server-held conversation state, held as stored KV.

- `POST /v1/conversations` creates a session `conv_<hex>` (with its first items); its items are the
  session's messages (list, add, read one); `DELETE` removes it.
- `POST /v1/responses`: with `conversation` the input is chatted on the conversation, which then is
  forked (at rest, by reference) into the response's own session `resp_<hex>`; with
  `previous_response_id` the response's session is a fork of that one's and the input is chatted
  on it; with neither, on a new session. A response's session is never written again, so
  continuing from an older response is a fork of an older session. `store: false`: the session is
  deleted once the reply is delivered (not kept as a prefix-cache entry: that would keep its id),
  or once its client leaves the stream: a response not stored is not resumed (OpenAI resumes the
  streams of stored responses only).
- `GET` / `DELETE /v1/responses/{id}` and its input items: read from the session at rest (`items.py`).
- function `tools` (`tools.py`, as chat's): the reply is held to the tool-call format and its output
  is `function_call` items or the answer's message, shaped from its whole text; streamed, those
  items come whole after the header, each with its own events.

Streams carry the Responses event types, each with `sequence_number` and an SSE id in the scheme
of `streams.py` with the response id as the session: `RESP/START/START-1` for the events before
the first token, `RESP/START/POSITION` for a token's delta, `RESP/START/end` for the closing ones.
A client that resends its request with `Last-Event-ID` gets the deltas after that position and the
closing events; sequence numbers are a function of position, so they continue where it stopped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from .. import tools
from ..deps import service, tenant
from ..failures import ApiError, not_found
from ..items import (CONVERSATION, RESPONSE, StoredResponse, conversation_items, conversation_object, hex_of, info_of,
                     item_id, output_items, own_text, response_object, tool_shown, usage)
from ..protocol import ConversationCreate, ItemsCreate, ResponseRequest, ResponseToolChoice
from ..service import Run
from ..streams import event_stream, chained, data, event_id, first_events, parse_last_event_id, trace_line
from ..tenants import Tenant

router = APIRouter()
HEADER_EVENTS = 4  # created, in_progress, output_item.added, content_part.added
BUFFERED_HEADER_EVENTS = 2  # created, in_progress (a reply that could call tools: its items come whole at the end)


def store(request: Request):
    return request.app.state.store


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def eos_ids(request: Request) -> list[int]:
    info = service(request).pool.info
    if "eos_ids" not in info:
        raise ApiError(503, "the model is still loading; retry shortly", type="server_error", code="loading",
                       headers={"Retry-After": "5"})
    return info["eos_ids"]


# -- conversations ---------------------------------------------------------------------------------
@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreate, request: Request, who: Tenant = Depends(tenant)):
    svc = service(request)
    public = new_id(CONVERSATION)
    await svc.manage({"kind": "conversation", "session": who.stored(public),
                      "create": svc.new_session_settings(body.seed, {}),
                      "items": body.messages()})
    return conversation_object(public, store(request).info(who.stored(public)))


@router.get("/v1/conversations/{conversation_id}")
def get_conversation(conversation_id: str, request: Request, who: Tenant = Depends(tenant)):
    return conversation_object(conversation_id, info_of(store(request), who, conversation_id, CONVERSATION))


@router.post("/v1/conversations/{conversation_id}")
def update_conversation(conversation_id: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(store(request), who, conversation_id, CONVERSATION)
    raise ApiError(400, "a conversation's metadata is not kept here (its state is its KV and messages)",
                   param="metadata", code="unsupported_parameter")


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(store(request), who, conversation_id, CONVERSATION)
    await service(request).manage({"kind": "delete", "session": who.stored(conversation_id)})
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def item_page(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


@router.get("/v1/conversations/{conversation_id}/items")
def list_items(conversation_id: str, request: Request, who: Tenant = Depends(tenant),
               limit: int = Query(20, ge=1, le=100), order: str = Query("desc", pattern="^(asc|desc)$"),
               after: str | None = None, include: list[str] | None = Query(None)):
    info_of(store(request), who, conversation_id, CONVERSATION)
    items = conversation_items(store(request), who.stored(conversation_id), hex_of(conversation_id))
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise not_found("item", after)
        items = items[at + 1:]
    page = item_page(items[:limit])
    page["has_more"] = len(items) > limit
    return page


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsCreate, request: Request, who: Tenant = Depends(tenant),
                    include: list[str] | None = Query(None)):
    info_of(store(request), who, conversation_id, CONVERSATION)
    end = await service(request).manage({"kind": "items", "session": who.stored(conversation_id),
                                         "items": body.messages()})
    items = conversation_items(store(request), who.stored(conversation_id), hex_of(conversation_id),
                               range(end["first"], end["first"] + end["count"]))
    return item_page(items)


@router.get("/v1/conversations/{conversation_id}/items/{item}")
def get_item(conversation_id: str, item: str, request: Request, who: Tenant = Depends(tenant),
             include: list[str] | None = Query(None)):
    info_of(store(request), who, conversation_id, CONVERSATION)
    items = conversation_items(store(request), who.stored(conversation_id), hex_of(conversation_id))
    found = next((x for x in items if x["id"] == item), None)
    if found is None:
        raise not_found("item", item)
    return found


@router.delete("/v1/conversations/{conversation_id}/items/{item}")
def delete_item(conversation_id: str, item: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(store(request), who, conversation_id, CONVERSATION)
    raise ApiError(400, "items cannot be deleted: every later item's KV was computed after them; fork from an "
                        "earlier response (previous_response_id) instead", param="item_id",
                   code="unsupported_parameter")


# -- responses -------------------------------------------------------------------------------------
@router.get("/v1/responses/{response_id}")
def get_response(response_id: str, request: Request, who: Tenant = Depends(tenant)):
    return StoredResponse(store(request), who, response_id).body(service(request).model_id, eos_ids(request))


@router.get("/v1/responses/{response_id}/input_items")
def response_input_items(response_id: str, request: Request, who: Tenant = Depends(tenant),
                         order: str = Query("desc", pattern="^(asc|desc)$"), limit: int = Query(20, ge=1, le=100),
                         after: str | None = None, include: list[str] | None = Query(None)):
    items = StoredResponse(store(request), who, response_id).input_items()
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        items = items[at + 1:] if at is not None else []
    page = item_page(items[:limit])
    page["has_more"] = len(items) > limit
    return page


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(store(request), who, response_id, RESPONSE)
    await service(request).manage({"kind": "delete", "session": who.stored(response_id)})
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses")
async def create_response(body: ResponseRequest, request: Request, who: Tenant = Depends(tenant),
                          last_event_id: str | None = Header(None)):
    svc = service(request)
    svc.check_model(body.model)
    resume = parse_last_event_id(last_event_id)
    public, writer, spec = plan(request, who, body, resume)
    run = Run(spec, who, writer, route="responses")
    events = svc.run(run)
    try:
        first = await first_events(events)
    except ApiError:
        if writer == public and not resume and run.started:  # refused before any output: its session is no one's
            await svc.drop_session(spec["session"], retain=False, missing_ok=True)
        raise
    out = Output(run, public, body, svc.model_id, resume.after if resume else None)
    drop = svc if not body.store and writer == public else None
    if body.stream:
        return event_stream(out.stream(chained(first, events), drop), svc.config.keep_alive)
    async for event in chained(first, events):
        out.take(event)
    if drop is not None:
        await svc.drop_session(spec["session"], retain=False)
    return JSONResponse(out.whole())


def plan(request: Request, who: Tenant, body: ResponseRequest, resume) -> tuple[str, str, dict[str, Any]]:
    """(the response id, the public name of the session the reply is written on, the job)."""
    svc, st = service(request), store(request)
    public = resume.session if resume else new_id(RESPONSE)
    if not public.startswith(RESPONSE):
        raise ApiError(400, f"Last-Event-ID names {public!r}, not a response", param="Last-Event-ID",
                       code="invalid_value")
    spec: dict[str, Any] = {"kind": "response", "messages": body.input_messages(), "stop": None,
                            "max_tokens": svc.max_tokens(body.max_output_tokens), "sampling": sampling(body),
                            "format": body.format(),
                            "trace": body.kvstore_trace, "logprobs": body.alternatives()}
    conversation = body.conversation_id()
    if conversation is not None:
        info = info_of(st, who, conversation, CONVERSATION)
        check_seed(body.seed, info.seed, "conversation")
        writer = conversation
        if resume and exists(st, who, public):
            writer = public  # the snapshot was made: replay the reply from it (the conversation went on)
        spec.update(session=who.stored(writer), response=who.stored(public) if body.store else None)
    else:
        writer = public
        spec.update(session=who.stored(public), response=None)
        if body.previous_response_id is not None:
            info = info_of(st, who, body.previous_response_id, RESPONSE)
            check_seed(body.seed, info.seed, "previous response")
            if info.active_call:
                raise ApiError(409, f"response {body.previous_response_id!r} is not finished (in progress, or its "
                                    "stream broke: resend that request with Last-Event-ID to finish it)",
                               type="conflict_error", param="previous_response_id", code="response_in_progress")
            spec["base"] = who.stored(body.previous_response_id)
        else:
            spec["create"] = svc.new_session_settings(body.seed, sampling(body))
            if svc.config.prefix_cache and not resume:
                spec["prefix"] = {"scope": who.prefix}
    if resume:  # replayed from the reply's start, so the whole text is known; only what is new is sent
        spec.update(after=resume.start - 1, reply_start=resume.start)
    return public, writer, spec


def sampling(body: ResponseRequest) -> dict[str, float]:
    """Each response samples with its own settings (OpenAI's defaults), whatever came before it."""
    return {"temperature": 1.0, "top_p": 1.0, **body.sampler()}


def exists(st, who: Tenant, public: str) -> bool:
    return st.exists(who.stored(public))


def check_seed(asked: int | None, seed: int, what: str) -> None:
    if asked is not None and asked != seed:
        raise ApiError(400, f"seed {asked} differs from the {what}'s ({seed}): a session's seed is fixed when it "
                            "is created", param="seed", code="invalid_value")


class Output:
    """One response as its events come: its text, its end, and its two shapes (whole, events)."""

    def __init__(self, run: Run, public: str, body: ResponseRequest, model: str, after: int | None):
        self.run, self.public, self.body, self.model = run, public, body, model
        self.after = after  # a resumed stream: what the client has already received
        self.created = int(time.time())
        self.start: int | None = run.spec.get("reply_start")
        self.text: list[str] = []
        self.lines: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []  # the tokens' entries, where asked for and computed
        self.end: dict[str, Any] | None = None
        self.message: int | None = None  # the ordinal of the reply's message (its item id)
        self.last_seq = -1  # the sequence number of the last event sent
        self.buffered = bool(body.tools)  # a reply that could call tools: shaped from its whole text

    def take(self, event: dict[str, Any]) -> None:
        if event["event"] == "start":
            self.message = event.get("message")
        elif event["event"] == "token":
            if self.start is None:
                self.start = event["position"]
            self.lines.append(trace_line(event))
            self.text.append(event["text"])
            if event.get("logprobs"):
                self.logprobs.append(event["logprobs"])
        elif event["event"] == "end":
            self.end = event
            self.text.append(event["text"])
            if self.start is None:
                self.start = event["prompt_tokens"]

    # -- shapes ---------------------------------------------------------------------------------------
    @property
    def scope(self) -> str:
        return hex_of(self.body.conversation_id() or self.public)

    @property
    def item_id(self) -> str:
        return item_id(self.scope, self.ordinal)

    @property
    def ordinal(self) -> int:
        return self.message if self.message is not None else 0

    def status(self) -> str:
        if self.end is None:
            return "in_progress"
        return "completed" if self.end["finish_reason"] == "stop" else "incomplete"

    def item(self) -> dict[str, Any]:
        """The reply's message while it is written (an unbuffered stream's header)."""
        return {"type": "message", "id": self.item_id, "role": "assistant", "status": "in_progress", "content": []}

    def items(self) -> list[dict[str, Any]]:
        """The output items, once the reply is whole: its message, or its calls (a reply that could call tools)."""
        if self.end is None:
            return []
        return output_items(self.scope, self.ordinal, "".join(self.text), self.status(), self.logprobs,
                            offered=self.buffered)

    def response(self) -> dict[str, Any]:
        end, body = self.end, self.body
        system = [own for m in body.input_messages() if m["role"] == "system" if (own := own_text(m["content"]))]
        choice = body.tool_choice
        out = response_object(
            self.public, created_at=self.created, model=self.model, status=self.status(), output=self.items(),
            usage_=usage(end["prompt_tokens"], end["completion_tokens"], end["cached_tokens"]) if end else None,
            previous=body.previous_response_id, conversation=body.conversation_id(),
            instructions="\n".join(system) or None, sampler=self.run.spec["sampling"],
            max_output_tokens=body.max_output_tokens, stored=body.store, text=body.text_shown(),
            tools_=[tool_shown(f.name, f.description, tools.parameters(f)) for f in body.tools or ()],
            tool_choice=choice.model_dump() if isinstance(choice, ResponseToolChoice) else choice,
            parallel=body.parallel_tool_calls is not False)
        out["kvstore"] = {"session": self.run.public, "context": self.run.context}
        if body.kvstore_trace and end:
            out["kvstore"]["trace"] = self.lines
        return out

    def whole(self) -> dict[str, Any]:
        return self.response()

    # -- the stream -----------------------------------------------------------------------------------
    def event(self, kind: str, seq: int, position: int | str, **fields) -> ServerSentEvent:
        payload = {"type": kind, "sequence_number": seq, **fields}
        self.last_seq = seq
        return ServerSentEvent(data(payload), event=kind, id=event_id(self.public, self.start, position))

    def part(self, text: str, logprobs: list[dict[str, Any]] = ()) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}

    async def stream(self, events: AsyncIterator[dict[str, Any]], drop) -> AsyncIterator[ServerSentEvent]:
        """The events of the response; an error once the stream has begun is an `error` event, as
        OpenAI sends it, and ends the stream. `drop` (the service, for a response not stored): its
        session is deleted once the stream is over, delivered or left by its client
        (`Service.drop_after`)."""
        out = self._events(events)
        if drop is not None:
            out = drop.drop_after(out, self.run.spec["session"], retain=False)
        try:
            async for event in out:
                yield event
        except ApiError as e:
            yield ServerSentEvent(data({"type": "error", "sequence_number": self.last_seq + 1, "code": e.code,
                                        "message": e.message, "param": e.param}), event="error")

    async def _events(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[ServerSentEvent]:
        """The header (created, in_progress; unbuffered, the message's opening), a delta per token
        (unbuffered), then the closing events: unbuffered, the message's; buffered (a reply that could
        call tools, shaped from its whole text), each output item's, whole; then the response's end."""
        where = {"output_index": 0, "content_index": 0}
        header = BUFFERED_HEADER_EVENTS if self.buffered else HEADER_EVENTS
        sent_header = self.after is not None
        async for event in events:
            if self.start is None and event["event"] in ("token", "end"):
                self.start = event["position"] if event["event"] == "token" else event["prompt_tokens"]
            if not sent_header and event["event"] in ("token", "end"):
                before = self.start - 1
                yield self.event("response.created", 0, before, response=self.response())
                yield self.event("response.in_progress", 1, before, response=self.response())
                if not self.buffered:
                    yield self.event("response.output_item.added", 2, before, output_index=0, item=self.item())
                    yield self.event("response.content_part.added", 3, before, item_id=self.item_id, **where,
                                     part=self.part(""))
                sent_header = True
            self.take(event)
            if event["event"] == "token" and not self.buffered and (self.after is None or event["position"] > self.after):
                extra = {"kvstore": {"trace": [trace_line(event)]}} if self.body.kvstore_trace else {}
                yield self.event("response.output_text.delta", header + event["position"] - self.start,
                                 event["position"], item_id=self.item_id, **where, delta=event["text"],
                                 logprobs=[event["logprobs"]] if event.get("logprobs") else [], **extra)
        if self.end is None:
            return
        if self.buffered:
            seq, closing = header, [pair for index, item in enumerate(self.items())
                                    for pair in self.item_events(index, item)]
        else:
            seq, text = header + self.end["completion_tokens"], "".join(self.text)
            closing = [("response.output_text.delta", dict(item_id=self.item_id, **where, delta=self.end["text"],
                                                            logprobs=[]))] if self.end["text"] else []
            # (the delta: what the decoder held back to the end)
            closing += [("response.output_text.done", dict(item_id=self.item_id, **where, text=text,
                                                            logprobs=self.logprobs)),
                        ("response.content_part.done", dict(item_id=self.item_id, **where,
                                                            part=self.part(text, self.logprobs))),
                        ("response.output_item.done", dict(output_index=0, item=self.items()[0]))]
        closing.append(("response.completed" if self.status() == "completed" else "response.incomplete",
                        dict(response=self.response())))
        for i, (kind, fields) in enumerate(closing):
            yield self.event(kind, seq + i, "end", **fields)

    def item_events(self, index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """A whole output item's events, from its opening to its end (a buffered reply's)."""
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            return [("response.output_item.added", dict(output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"})),
                    ("response.function_call_arguments.delta", dict(**at, delta=item["arguments"])),
                    ("response.function_call_arguments.done", dict(**at, arguments=item["arguments"])),
                    ("response.output_item.done", dict(output_index=index, item=item))]
        part = item["content"][0]
        at["content_index"] = 0
        return [("response.output_item.added", dict(output_index=index, item={**item, "status": "in_progress",
                                                                               "content": []})),
                ("response.content_part.added", dict(**at, part=self.part(""))),
                ("response.output_text.delta", dict(**at, delta=part["text"], logprobs=[])),
                ("response.output_text.done", dict(**at, text=part["text"], logprobs=part["logprobs"])),
                ("response.content_part.done", dict(**at, part=part)),
                ("response.output_item.done", dict(output_index=index, item=item))]
