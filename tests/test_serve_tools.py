"""Tool calls on chat completions (`serve/tools.py`): a request with `tools` gets a reply held to the
tool-call format, shaped as OpenAI's `tool_calls` (whole, or in a stream's last chunk); the
conversation, with the calls and their results sent back as the client got them, goes on from the
session's KV; the reply is the library's with the same prompt and format, bit for bit; bad tool
requests are 400s naming the field.

A live server on the tiny Llama with a context of 2,048 (random weights: what it writes is noise, held to the format; each
tool's arguments are bounded, so replies end)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

import kvstore
from conftest import single_thread
from kvstore_serve import protocol, tools
from serve_kit import MODEL_NAME, LiveServer

CHUNK = 16
UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Set the unit",
                                         "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                                                        "required": ["unit"]}}}
FLAG = {"type": "function", "function": {"name": "flag", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}
TOOLS = [UNIT, FLAG]
ASK = [{"role": "user", "content": "set it up"}]


@pytest.fixture(scope="module")
def model_folder(tiny) -> str:
    return str(tiny("llama-long").folder)  # the tools' text takes ~480 of its tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_folder):
    home = tmp_path_factory.mktemp("serve-tools") / "home"
    with LiveServer(home, model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as s:
        yield s


def call(client, messages, session=None, **kw):
    extra = {"kvstore_trace": True, **({"session": session} if session else {})}
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0.9, seed=7,
                                          extra_body=extra, **kw)


def checked_calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each tool call, checked against the tools' schemas."""
    out = []
    for c in message.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.type == "function"
        args = json.loads(c.function.arguments)
        if c.function.name == "set_unit":
            assert set(args) == {"unit"} and args["unit"] in ("c", "f")
        else:
            assert c.function.name == "flag" and set(args) == {"on"} and isinstance(args["on"], bool)
        out.append((c.function.name, args))
    return out


def test_a_required_tool_call_is_a_call_of_the_tools_and_the_librarys_reply(server, model_folder, tmp_path):
    reply = call(server.client(), ASK, tools=TOOLS, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert checked_calls(choice.message)
    body = protocol.ChatRequest(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required")
    store = kvstore.open_store(tmp_path / "lib")
    with single_thread(), store.new("lib", kvstore.load_model(model_folder), seed=7, chunk_size=CHUNK,
                                    temperature=0.9) as s:
        "".join(s.respond(body.plain_messages(), 60, trace=str(tmp_path / "lib.jsonl"), response_format=body.format()))
    lines = [json.loads(line) for line in (tmp_path / "lib.jsonl").read_text().splitlines()]
    assert lines == reply.kvstore["trace"]  # tokens and logits bits
    store.close()


def test_a_named_tool_choice_calls_that_tool_once_without_parallel_calls(server):
    reply = call(server.client(), ASK, tools=TOOLS, parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "flag"}})
    calls = checked_calls(reply.choices[0].message)
    assert len(calls) == 1 and calls[0][0] == "flag"


def test_a_response_beside_tools_is_its_text_and_the_logprobs_of_its_tokens(server):
    """tool_choice none, cut by the token limit: the content is the response's text so far, not the
    format's JSON, and the logprobs report its tokens, not the format's opening (chat and Responses)."""
    client = server.client()
    reply = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12,
                                           logprobs=True, seed=5, extra_body={"kvstore_trace": True})
    choice, lines = reply.choices[0], reply.model_extra["kvstore"]["trace"]
    assert choice.finish_reason == "length" and not choice.message.content.startswith('{"')
    shown = b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode("utf-8", "replace")
    assert 0 < len(choice.logprobs.content) < len(lines) and '{"response":"' not in shown
    assert choice.message.content[:3] in shown  # the tokens that write it
    answer = client.responses.create(model=MODEL_NAME, input="set it up", max_output_tokens=12, tools=[
        {"type": "function", **t["function"]} for t in TOOLS], tool_choice="none", include=["message.output_text.logprobs"],
        extra_body={"seed": 5})
    (text,) = answer.output[0].content
    assert answer.status == "incomplete" and not text.text.startswith('{"') and text.text[:3] in "".join(
        bytes(e.bytes).decode("utf-8", "replace") for e in text.logprobs)


def test_the_conversation_goes_on_from_the_sessions_kv_with_the_results(server):
    """The calls sent back as the SDK returned them and each one's result: the next turn feeds only
    those (its cached tokens are all the stored session computed), and the session holds them as text."""
    client = server.client()
    first = call(client, ASK, session="agent", tools=TOOLS, tool_choice="required")
    message = first.choices[0].message
    held = server.http().get("/v1/sessions/agent").json()
    messages = ASK + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "done"} for c in message.tool_calls]
    second = call(client, messages, session="agent", tools=TOOLS)
    assert second.usage.prompt_tokens_details.cached_tokens == held["n_cached"] == held["n_tokens"] - 1  # its EOS fed now
    assert second.choices[0].finish_reason in ("tool_calls", "stop", "length")
    stored = server.http().get("/v1/sessions/agent/messages").json()["data"]
    texts = [m["content"] if isinstance(m.get("content"), str) else m.get("text") for m in stored]
    assert any('"tool_result":{"tool_call_id":"' + message.tool_calls[0].id in (t or "") for t in texts)


def test_a_streamed_tool_call_comes_whole_in_the_last_chunk_and_resumes_from_the_start(server):
    """Nothing of the JSON streams as content: after the opening, one chunk with every call (each with
    its index) and finish_reason tool_calls. A client gone after the opening resends with its id and
    gets the calls the same request makes, with the same ids each time it asks."""
    body = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60,
            "temperature": 0.9, "seed": 7, "stream": True, "session": "streamed"}
    whole = events(server, body, {})
    chunks = [d for _, d in whole if d]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "tool_calls"]
    calls = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert [c["index"] for c in calls] == list(range(len(calls))) and all(c["id"].startswith("call_") for c in calls)
    sdk = server.client().chat.completions.create(**{k: v for k, v in body.items() if k != "session"},
                                                  extra_body={"session": "streamed-sdk"})
    deltas = [c.choices[0].delta for c in sdk if c.choices]
    assert [t.function.name for d in deltas for t in d.tool_calls or ()] == [c["function"]["name"] for c in calls]
    cut = events(server, {**body, "session": "cut"}, {}, stop_after=1)
    rest = events(server, {**body, "session": "cut"}, {"Last-Event-ID": [i for i, _ in cut if i][-1]})
    resumed = [d for _, d in rest if d][-1]["choices"][0]["delta"]["tool_calls"]
    assert [c["function"] for c in resumed] == [c["function"] for c in calls]  # what the same request calls
    again = events(server, {**body, "session": "cut"}, {"Last-Event-ID": [i for i, _ in cut if i][-1]})
    assert [d for _, d in again if d][-1]["choices"][0]["delta"]["tool_calls"] == resumed  # ids too


def events(server, body: dict, headers: dict, stop_after: int | None = None) -> list[tuple[str, dict]]:
    out, event_id = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                out.append((event_id, None if line[6:] == "[DONE]" else json.loads(line[6:])))
                if stop_after is not None and sum(1 for i, _ in out if i) >= stop_after:
                    break
    return out


@pytest.mark.parametrize("more, param, why", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of the tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "gives no tools"),
    ({"response_format": {"type": "json_object"}}, "tool_choice", "not both"),
    ({"tools": [UNIT, UNIT]}, "tools", "same name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "foo"}}}]}, "tools",
     "not a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages.0", "tool_call_id"),
    ({"functions": [{"name": "f"}]}, "functions", "legacy function calls"),
])
def test_a_bad_tool_request_is_a_400_naming_the_field(server, more, param, why):
    body = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **more}
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and why in error["message"], error


# -- the conversion and the shapes, without a server ------------------------------------------------
def test_the_history_converts_to_the_text_the_session_holds():
    body = protocol.ChatRequest(model="m", tools=[UNIT], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "set_unit", "arguments": '{"unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "assistant", "content": "Done."}])
    system, user, called, result, answered = body.plain_messages()
    assert system["content"].startswith("Be brief.\n\n" + tools.INTRO) and '"name":"set_unit"' in system["content"]
    assert '"additionalProperties":false' in system["content"]  # a function takes the arguments it names
    assert user == {"role": "user", "content": "hi"}
    assert called == {"role": "assistant", "content": '{"tool_calls":[{"name":"set_unit","arguments":{"unit":"c"}}]}'}
    assert result == {"role": "user", "content": '{"tool_result":{"tool_call_id":"call_1","content":"ok"}}'}
    assert answered == {"role": "assistant", "content": '{"response":"Done."}'}
    assert protocol.ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}]).plain_messages() == \
        [{"role": "user", "content": "hi"}]  # no tools: as before


def test_a_reply_is_shaped_as_tool_calls_a_response_or_its_text():
    fields, finish = tools.shape('{"tool_calls":[{"name":"flag","arguments":{"on":true}}]}', "stop", "chatcmpl-x")
    assert finish == "tool_calls" and fields["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in fields["tool_calls"]] == [("flag", '{"on":true}')]
    assert fields["tool_calls"][0]["id"] == tools.shape(
        '{"tool_calls":[{"name":"flag","arguments":{"on":true}}]}', "stop", "chatcmpl-x")[0]["tool_calls"][0]["id"]
    assert tools.shape('{"response":"Hi there"}', "stop", "r") == ({"content": "Hi there"}, "stop")
    assert tools.shape('{"tool_calls":[{"name":"fl', "length", "r") == ({"content": '{"tool_calls":[{"name":"fl'}, "length")


def test_a_response_cut_by_the_token_limit_is_its_text_so_far():
    """Not the format's JSON: the response's string decoded up to the cut, an escape cut in half left out."""
    cut = {'{"response":"Hello, I\'m a Py': "Hello, I'm a Py", '{"response":"': "",
           '{"response":"a\\': "a", '{"response":"a\\n': "a\n", '{"response":"a\\u00': "a",
           '{"response":"a\\u00e9': "a\u00e9", '{"response":"say \\"hi\\" now': 'say "hi" now',
           '{"response":"done"': "done", '{"response":"x\\ud83d': "x", '{"response":"x\\ud83d\\ude00': "x\U0001f600"}
    for text, shown in cut.items():
        assert tools.shape(text, "length", "r") == ({"content": shown}, "length"), text
        assert tools.parse(text, "length") == shown
    assert tools.parse('{"response":"done"}', "stop") == "done"
    assert tools.parse('{"response":"\\x', "length") == '{"response":"\\x'  # not JSON: as it is


def test_a_responses_logprobs_are_those_of_its_own_text():
    """A reply held to the tool format reports, for a response, the entries of the tokens that write
    its text (a token that straddles the format's edge included), not those wholly inside the format's
    `{"response":"` and `"}`; calls keep every token's; entries that do not spell the text stay as they are."""
    def entries(*pieces):
        return [{"token": p, "bytes": list(p.encode()), "logprob": -1.0, "top_logprobs": []} for p in pieces]

    def kept(pieces, finish):
        return [e["token"] for e in tools.response_entries(entries(*pieces), "".join(pieces), finish)]

    assert kept(['{"', "response", '":', '"', "Hi", " there", '"}'], "stop") == ["Hi", " there"]
    assert kept(['{"response":"Hi', " there", '"', "}"], "stop") == ['{"response":"Hi', " there"]
    assert kept(['{"', "response", '":"', "Hi"], "length") == ["Hi"]
    assert kept(['{"', "response", '":"', "Hi", '"'], "length") == ["Hi"]  # cut before its closing brace
    calls = ['{"tool_calls":[{"name":"flag","arguments":{"on":true}}]}']
    assert kept(calls, "stop") == calls
    gaps = [None, *entries(" there", '"}')]
    assert tools.response_entries(gaps, '{"response":"Hi there"}', "stop") == gaps


def test_tool_choice_narrows_the_format_and_the_prompt_stays_the_same():
    def request(choice):
        return protocol.ChatRequest(model="m", messages=ASK, tools=TOOLS, tool_choice=choice)
    prompts = {json.dumps(request(c).plain_messages()) for c in ("none", "auto", "required")}
    assert len(prompts) == 1
    model_free = kvstore.check_response_format  # each format is one the library holds a reply to
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "flag"}}):
        assert model_free(request(choice).format())
    assert request("none").format()["schema"]["properties"] == {"response": {"type": "string"}}
    assert "anyOf" in request("auto").format()["schema"]
    named = request({"type": "function", "function": {"name": "flag"}}).format()["schema"]
    assert [a["properties"]["name"] for a in named["properties"]["tool_calls"]["items"]["anyOf"]] == [{"const": "flag"}]


@pytest.mark.realmodel
def test_the_real_model_calls_a_tool_well_formed_and_answers_its_result(tmp_path, smollm2_path):
    """SmolLM2 over HTTP, greedy: asked for the weather with a weather tool required, it calls it with
    arguments the schema accepts; given the result, with tool_choice none, it answers in text."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    with LiveServer(tmp_path / "home", smollm2_path, "--threads", "2") as server:
        client = server.client()
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[weather],
                                               tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=40, extra_body={"session": "weather"})
        (called,) = first.choices[0].message.tool_calls
        assert called.function.name == "get_weather" and set(json.loads(called.function.arguments)) == {"city"}
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": called.id, "content": "18 C and sunny"}]
        second = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[weather], tool_choice="none",
                                                temperature=0, max_tokens=60, extra_body={"session": "weather"})
        answer = second.choices[0]
        assert answer.message.tool_calls is None and answer.message.content
        assert not answer.message.content.startswith('{"response"')  # its text, cut by the limit or not
        assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "pattern": "^[a-z ]{150,200}$"}}, "required": ["text"]}}}


def test_a_tool_call_cut_by_kill_9_of_the_engine_or_the_server_comes_whole(tmp_path, model_folder):
    """A long call (its argument 150-200 characters) streaming when its engine is killed, and again
    when the whole server is killed and its client resends with the opening's id: the last chunk
    holds the calls an uninterrupted stream of the same request holds, ids included."""
    body = {"model": MODEL_NAME, "messages": ASK, "tools": [NOTE], "tool_choice": "required", "max_tokens": 400,
            "temperature": 0.9, "seed": 7, "stream": True}
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        def calls_of(out):
            return [d for _, d in out if d][-1]["choices"][0]["delta"]["tool_calls"]

        whole = calls_of(events(server, {**body, "session": "whole"}, {}))
        assert len(json.loads(whole[0]["function"]["arguments"])["text"]) >= 150
        engine = server.engine_pids()[0]
        killed = []

        def kill_after_opening(out):
            if len(out) == 1 and not killed:
                killed.append(server.kill_engine())

        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "session": "engine-cut"},
                          timeout=120) as r:
            out, event_id = [], None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append((event_id, None if line[6:] == "[DONE]" else json.loads(line[6:])))
                    kill_after_opening(out)
        assert killed == [engine] and server.engine_pids() != [engine] and out[-1][1] is None
        assert [c["function"] for c in calls_of(out)] == [c["function"] for c in whole]
        cut = events(server, {**body, "session": "server-cut"}, {}, stop_after=1)
        server.kill()
        server.start()
        rest = events(server, {**body, "session": "server-cut"}, {"Last-Event-ID": [i for i, _ in cut if i][-1]})
        assert [c["function"] for c in calls_of(rest)] == [c["function"] for c in whole]
