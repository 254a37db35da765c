"""Tool calls on the Responses API (`serve/tools.py`, `serve/items.py`): a response to a request with
function `tools` is held to the tool-call format and its output is `function_call` items (or the
message of its answer); the client answers them with `function_call_output` items, on the previous
response (its KV) or resent with the whole history; the replies are the library's with the same
messages and format, bit for bit; streams carry the function-call events; GET, input items and a
conversation's items read the calls and results back from the session; bad requests are 400s.

A live server on the tiny Llama with a context of 2,048 (random weights: what it writes is noise,
held to the format; each tool's arguments are bounded, so replies end)."""

from __future__ import annotations

import json
import re

import openai
import pytest

import kvstore
from conftest import single_thread
from kvstore_serve import items, protocol, tools
from serve_kit import MODEL_NAME
from test_serve_responses import sse
from test_serve_tools import model_folder, server  # noqa: F401 (fixtures: the tiny Llama of 2,048, its server)

CHUNK = 16
UNIT = {"type": "function", "name": "set_unit", "description": "Set the unit",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}
FLAG = {"type": "function", "name": "flag",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}
TOOLS = [UNIT, FLAG]
LIMIT = 60


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def respond(client, input, **kw):
    extra = {"kvstore_trace": True, **kw.pop("extra_body", {})}
    kw.setdefault("max_output_tokens", LIMIT)
    return client.responses.create(model=MODEL_NAME, input=input, extra_body=extra, **kw)


def checked_calls(output) -> list[tuple[str, dict]]:
    """(name, arguments) of each function_call item, checked against the tools' schemas."""
    out = []
    for item in output:
        assert item.type == "function_call" and item.status == "completed"
        assert re.fullmatch(r"call_[0-9a-f]{24}", item.call_id) and item.id.startswith("fc_")
        args = json.loads(item.arguments)
        if item.name == "set_unit":
            assert set(args) == {"unit"} and args["unit"] in ("c", "f")
        else:
            assert item.name == "flag" and set(args) == {"on"} and isinstance(args["on"], bool)
        out.append((item.name, args))
    return out


def lib_lines(session, request: dict, tmp_path, restated: bool = False) -> list[dict]:
    """The library's turn for a Responses request on `session`: its messages as the server converts
    them, fed as context but the last (`restated`: the first, the instructions and tools in effect,
    restated), answered under the request's format; its trace lines."""
    body = protocol.ResponseRequest(model=MODEL_NAME, **request)
    messages = body.input_messages()
    path = tmp_path / f"lib-{session.name}-{len(session.tokens)}.jsonl"
    if restated:
        session.restate_system(messages.pop(0)["content"])
    with single_thread():
        for m in messages[:-1]:
            session.add_message(m["role"], m["content"])
        "".join(session.chat(messages[-1]["content"], max_new_tokens=LIMIT, trace=str(path), temperature=1.0,
                             top_p=1.0, response_format=body.format()))
    return [json.loads(line) for line in path.read_text().splitlines()]


def same_object(posted, got, but: tuple[str, ...] = ()) -> None:
    """POST's object and GET's, equal but in what the store does not keep (and `but`)."""
    a, b = posted.model_dump(), got.model_dump()
    for d in (a, b):
        for key in ("kvstore", "created_at", "max_output_tokens", *but):
            d.pop(key, None)
    assert a == b


# -- live -----------------------------------------------------------------------------------------
def test_an_agent_loop_on_previous_response_id_is_the_librarys_run(client, server, model_folder, tmp_path):
    first = {"input": "set it up", "instructions": "Be brief.", "tools": TOOLS, "tool_choice": "required"}
    r1 = respond(client, extra_body={"seed": 7}, **first)
    calls = checked_calls(r1.output)
    assert calls and r1.status == "completed" and r1.output_text == ""
    assert r1.tool_choice == "required" and [t.name for t in r1.tools] == ["set_unit", "flag"]
    assert r1.instructions == "Be brief."

    results = [{"type": "function_call_output", "call_id": item.call_id, "output": f"done {i}"}
               for i, item in enumerate(r1.output)]
    # the answer to the results, then calls again; instructions and tools sent with every turn (as the
    # agents SDK does: they are not carried over), restated, not read again
    second = {"input": results, "instructions": "Be brief.", "tools": TOOLS, "tool_choice": "none"}
    r2 = respond(client, previous_response_id=r1.id, **second)
    assert [o.type for o in r2.output] == ["message"] and r2.output[0].role == "assistant"
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.total_tokens - 1  # r1's KV, not recomputed
    third = {**first, "input": "and again", "parallel_tool_calls": False}  # one call: within LIMIT whatever the ids
    r3 = respond(client, previous_response_id=r2.id, **third)
    assert checked_calls(r3.output) and r3.instructions == "Be brief."

    store = kvstore.open_store(tmp_path / "lib")
    with single_thread():
        model = kvstore.load_model(model_folder)
    with store.new("agent", model, seed=7, chunk_size=CHUNK) as s:
        lines1 = lib_lines(s, first, tmp_path)
        lines2 = lib_lines(s, second, tmp_path, restated=True)
        lines3 = lib_lines(s, third, tmp_path, restated=True)
    store.close()
    assert [r.model_extra["kvstore"]["trace"] for r in (r1, r2, r3)] == [lines1, lines2, lines3]  # bits

    got1, got2, got3 = (client.responses.retrieve(r.id) for r in (r1, r2, r3))
    # the same items and call ids, from the store (r3's calls read back under its restated tools)
    assert (got1.output, got2.output, got3.output) == (r1.output, r2.output, r3.output)
    # tool_choice and parallel_tool_calls only narrow the format: not kept, GET says auto and true
    same_object(r1, got1, but=("tool_choice",))
    same_object(r2, got2, but=("tool_choice",))
    same_object(r3, got3, but=("tool_choice", "parallel_tool_calls"))
    assert got1.tool_choice == got2.tool_choice == "auto" and got3.parallel_tool_calls is True
    assert got1.tools == r1.tools == got3.tools
    inputs = client.responses.input_items.list(r2.id, order="asc").data  # its instructions (their text), the results
    assert (inputs[0].type, inputs[0].role, inputs[0].content[0].text) == ("message", "system", "Be brief.")
    assert [(i.type, i.call_id, i.output) for i in inputs[1:]] == [
        ("function_call_output", item.call_id, f"done {i}") for i, item in enumerate(r1.output)]


def test_a_stateless_client_resends_the_calls_and_their_results(client):
    """The agents SDK's default: no stored state; the whole history each turn, output items as they came."""
    r1 = respond(client, "set it up", tools=TOOLS, tool_choice={"type": "function", "name": "flag"},
                 parallel_tool_calls=False, store=False)
    assert [name for name, _ in checked_calls(r1.output)] == ["flag"]  # one call, of the named tool
    assert r1.tool_choice.name == "flag" and r1.parallel_tool_calls is False
    history = ["set it up", *[o.model_dump(exclude_none=True) for o in r1.output],
               {"type": "function_call_output", "call_id": r1.output[0].call_id, "output": "ok"}]
    history[0] = {"role": "user", "content": history[0]}
    r2 = respond(client, history, tools=TOOLS, store=False)
    assert r2.status in ("completed", "incomplete") and r2.output
    assert r2.usage.input_tokens > r1.usage.total_tokens


def test_a_streamed_call_comes_whole_and_resumes_with_last_event_id(client, server):
    with client.responses.create(model=MODEL_NAME, input="set it up", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=LIMIT, stream=True, extra_body={"seed": 7}) as stream:
        events = list(stream)  # the SDK's typed events: each one of its known types
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    per_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds[2:-1] == per_call * len(done.output)
    for index, item in enumerate(done.output):
        added, delta, args_done, item_done = events[2 + 4 * index:6 + 4 * index]
        assert added.item.arguments == "" and added.item.status == "in_progress" and added.output_index == index
        assert delta.delta == args_done.arguments == item.arguments and delta.item_id == item.id
        assert item_done.item == item
    checked_calls(done.output)

    # a stream broken after its header: resent with Last-Event-ID, the rest, with the same calls
    body = {"model": MODEL_NAME, "input": "set it up", "tools": TOOLS, "tool_choice": "required", "stream": True,
            "max_output_tokens": LIMIT, "seed": 3}
    http = server.http()
    with http.stream("POST", "/v1/responses", json=body) as broken:
        head = sse(broken, limit=2)
    with http.stream("POST", "/v1/responses", json=body, headers={"Last-Event-ID": head[-1]["id"]}) as resumed:
        rest = sse(resumed)
    assert [e["data"]["sequence_number"] for e in head + rest] == list(range(len(head) + len(rest)))
    final = rest[-1]["data"]["response"]
    assert final["id"] == head[0]["data"]["response"]["id"] and final["status"] == "completed"
    twin = respond(client, "set it up", tools=TOOLS, tool_choice="required", extra_body={"seed": 3})
    assert [(o["name"], o["arguments"]) for o in final["output"]] == [(o.name, o.arguments) for o in twin.output]


def test_a_conversation_reads_calls_and_results_back_as_items(client):
    conv = client.conversations.create(extra_body={"seed": 5})
    r1 = respond(client, "set it up", conversation=conv.id, tools=TOOLS, tool_choice="required")
    calls = r1.output
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
    r2 = respond(client, outputs, conversation=conv.id, tools=TOOLS, tool_choice="none")
    r3 = respond(client, "and without tools?", conversation=conv.id, max_output_tokens=4)
    listed = client.conversations.items.list(conv.id, order="asc").data
    kinds = [i.type for i in listed]
    assert kinds == ["message", *["function_call"] * len(calls), *["function_call_output"] * len(calls),
                     "message", "message", "message"]
    assert listed[0].role == "user" and listed[0].content[0].text == "set it up"  # no item for the tools' text
    fields = ("id", "call_id", "name", "arguments", "status")
    assert [[getattr(i, f) for f in fields] for i in listed[1:1 + len(calls)]] == \
        [[getattr(c, f) for f in fields] for c in calls]
    assert listed[-3].id == r2.output[0].id and listed[-1].id == r3.output[0].id
    assert listed[-1].content[0].text == r3.output_text  # a turn without tools: its text as it is
    one = client.conversations.items.retrieve(calls[0].id, conversation_id=conv.id)
    assert one.type == "function_call" and one.call_id == calls[0].call_id
    added = client.conversations.items.create(conv.id, items=[
        {"type": "function_call", "call_id": "call_x", "name": "flag", "arguments": '{"on":true}'},
        {"type": "function_call_output", "call_id": "call_x", "output": "on"}])
    call, output = added.data  # a call reads back with the id this server gives calls (the text keeps none)
    assert (call.type, call.name, call.arguments, output.type, output.call_id, output.output) == (
        "function_call", "flag", '{"on":true}', "function_call_output", "call_x", "on")
    assert re.fullmatch(r"fc_[0-9a-f]{32}_\d+_0", call.id) and re.fullmatch(r"call_[0-9a-f]{24}", call.call_id)


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": [UNIT, UNIT]}, "tools", "same name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "gives no tools"),
    ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "tool_choice", "not both"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "'reasoning'"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "flag", "arguments": "{}"}]}, "input",
     "must end with a user message or a function_call_output"),
]


@pytest.mark.parametrize("more, param, why", BAD)
def test_a_bad_tool_request_is_a_400_naming_the_field(server, more, param, why):
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4, **more}
    r = server.http().post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].split(".")[0] == param and why in error["message"], error


def test_completions_still_refuse_tools(server):
    r = server.http().post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "tools": [UNIT]})
    assert r.status_code == 400 and "chat completions and responses" in r.json()["error"]["message"]


# -- the conversion, without a server --------------------------------------------------------------
def test_input_items_convert_as_chat_messages_do():
    """The same history gives the same text through either API (a session can be read by both)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "set_unit", "arguments": '{"unit":"c"}'}
    answered = [{"role": "user", "content": "hi"}, call, {**call, "call_id": "call_2", "arguments": '{"unit":"f"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]},
                {"role": "assistant", "content": "Done."}, {"role": "user", "content": "thanks"}]
    response = protocol.ResponseRequest(model="m", instructions="Be brief.", tools=[UNIT], input=answered)
    chat = protocol.ChatRequest(model="m", tools=[{"type": "function", "function": {
        k: v for k, v in UNIT.items() if k != "type"}}], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "set_unit", "arguments": '{"unit":"c"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "set_unit", "arguments": '{"unit":"f"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
        {"role": "assistant", "content": "Done."}, {"role": "user", "content": "thanks"}])
    assert response.input_messages() == chat.plain_messages()
    assert response.format() == chat.format()
    assert protocol.ResponseRequest(model="m", input=answered).input_messages()[-2] == \
        {"role": "assistant", "content": "Done."}  # no tools: a message is its text


def test_stored_messages_read_back_as_the_items_they_were():
    system = tools.with_tools("Be brief.", [protocol.ResponseTool(**UNIT)])
    assert tools.stated_tools(system) == ("Be brief.", [{"name": "set_unit", "parameters": {
        **UNIT["parameters"], "additionalProperties": False}, "description": "Set the unit"}])
    assert tools.stated_tools("Be brief.") is None and tools.stated_tools(tools.INTRO + " x") is None
    result = tools.result_text("call_1", 'a "quoted"\nresult')
    assert tools.read_result(result) == ("call_1", 'a "quoted"\nresult')
    assert tools.read_result('{"tool_result": {"tool_call_id": "c", "content": "x"}}') is None  # not as written
    texts = [("system", system), ("user", "hi"), ("assistant", tools.calls_text([("set_unit", '{"unit":"c"}')])),
             ("system", tools.with_tools(None, [protocol.ResponseTool(**UNIT)])),  # the next request's: tools only
             ("user", result), ("assistant", '{"response":"ok"}'),
             ("user", "more"), ("assistant", '{"response":"ok"}')]  # a turn that offered no tools
    read = items.history_items([{"ordinal": i, "role": role, "text": text} for i, (role, text) in enumerate(texts)],
                               "abc")
    assert [(o, i["type"], i.get("role")) for o, i in read] == [
        (0, "message", "system"), (1, "message", "user"), (2, "function_call", None), (4, "function_call_output", None),
        (5, "message", "assistant"), (6, "message", "user"), (7, "message", "assistant")]
    assert read[0][1]["content"][0]["text"] == "Be brief."
    assert read[2][1] == {"type": "function_call", "id": "fc_abc_2_0", "call_id": tools.call_id("abc:2", 0),
                          "name": "set_unit", "arguments": '{"unit":"c"}', "status": "completed"}
    assert read[3][1]["call_id"] == "call_1" and read[4][1]["content"][0]["text"] == "ok"
    assert read[6][1]["content"][0]["text"] == '{"response":"ok"}'


def test_the_sdk_parses_the_events_it_knows(client):
    """openai's event types: a parse error would raise (the SDK validates each event's type)."""
    with client.responses.stream(model=MODEL_NAME, input="set it up", tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=LIMIT, extra_body={"seed": 7}) as stream:
        final = stream.get_final_response()
    assert isinstance(final, openai.types.responses.Response) and checked_calls(final.output)


@pytest.mark.realmodel
def test_the_real_model_in_a_stateless_agent_loop_calls_answers_and_reuses_the_history(tmp_path, smollm2_path):
    """SmolLM2 over the Responses API as agent frameworks drive it by default: the whole history resent
    each turn. It calls the tool it must, with arguments the schema accepts; each turn after the first
    reuses the history's KV from the last one's session (on the default model's kernels, keys every 32
    positions though the chunk is 512), and given the result it answers in text."""
    from serve_kit import LiveServer

    weather = {"type": "function", "name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    with LiveServer(tmp_path / "home", smollm2_path, "--threads", "2") as server:
        client = server.client()
        history = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.responses.create(model=MODEL_NAME, input=history, tools=[weather], tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_output_tokens=40)
        (called,) = first.output
        assert called.type == "function_call" and called.name == "get_weather"
        assert set(json.loads(called.arguments)) == {"city"}
        history += [called.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": called.call_id, "output": "18 C and sunny"}]
        second = client.responses.create(model=MODEL_NAME, input=history, tools=[weather], tool_choice="none",
                                         temperature=0, max_output_tokens=60)
        assert [o.type for o in second.output] == ["message"] and second.output_text
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 32


def test_a_streamed_call_cut_by_kill_9_of_the_engine_or_the_server_comes_whole(tmp_path, model_folder):
    """A long call (its argument 150-200 characters) streaming when its engine is killed, and again when
    the whole server is killed and its client resends with the header's id: the response ends completed
    with the calls an uninterrupted stream of the same request makes."""
    import httpx
    from serve_kit import LiveServer

    note = {"type": "function", "name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "pattern": "^[a-z ]{150,200}$"}},
        "required": ["text"]}}
    body = {"model": MODEL_NAME, "input": "set it up", "tools": [note], "tool_choice": "required",
            "max_output_tokens": 400, "temperature": 0.9, "seed": 7, "stream": True}

    def calls(events):
        final = events[-1]["data"]["response"]
        assert events[-1]["event"] == "response.completed", events[-1]
        return [(o["name"], o["arguments"]) for o in final["output"]]

    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        with server.http().stream("POST", "/v1/responses", json=body) as r:
            whole = calls(sse(r))
        assert len(json.loads(whole[0][1])["text"]) >= 150
        engine = server.engine_pids()[0]
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # the header has begun
            assert server.kill_engine() == engine
            rest = sse(_Lines([first], lines))
        assert server.engine_pids() != [engine] and calls(rest) == whole
        with server.http().stream("POST", "/v1/responses", json=body) as r:
            head = sse(r, limit=2)
        server.kill()
        server.start()
        with server.http().stream("POST", "/v1/responses", json=body, headers={"Last-Event-ID": head[-1]["id"]}) as r:
            resumed = sse(r)
        assert calls(resumed) == whole and resumed[-1]["data"]["response"]["id"] == head[0]["data"]["response"]["id"]


class _Lines:
    """A response whose lines are some already read, then the rest (for `sse`)."""

    def __init__(self, read, rest):
        self.read, self.rest = read, rest

    def iter_lines(self):
        yield from self.read
        yield ""
        yield from self.rest
