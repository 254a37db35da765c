"""Tool calls on chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), for any model.

Chat templates differ in how (and whether) they present tools; SmolLM2's has no place for them. So
the tools are presented the same way to every model, after its system message's own text, and a
request that gives tools has its reply held to a response format (`kvstore.check_response_format`,
exact: engine/grammar.py): `{"tool_calls":[{"name":NAME,"arguments":ARGUMENTS},...]}`, each call's
name one of the tools and its arguments JSON that the tool's `parameters` schema accepts (keys it
does not name only where it says `additionalProperties`: `parameters`), or `{"response":TEXT}`; compact
JSON, keys in that order. `tool_choice` only narrows the format: "auto" (the default) either,
"required" calls, a named function calls of it, "none" the response; `parallel_tool_calls: false`
one call. The prompt is the same whatever it says, so a conversation keeps its KV across them.
The reply's message then carries `tool_calls` (ids `call_...`, arguments as JSON text;
finish_reason "tool_calls") or the response's text as its content.

The conversation as the session holds it: the system message with the tools' text after its own;
each assistant message as the JSON it was (its tool calls, or its text as the response); a tool's
result as a user message `{"tool_result":{"tool_call_id":ID,"content":TEXT}}`. Clients send the
assistant's messages back as they got them (arguments verbatim), so the same conversion gives the
stored text again and the session goes on from its KV (jobs.plan); a history that converts
differently (a conversation that gave no tools before) is answered as a cold run, as any edited
history is. A reply cut by max_tokens is returned as the text it is (finish_reason "length").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

INTRO = ('Answer with JSON only: {"response":<your answer>} to answer the user, or '
         '{"tool_calls":[{"name":<tool name>,"arguments":<its arguments, a JSON object>}]} to call tools. Tools:')


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def parameters(tool) -> dict[str, Any]:
    """A tool's arguments schema (any JSON object where it gives none). An object schema with properties
    that does not say whether it admits others admits none: a function takes the arguments it names
    (as OpenAI's strict mode asks schemas to say, and as llama.cpp's grammars take them)."""
    schema = tool.function.parameters
    if schema is None:
        return {"type": "object"}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def offered(tools: list, choice) -> list:
    """The tools a reply may call: all of them, or the one `tool_choice` names (none: all, unused)."""
    if isinstance(choice, str):
        return list(tools)
    return [t for t in tools if t.function.name == choice.function.name]


def system_text(tools: list) -> str:
    """What the system message says about the tools (after its own text)."""
    lines = [INTRO]
    for tool in tools:
        entry = {"name": tool.function.name, "parameters": parameters(tool)}
        if tool.function.description:
            entry["description"] = tool.function.description
        lines.append(compact(entry))
    return "\n".join(lines)


def reply_format(tools: list, choice, parallel: bool) -> dict[str, Any]:
    """The response format of a reply to a request with `tools` (see the module's docstring)."""
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters(tool)},
         "required": ["name", "arguments"], "additionalProperties": False} for tool in offered(tools, choice)]}}
    if not parallel:
        calls["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
            "additionalProperties": False}
    answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
              "additionalProperties": False}
    schema: dict[str, Any] = {"anyOf": [call, answer]} if choice == "auto" else answer if choice == "none" else call
    return {"type": "json_schema", "schema": {**schema, "x-guidance": {"whitespace_flexible": False}}}


def calls_text(calls: list[tuple[str, str]]) -> str:
    """The reply text of tool calls ((name, arguments as JSON text) each), as the format writes it."""
    return '{"tool_calls":[' + ",".join(f'{{"name":{compact(name)},"arguments":{arguments}}}'
                                        for name, arguments in calls) + "]}"


def result_text(call_id: str, content: str) -> str:
    return compact({"tool_result": {"tool_call_id": call_id, "content": content}})


def messages(body) -> list[dict[str, str]]:
    """The request's conversation as the session holds it (see the module's docstring); without tools,
    a tool call or result still reads as it does with them."""
    out = []
    for m in body.messages:
        if m.role == "tool":
            out.append({"role": "user", "content": result_text(m.tool_call_id, m.text())})
        elif m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant",
                        "content": calls_text([(c.function.name, c.function.arguments) for c in m.tool_calls])})
        elif m.role == "assistant" and body.tools:
            out.append({"role": "assistant", "content": compact({"response": m.text()})})
        else:
            out.append(m.plain())
    if body.tools:
        text = system_text(body.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def call_id(reply: str, index: int) -> str:
    """A call's id, from its reply (its session and where it began: the same for a resumed reply) and
    its index."""
    return "call_" + hashlib.sha256(f"{reply}:{index}".encode()).hexdigest()[:24]


def shape(text: str, finish: str, reply: str) -> tuple[dict[str, Any], str]:
    """(the message's content and tool_calls, the finish reason) of a reply that could call tools."""
    try:
        value = json.loads(text) if finish == "stop" else None
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        calls = [{"id": call_id(reply, i), "type": "function",
                  "function": {"name": c["name"], "arguments": compact(c["arguments"])}}
                 for i, c in enumerate(value["tool_calls"])]
        return {"content": None, "tool_calls": calls}, "tool_calls"
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return {"content": value["response"]}, finish
    return {"content": text}, finish
