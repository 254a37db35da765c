"""Tool calls, for any model: chat completions' `tools` (`tool_calls`, `tool` messages) and the Responses
API's (`function_call` and `function_call_output` items). Both present the tools, and hold a reply, the
same way.

Chat templates differ in how (and whether) they present tools; SmolLM2's has no place for them. So
the tools are presented the same way to every model, after its system message's own text, and a
request that gives tools has its reply held to a response format (`kvstore.check_response_format`,
exact: engine/grammar.py): `{"tool_calls":[{"name":NAME,"arguments":ARGUMENTS},...]}`, each call's
name one of the tools and its arguments JSON that the tool's `parameters` schema accepts (keys it
does not name only where it says `additionalProperties`: `parameters`), or `{"response":TEXT}`; compact
JSON, keys in that order. `tool_choice` only narrows the format: "auto" (the default) either,
"required" calls, a named function calls of it, "none" the response; `parallel_tool_calls: false`
one call. The prompt is the same whatever it says, so a conversation keeps its KV across them.
A reply (`parse`) is then its calls (chat: `tool_calls` with ids `call_...`, arguments as JSON text,
finish_reason "tool_calls"; responses: `function_call` items) or the response's text.

The conversation as the session holds it: the system message with the tools' text after its own;
each assistant message as the JSON it was (its tool calls, or its text as the response); a tool's
result as a user message `{"tool_result":{"tool_call_id":ID,"content":TEXT}}`. Clients send the
assistant's messages back as they got them (arguments verbatim), so the same conversion gives the
stored text again and the session goes on from its KV (jobs.plan); a history that converts
differently (a conversation that gave no tools before) is answered as a cold run, as any edited
history is. A reply cut by max_tokens (finish_reason "length") is its response's text so far
(`cut_response`), or, cut in its calls, the text it is.
Stored messages read back (`stated_tools`, `read_result`) give the Responses API its items again.

A function here is anything with `name`, `description` and `parameters` (protocol.FunctionDef).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

INTRO = ('Answer with JSON only: {"response":<your answer>} to answer the user, or '
         '{"tool_calls":[{"name":<tool name>,"arguments":<its arguments, a JSON object>}]} to call tools. Tools:')


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def parameters(function) -> dict[str, Any]:
    """A function's arguments schema (any JSON object where it gives none). An object schema with properties
    that does not say whether it admits others admits none: a function takes the arguments it names
    (as OpenAI's strict mode asks schemas to say, and as llama.cpp's grammars take them)."""
    schema = function.parameters
    if schema is None:
        return {"type": "object"}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def system_text(functions: list) -> str:
    """What the system message says about the tools (after its own text)."""
    lines = [INTRO]
    for f in functions:
        entry = {"name": f.name, "parameters": parameters(f)}
        if f.description:
            entry["description"] = f.description
        lines.append(compact(entry))
    return "\n".join(lines)


def with_tools(system: str | None, functions: list) -> str:
    """A system message's text followed by the tools' (`system_text`)."""
    text = system_text(functions)
    return system + "\n\n" + text if system else text


def stated_tools(system: str) -> tuple[str, list[dict[str, Any]]] | None:
    """A stored system message's own text and the tools it states (each as `system_text` wrote it:
    name, parameters, description), or None where it states none."""
    own, sep, block = system.rpartition(INTRO)
    if not sep or (own and not own.endswith("\n\n")) or not block.startswith("\n"):
        return None
    try:
        entries = [json.loads(line) for line in block[1:].split("\n")]
    except ValueError:
        return None
    if not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
        return None
    return own.removesuffix("\n\n"), entries


def reply_format(functions: list, choice: str, parallel: bool, only: str | None = None) -> dict[str, Any]:
    """The response format of a reply to a request with tools (see the module's docstring): `choice`
    "auto", "none" or "required"; `only`: the one function a named tool_choice calls."""
    offered = [f for f in functions if only is None or f.name == only]
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": f.name}, "arguments": parameters(f)},
         "required": ["name", "arguments"], "additionalProperties": False} for f in offered]}}
    if not parallel:
        calls["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
            "additionalProperties": False}
    answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
              "additionalProperties": False}
    schema: dict[str, Any] = {"anyOf": [call, answer]} if choice == "auto" and only is None else \
        answer if choice == "none" else call
    return {"type": "json_schema", "schema": {**schema, "x-guidance": {"whitespace_flexible": False}}}


def calls_text(calls: list[tuple[str, str]]) -> str:
    """The reply text of tool calls ((name, arguments as JSON text) each), as the format writes it."""
    return '{"tool_calls":[' + ",".join(f'{{"name":{compact(name)},"arguments":{arguments}}}'
                                        for name, arguments in calls) + "]}"


def result_text(call_id: str, content: str) -> str:
    return compact({"tool_result": {"tool_call_id": call_id, "content": content}})


def read_result(text: str) -> tuple[str, str] | None:
    """(call id, content) of a user message that is a tool's result as `result_text` writes it, else None."""
    if not text.startswith('{"tool_result":'):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    result = value.get("tool_result") if isinstance(value, dict) and len(value) == 1 else None
    if not isinstance(result, dict) or set(result) != {"tool_call_id", "content"} or \
            not all(isinstance(v, str) for v in result.values()) or \
            result_text(result["tool_call_id"], result["content"]) != text:
        return None
    return result["tool_call_id"], result["content"]


def messages(body) -> list[dict[str, str]]:
    """A chat request's conversation as the session holds it (see the module's docstring); without
    tools, a tool call or result still reads as it does with them."""
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
        functions = [t.function for t in body.tools]
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": with_tools(out[0]["content"], functions)}
        else:
            out.insert(0, {"role": "system", "content": with_tools(None, functions)})
    return out


def item_messages(items: list, functions: list | None) -> list[dict[str, str]]:
    """Input items of the Responses and Conversations APIs (messages, `function_call`s,
    `function_call_output`s) as the session holds them: the calls of consecutive function_call items
    in one assistant message (a reply's calls, as it wrote them), each output a tool result; an
    assistant message, where `functions` are offered, as its response."""
    out: list[dict[str, str]] = []
    calls: list[tuple[str, str]] = []
    for item in items:
        if item.type == "function_call":
            calls.append((item.name, item.arguments))
            continue
        if calls:
            out.append({"role": "assistant", "content": calls_text(calls)})
            calls = []
        if item.type == "function_call_output":
            out.append({"role": "user", "content": result_text(item.call_id, item.text())})
        elif item.role == "assistant" and functions:
            out.append({"role": "assistant", "content": compact({"response": item.plain()["content"]})})
        else:
            out.append(item.plain())
    if calls:
        out.append({"role": "assistant", "content": calls_text(calls)})
    return out


def call_id(reply: str, index: int) -> str:
    """A call's id, from its reply (its session and where it began: the same for a resumed reply) and
    its index."""
    return "call_" + hashlib.sha256(f"{reply}:{index}".encode()).hexdigest()[:24]


def parse(text: str, finish: str) -> list[tuple[str, str]] | str:
    """A reply that could call tools: its calls ((name, arguments as JSON text) each), or its text
    (the response's, or the whole text where it is neither: cut by the token limit)."""
    try:
        value = json.loads(text) if finish == "stop" else None
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return [(c["name"], compact(c["arguments"])) for c in value["tool_calls"]]
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"]
    if finish != "stop" and text.startswith(RESPONSE_OPENING):
        return cut_response(text)
    return text


RESPONSE_OPENING = '{"response":"'


def cut_response(text: str) -> str:
    """The text so far of a response cut by the token limit (`{"response":"...`, its end not written):
    its JSON string decoded up to where it stops, an escape cut in half (or half a surrogate pair) left
    out. Text that does not decode (it cannot come from the format) is returned as it is."""
    body = text[len(RESPONSE_OPENING):]
    try:
        decoded = json.loads('"' + body[:_string_end(body)[0]] + '"')
    except ValueError:
        return text
    return decoded[:-1] if decoded and "\ud800" <= decoded[-1] <= "\udbff" else decoded


def _string_end(body: str) -> tuple[int, bool]:
    """(where a JSON string's text that began before `body` ends in it, whether its closing quote is
    there): at that quote, else at an escape cut in half, else at the end."""
    i = 0
    while i < len(body):
        if body[i] == "\\":
            need = 6 if body[i + 1:i + 2] == "u" else 2  # \uXXXX or \n, \", ...
            if i + need > len(body):
                return i, False
            i += need
        elif body[i] == '"':
            return i, True
        else:
            i += 1
    return len(body), False


def response_entries(entries: list | None, text: str, finish: str) -> list | None:
    """The logprobs entries (one per token, OpenAI's `{"token", "bytes", "logprob", "top_logprobs"}`) of
    a reply that could call tools, for what it shows: a response's entries are those of the tokens
    that write its text, not of those wholly inside the format's `{"response":"` and `"}`; a reply of
    calls keeps every token's (the calls' JSON). Entries that do not spell the text byte for byte (a
    resumed reply's replayed tokens have none) are left as they are."""
    if not entries or not text.startswith(RESPONSE_OPENING) or parse(text, finish) == text \
            or any(e is None for e in entries):
        return entries  # not a response (calls, or text the format did not finish)
    raw = text.encode()
    if sum(len(e["bytes"] or ()) for e in entries) != len(raw):
        return entries
    closing = 2 if finish == "stop" else int(_string_end(text[len(RESPONSE_OPENING):])[1])  # '"}', or its '"'
    first, last, at, kept = len(RESPONSE_OPENING), len(raw) - closing, 0, []
    for e in entries:
        start, at = at, at + len(e["bytes"] or ())
        if at > first and start < last:
            kept.append(e)
    return kept


def written_calls(text: str) -> bool:
    """Whether `text` is tool calls exactly as `calls_text` writes them (read back as calls wherever it stands)."""
    parsed = parse(text, "stop") if text.startswith('{"tool_calls":') else text
    return isinstance(parsed, list) and calls_text(parsed) == text


def shape(text: str, finish: str, reply: str) -> tuple[dict[str, Any], str]:
    """(the chat message's content and tool_calls, the finish reason) of a reply that could call tools."""
    parsed = parse(text, finish)
    if isinstance(parsed, str):
        return {"content": parsed}, finish
    calls = [{"id": call_id(reply, i), "type": "function", "function": {"name": name, "arguments": arguments}}
             for i, (name, arguments) in enumerate(parsed)]
    return {"content": None, "tool_calls": calls}, "tool_calls"
