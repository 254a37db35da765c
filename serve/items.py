"""The objects of the Responses and Conversations APIs as OpenAI shapes them, read from the store.

Everything here is derived from a session's rows at rest (its messages, tokens, parent, settings), so
what GET returns survives restarts with no state of its own:

- a conversation `conv_<hex>` is the session of that name; its items are the session's messages,
  item `msg_<hex>_<ordinal>` (a conversation only grows, so an ordinal names one message for good);
- a response `resp_<hex>` is the session that holds the context up to the end of the response: its
  last message is the output; the messages after the assistant message before it are its input; its
  parent is the conversation it was taken from (`conversation`) or the response it continued
  (`previous_response_id`); the reply's last token says how it ended (end of sequence: completed;
  else the token limit: incomplete). The items of a response taken from a conversation keep the
  conversation's item ids.

Tool calls (`tools.py`) read back from the text the session holds: an assistant message written
where the system messages of its turn (since the previous assistant message) state tools is its
`function_call` items (`fc_<hex>_<ordinal>_<index>`, call ids as the POST gave them) or its
response's text; an assistant message that is calls exactly as the format writes them (function_call
items added to a conversation) is its calls anywhere; a user message that is a tool's result is a
`function_call_output` item (`fco_<hex>_<ordinal>`); a system message shows its own text only
(none: no item).

Not kept, so not returned: `metadata` (accepted, always `{}`), a request's `max_output_tokens`
(null on GET), its `tool_choice` and `parallel_tool_calls` (which only narrow the reply's format: GET
says "auto" and true where tools were offered). `instructions` on GET are the system messages among
the response's input, `tools` the tools they state (a system message restated, holding no tokens,
reads back as the one it restates: `Session.restate_system`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any


from . import tools
from .failures import not_found
from .tenants import Tenant

CONVERSATION, RESPONSE = "conv_", "resp_"


def epoch(stamp: str) -> int:
    """The index's naive UTC ISO time as seconds since the epoch."""
    return int(dt.datetime.fromisoformat(stamp).replace(tzinfo=dt.timezone.utc).timestamp())


def hex_of(public: str) -> str:
    return public.split("_", 1)[1]


def info_of(store, who: Tenant, public: str, prefix: str):
    """The SessionInfo behind a conversation or response id of this tenant; 404 for any other."""
    what = "conversation" if prefix == CONVERSATION else "response"
    if not isinstance(public, str) or not public.startswith(prefix):
        raise not_found(what, public)
    return who.info(store, public, what)


def conversation_object(public: str, info) -> dict[str, Any]:
    return {"id": public, "object": "conversation", "created_at": epoch(info.created_at), "metadata": {}}


def message_item(item_id: str, role: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A message as an item; an assistant's output text with its tokens' `logprobs` entries (none
    unless a response asked for them: a stored one read back has them no more)."""
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    else:
        part = {"type": "input_text", "text": text}
    return {"type": "message", "id": item_id, "role": role, "status": status, "content": [part]}


def item_id(scope: str, ordinal: int) -> str:
    return f"msg_{scope}_{ordinal}"


def output_items(scope: str, ordinal: int, text: str, status: str, logprobs: list[dict[str, Any]] | None = None,
                 *, offered: bool = False) -> list[dict[str, Any]]:
    """The output items of an assistant message: a message, or, where tools were `offered`, the calls
    its text makes (`function_call` items) or the message of its response's text."""
    if offered:
        finish = "stop" if status == "completed" else "length"
        parsed = tools.parse(text, finish)
        if isinstance(parsed, list):
            key = f"{scope}:{ordinal}"
            return [{"type": "function_call", "id": f"fc_{scope}_{ordinal}_{i}", "call_id": tools.call_id(key, i),
                     "name": name, "arguments": arguments, "status": "completed"}
                    for i, (name, arguments) in enumerate(parsed)]
        text, logprobs = parsed, tools.response_entries(logprobs, text, finish)
    return [message_item(item_id(scope, ordinal), "assistant", text, status, logprobs)]


def history_items(messages: list[dict[str, Any]], scope: str) -> list[tuple[int, dict[str, Any]]]:
    """(ordinal, item) of each item that stored messages ({ordinal, role, text}) read back as (the
    module's docstring): a message can be no item (a system message that only states tools) or several
    (its tool calls)."""
    out: list[tuple[int, dict[str, Any]]] = []
    offered = False  # whether the turn so far states tools
    for m in messages:
        ordinal, role, text = m["ordinal"], m["role"], m["text"]
        if role == "system" and (stated := tools.stated_tools(text)) is not None:
            offered, text = True, stated[0]
            if not text:
                continue
        if role == "assistant":
            out.extend((ordinal, item) for item in output_items(scope, ordinal, text, "completed",
                                                                offered=offered or tools.written_calls(text)))
            offered = False
        elif role == "user" and (result := tools.read_result(text)) is not None:
            out.append((ordinal, {"type": "function_call_output", "id": f"fco_{scope}_{ordinal}", "call_id": result[0],
                                  "output": result[1], "status": "completed"}))
        else:
            out.append((ordinal, message_item(item_id(scope, ordinal), role, text)))
    return out


def own_text(system: str) -> str:
    """A system message's own text, without the tools it states."""
    stated = tools.stated_tools(system)
    return stated[0] if stated is not None else system


def stored_messages(store, stored: str) -> list[dict[str, Any]]:
    return [{"ordinal": m.ordinal, "role": m.role, "text": m.text, "start": m.token_start, "end": m.token_end}
            for m in store.messages(stored)]


def conversation_items(store, stored: str, scope: str, ordinals: range | None = None) -> list[dict[str, Any]]:
    """A conversation's items (of the messages whose ordinals are in `ordinals`: None, all)."""
    return [item for ordinal, item in history_items(stored_messages(store, stored), scope)
            if ordinals is None or ordinal in ordinals]


def usage(input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def tool_shown(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a response object lists it: its parameters as the reply is held to them."""
    return {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": True}


def response_object(public: str, *, created_at: int, model: str, status: str, output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None, previous: str | None, conversation: str | None,
                    instructions: str | None, sampler: dict[str, Any], max_output_tokens: int | None = None,
                    stored: bool = True, text: dict[str, Any] | None = None, tools_: list[dict[str, Any]] = (),
                    tool_choice: str | dict[str, Any] | None = None, parallel: bool = True) -> dict[str, Any]:
    """A response object. `text`: its format as the request gave it; a response read back from its
    session says text (a format belongs to its call, and is not stored). `tools_` as `tool_shown`
    makes them; `tool_choice` and `parallel` count where tools are offered (else none, false)."""
    return {"id": public, "object": "response", "created_at": created_at, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": instructions, "max_output_tokens": max_output_tokens, "metadata": {},
            "previous_response_id": previous, "conversation": {"id": conversation} if conversation else None,
            "parallel_tool_calls": parallel if tools_ else False, "tool_choice": (tool_choice or "auto") if tools_ else "none",
            "tools": list(tools_), "text": text or {"format": {"type": "text"}},
            "temperature": sampler.get("temperature"), "top_p": sampler.get("top_p"), "store": stored,
            "truncation": "disabled", "background": False, "usage": usage_}


class StoredResponse:
    """A response read back from its session at rest (GET /v1/responses/{id} and its input items)."""

    def __init__(self, store, who: Tenant, public: str):
        self.public = public
        self.info = info_of(store, who, public, RESPONSE)
        self.messages = stored_messages(store, who.stored(public))
        self.last_token = store.tokens(who.stored(public))[-1:] if self.info.n_tokens else []
        parent = who.public(self.info.parent) if self.info.parent else None
        self.previous = parent if parent and parent.startswith(RESPONSE) else None
        self.conversation = parent if parent and parent.startswith(CONVERSATION) else None
        self.scope = hex_of(self.conversation or public)

    def _split(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """(this response's input messages, its output message)."""
        ms = self.messages
        if not ms or ms[-1]["role"] != "assistant":
            return ms, None
        earlier = [i for i, m in enumerate(ms[:-1]) if m["role"] == "assistant"]
        return ms[earlier[-1] + 1 if earlier else 0:-1], ms[-1]

    def status(self, eos_ids) -> str:
        if self.info.active_call:
            return "in_progress"
        return "completed" if self.last_token and self.last_token[0] in set(eos_ids) else "incomplete"

    def input_items(self) -> list[dict[str, Any]]:
        return [item for _, item in history_items(self._split()[0], self.scope)]

    def body(self, model: str, eos_ids) -> dict[str, Any]:
        inputs, out = self._split()
        status = self.status(eos_ids)
        system = [own for m in inputs if m["role"] == "system" if (own := own_text(m["text"]))]
        offered = next((stated[1] for m in reversed(inputs) if m["role"] == "system"
                        if (stated := tools.stated_tools(m["text"])) is not None), [])
        output = output_items(self.scope, out["ordinal"], out["text"], status, offered=bool(offered)) if out else []
        use = None
        if out:
            cached = max(0, inputs[0]["start"] - 1) if inputs else 0  # the last token before was pending
            use = usage(out["start"], self.info.n_tokens - out["start"], cached)
        return response_object(self.public, created_at=epoch(self.info.created_at), model=model, status=status,
                               output=output, usage_=use, previous=self.previous, conversation=self.conversation,
                               instructions="\n".join(system) or None, sampler=self.info.sampler,
                               tools_=[tool_shown(t["name"], t.get("description"), t["parameters"]) for t in offered])
