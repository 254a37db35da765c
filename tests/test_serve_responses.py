"""OpenAI's Responses and Conversations APIs on a live `kvstore serve`, through the official client.

What they prove: a conversation is a stored session and its items are its messages; a response id
is an immutable checkpoint (continuing from an older one is a fork, the newer ones untouched, the
older KV reused, no bytes copied); a chain of responses yields the tokens and logits bits of the
same conversation run through the library; GET derives the same object the POST returned; streams
carry the Responses event types with sequence numbers, and a broken stream resent with
Last-Event-ID gets exactly the rest; unknown ids, and another tenant's, are 404 in OpenAI's shape.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from conftest import single_thread
from serve_kit import MODEL_NAME, LiveServer

import kvstore

ALICE, BOB = "alice-key-0001", "bob-key-00002"
TOKENS = 10  # per response: the tiny model rarely ends a reply by itself, so most end at the limit


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny("llama-gqa").folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    home = tmp_path_factory.mktemp("serve-responses") / "home"
    with LiveServer(home, folder, "--chunk-size", "16", "--threads", "1",
                    env={"KVSTORE_API_KEYS": f"{ALICE},{BOB}"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=ALICE)


@pytest.fixture(scope="module")
def library(tmp_path_factory, folder):
    """The same conversations run through the library: (store, model)."""
    store = kvstore.open_store(tmp_path_factory.mktemp("library-home"))
    with single_thread():
        model = kvstore.load_model(str(folder))
    yield store, model
    store.close()


def trace_of(response) -> list[dict]:
    return response.model_extra["kvstore"]["trace"]


def lib_turn(session, text: str, tmp_path, n: int = TOKENS) -> tuple[str, list[dict]]:
    """A library turn: (its reply text, its trace lines), on one thread as the server's engine runs."""
    path = tmp_path / f"trace-{session.name}-{len(session.tokens)}.jsonl"
    with single_thread():
        reply = "".join(session.chat(text, max_new_tokens=n, trace=path, temperature=1.0, top_p=1.0))
    return reply, [json.loads(line) for line in path.read_text().splitlines()]


def ask(client, text: str, **kw):
    return client.responses.create(model=MODEL_NAME, input=text, max_output_tokens=TOKENS,
                                   extra_body={"kvstore_trace": True, **kw.pop("extra_body", {})}, **kw)


def same_object(posted, got) -> None:
    a, b = posted.model_dump(), got.model_dump()
    for d in (a, b):
        d.pop("kvstore", None)
        d.pop("created_at")  # the POST says when it began, the session when its snapshot was made
        d.pop("max_output_tokens")  # a request's limit: the store does not keep it
    assert a == b


# -- conversations ---------------------------------------------------------------------------------
def test_a_conversation_chain_is_the_librarys_run(client, server, library, tmp_path):
    store, model = library
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hello"}],
                                       extra_body={"seed": 7})
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    r1 = ask(client, "The fox", conversation=conv.id)
    with client.responses.create(model=MODEL_NAME, input="and the dog?", conversation={"id": conv.id},
                                 max_output_tokens=TOKENS, stream=True, extra_body={"kvstore_trace": True}) as stream:
        events = list(stream)
    r2 = events[-1].response
    streamed = [line for e in events if e.type == "response.output_text.delta"
                for line in (e.model_extra.get("kvstore") or {}).get("trace", [])]

    with store.new("conversation", model, seed=7, chunk_size=16) as s:
        s.add_message("user", "hello")
        text1, lines1 = lib_turn(s, "The fox", tmp_path)
        text2, lines2 = lib_turn(s, "and the dog?", tmp_path)
    assert trace_of(r1) == lines1 and streamed == lines2  # tokens and logits bits, position by position
    assert r1.output_text == text1 and r2.output_text == text2
    assert r1.conversation.id == r2.conversation.id == conv.id and r2.previous_response_id is None

    items = client.conversations.items.list(conv.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [
        ("user", "hello"), ("user", "The fox"), ("assistant", text1), ("user", "and the dog?"), ("assistant", text2)]
    assert items.data[2].id == r1.output[0].id and items.data[4].id == r2.output[0].id
    newest = client.conversations.items.list(conv.id, limit=2)  # OpenAI's default order: newest first
    assert [i.id for i in newest.data] == [items.data[4].id, items.data[3].id] and newest.has_more
    assert client.conversations.items.retrieve(items.data[1].id, conversation_id=conv.id).content[0].text == "The fox"

    same_object(r1, client.responses.retrieve(r1.id))  # derived from the store: the conversation went on since
    same_object(r2, client.responses.retrieve(r2.id))
    assert [i.content[0].text for i in client.responses.input_items.list(r1.id, order="asc").data] == \
        ["hello", "The fox"]
    snapshot = server.http(ALICE).get(f"/v1/sessions/{r1.id}").json()
    assert snapshot["parent"] == conv.id and snapshot["disk_bytes"] == 0  # a fork by reference: no bytes copied
    assert snapshot["n_tokens"] == r1.usage.total_tokens


def test_items_added_to_a_conversation_are_context(client, library, tmp_path):
    store, model = library
    conv = client.conversations.create(extra_body={"seed": 3})
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert [i.role for i in added.data] == ["system", "user"]
    r = ask(client, "Tell me.", conversation=conv.id, instructions="Answer in one word.")
    with store.new("items", model, seed=3, chunk_size=16) as s:
        s.add_message("system", "Be brief.")
        s.add_message("user", "Hi")
        s.add_message("system", "Answer in one word.")
        _, lines = lib_turn(s, "Tell me.", tmp_path)
    assert trace_of(r) == lines
    assert r.instructions == "Answer in one word." and r.usage.input_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError):  # the KV of every later item was computed after it
        client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)


# -- responses -------------------------------------------------------------------------------------
def test_previous_response_id_forks_by_reference(client, library, tmp_path):
    store, model = library
    r1 = ask(client, "The fox", extra_body={"seed": 11})
    r2 = ask(client, "runs on", previous_response_id=r1.id)
    r3 = ask(client, "sleeps", previous_response_id=r1.id)  # from the older one again: a fork, r2 untouched
    r4 = ask(client, "then?", previous_response_id=r2.id)

    with store.new("chain", model, seed=11, chunk_size=16) as s:
        _, lines1 = lib_turn(s, "The fox", tmp_path)
        with s.fork("chain-b") as b:
            _, lines3 = lib_turn(b, "sleeps", tmp_path)
        _, lines2 = lib_turn(s, "runs on", tmp_path)
        _, lines4 = lib_turn(s, "then?", tmp_path)
    assert [trace_of(r) for r in (r1, r2, r3, r4)] == [lines1, lines2, lines3, lines4]

    assert r3.previous_response_id == r1.id and r4.previous_response_id == r2.id and r1.previous_response_id is None
    assert r3.usage.input_tokens_details.cached_tokens == r1.usage.total_tokens - 1  # r1's KV reused (its last
    # token was pending, fed with the new input)
    for r in (r1, r2, r3, r4):
        same_object(r, client.responses.retrieve(r.id))
    assert [i.content[0].text for i in client.responses.input_items.list(r3.id).data] == ["sleeps"]


def test_instructions_sent_again_with_each_turn_are_read_once(client, library, tmp_path):
    """Instructions are not carried over to a response that continues another, so clients send them
    with every turn. The same instructions as the ones in effect stand in the turn (GET shows them)
    but are not read again: the context grows by the new input only (the turn's bits are those of the
    same turn sent without them), and the reply is the library's run with them restated; other
    instructions are read."""
    store, model = library
    r1 = ask(client, "The fox", instructions="Be brief.", extra_body={"seed": 12})
    r2 = ask(client, "runs on", instructions="Be brief.", previous_response_id=r1.id)
    bare = ask(client, "runs on", previous_response_id=r1.id)
    r3 = ask(client, "and then?", instructions="Be long.", previous_response_id=r2.id)
    assert trace_of(r2) == trace_of(bare) and r2.usage.input_tokens == bare.usage.input_tokens
    with store.new("restated", model, seed=12, chunk_size=16) as s:
        s.add_message("system", "Be brief.")
        _, lines1 = lib_turn(s, "The fox", tmp_path)
        s.restate_system("Be brief.")
        _, lines2 = lib_turn(s, "runs on", tmp_path)
        s.add_message("system", "Be long.")
        _, lines3 = lib_turn(s, "and then?", tmp_path)
    assert [trace_of(r) for r in (r1, r2, r3)] == [lines1, lines2, lines3]
    assert (r2.instructions, bare.instructions, r3.instructions) == ("Be brief.", None, "Be long.")
    for r in (r2, bare, r3):
        same_object(r, client.responses.retrieve(r.id))


def test_output_items_sent_back_as_input_are_the_conversation(client):
    """A client that keeps the state itself sends the output items back as they came (with their
    annotations, logprobs, status, phase): they are the assistant's message."""
    first = client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=TOKENS, store=False)
    history = [{"role": "user", "content": "hello"}, *[o.model_dump() for o in first.output],
               {"role": "user", "content": "and then?"}]
    second = client.responses.create(model=MODEL_NAME, input=history, max_output_tokens=TOKENS, store=False)
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > first.usage.input_tokens


def test_a_client_that_resends_the_history_reads_only_what_is_new(client, library, tmp_path):
    """The agent frameworks' default: no stored state named, the whole history each turn. The
    response starts from the longest stored prefix of its prompt (the last response's session) and
    is the cold run of the conversation, bit for bit."""
    store, model = library
    opening = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods"
    first = ask(client, opening, extra_body={"seed": 21})
    history = [{"role": "user", "content": opening}, *[o.model_dump() for o in first.output],
               {"role": "user", "content": "and then?"}]
    second = ask(client, history, extra_body={"seed": 21})
    assert second.usage.input_tokens_details.cached_tokens >= 16  # whole chunks of the first prefill
    messages = [{"role": "user", "content": opening}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then?"}]
    path = tmp_path / "cold.jsonl"
    with single_thread(), store.new("cold-history", model, seed=21, chunk_size=16) as s:
        "".join(s.respond(messages, TOKENS, trace=path, temperature=1.0, top_p=1.0))
    assert trace_of(second) == [json.loads(line) for line in path.read_text().splitlines()]


def test_what_sdks_send_by_default_is_answered(client):
    """Settings an agent framework sends on every request, asking for what this server does anyway
    (plain text, no truncation, no tools), are as if not sent; asking for more is a 400."""
    r = client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=3, store=False,
                                text={"format": {"type": "text"}}, truncation="disabled", tools=[], tool_choice="auto",
                                parallel_tool_calls=False, reasoning={"effort": None, "summary": None})
    assert r.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=3, truncation="auto")
    assert e.value.body["param"] == "truncation"


def test_a_text_format_holds_the_response_to_it_as_the_library_does(client, library, tmp_path, server):
    """The Responses API's `text.format` (OpenAI's json_schema shape: name, schema, strict at its
    level; kvstore's regex): the output is what the format accepts, the library's with the same
    format bit for bit, and the response echoes the format. A bad one is a 400 naming the field."""
    phone = {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"}
    r = client.responses.create(model=MODEL_NAME, input="call me", max_output_tokens=20, store=False,
                                extra_body={"kvstore_trace": True, "seed": 5, "text": {"format": phone}})
    assert re.fullmatch(phone["pattern"], r.output_text) and r.status == "completed"
    assert r.text.format.model_dump(exclude_none=True) == phone
    store, model = library
    path = tmp_path / "phone.jsonl"
    with single_thread(), store.new("phone", model, seed=5) as s:
        "".join(s.chat("call me", 20, trace=path, temperature=1.0, top_p=1.0, response_format=phone))
    assert [json.loads(line) for line in path.read_text().splitlines()] == trace_of(r)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    shaped = client.responses.create(model=MODEL_NAME, input="ok?", max_output_tokens=20, store=False,
                                     text={"format": {"type": "json_schema", "name": "ok", "schema": schema,
                                                      "strict": True}})
    assert json.loads(shaped.output_text) in ({"ok": True}, {"ok": False})
    for bad in ({"type": "json_schema", "name": "x", "schema": {"type": "foo"}}, {"type": "regex"},
                {"type": "text", "schema": {}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=3, text={"format": bad})
        assert e.value.body["param"].startswith("text"), e.value.body


def test_store_false_and_delete(client):
    gone = ask(client, "The fox", store=False, extra_body={"seed": 1})
    assert gone.status in ("completed", "incomplete") and gone.output_text == gone.output[0].content[0].text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    r = ask(client, "The dog", extra_body={"seed": 1})
    child = ask(client, "more", previous_response_id=r.id)
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    for call in (lambda: client.responses.retrieve(r.id), lambda: ask(client, "again", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(child.id).output_text == child.output_text  # its fork keeps the shared KV
    conv = client.conversations.create()
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_unknown_and_other_tenants_ids_are_404(client, server):
    conv = client.conversations.create(items=[{"role": "user", "content": "mine"}])
    r = ask(client, "The fox", conversation=conv.id)
    bob = server.client(api_key=BOB)
    calls = {
        "retrieve response": lambda c, rid, cid: c.responses.retrieve(rid),
        "delete response": lambda c, rid, cid: c.responses.delete(rid),
        "input items": lambda c, rid, cid: c.responses.input_items.list(rid),
        "continue response": lambda c, rid, cid: ask(c, "hi", previous_response_id=rid),
        "retrieve conversation": lambda c, rid, cid: c.conversations.retrieve(cid),
        "delete conversation": lambda c, rid, cid: c.conversations.delete(cid),
        "list items": lambda c, rid, cid: c.conversations.items.list(cid),
        "add items": lambda c, rid, cid: c.conversations.items.create(cid, items=[{"role": "user", "content": "x"}]),
        "respond in conversation": lambda c, rid, cid: ask(c, "hi", conversation=cid),
    }
    for who, c, rid, cid in (("bob", bob, r.id, conv.id), ("unknown", client, "resp_0123", "conv_0123"),
                             ("not ours", client, "conversation", "resp_" + r.id)):
        for name, call in calls.items():
            with pytest.raises(openai.NotFoundError) as e:
                call(c, rid, cid)
            error = e.value.response.json()["error"]
            assert error["type"] == "not_found_error" and set(error) == {"message", "type", "param", "code"}, \
                (who, name)
    assert client.responses.retrieve(r.id).output_text == r.output_text  # Bob's calls changed nothing
    with pytest.raises(openai.BadRequestError):
        ask(client, "hi", conversation=conv.id, previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input="x", tools=[{"type": "web_search"}])


# -- streams ---------------------------------------------------------------------------------------
def sse(response: httpx.Response, limit: int | None = None) -> list[dict]:
    """The events of a stream as {"event", "id", "data"}; stops after `limit` (the connection is closed)."""
    events, current = [], {}
    for line in response.iter_lines():
        if not line:
            if current.get("data"):
                events.append({**current, "data": json.loads(current["data"])})
                if limit is not None and len(events) >= limit:
                    break
            current = {}
            continue
        key, _, value = line.partition(":")
        current[key] = value[1:] if value.startswith(" ") else value
    return events


def test_a_response_not_stored_leaves_nothing_when_its_client_leaves_the_stream(client, server):
    """`store: false`, streamed, the client gone after a few events: its session is deleted, as when
    the stream is delivered (a response not stored is not resumed: OpenAI resumes only the streams
    of stored responses). Before, such a session stayed in the store, under the response's id, for good."""
    body = {"model": MODEL_NAME, "input": "The fox", "store": False, "stream": True, "max_output_tokens": 60}
    with server.http(ALICE) as http:
        with http.stream("POST", "/v1/responses", json=body) as broken:
            cut = sse(broken, limit=6)
        rid = cut[0]["data"]["response"]["id"]
        deadline = time.monotonic() + 20
        while http.get(f"/v1/responses/{rid}").status_code != 404:  # deleted by a task of its own
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)
        assert rid not in {s["name"] for s in http.get("/v1/sessions", params={"limit": 1000}).json()["data"]}


def test_stream_events_ids_and_last_event_id_resume(client, server):
    conv = client.conversations.create(extra_body={"seed": 5})
    body = {"model": MODEL_NAME, "input": "The fox", "conversation": conv.id, "stream": True,
            "max_output_tokens": 60, "kvstore_trace": True}
    http = server.http(ALICE)
    with http.stream("POST", "/v1/responses", json=body) as broken:
        cut = sse(broken, limit=12)  # then the client goes away
    assert [e["event"] for e in cut[:4]] == ["response.created", "response.in_progress",
                                             "response.output_item.added", "response.content_part.added"]
    assert [e["data"]["sequence_number"] for e in cut] == list(range(12))
    rid = cut[0]["data"]["response"]["id"]
    start = cut[4]["data"]["kvstore"]["trace"][0]["position"]
    assert [e["id"] for e in cut[:5]] == [f"{rid}/{start}/{start - 1}"] * 4 + [f"{rid}/{start}/{start}"]

    last = cut[-1]["id"]
    with http.stream("POST", "/v1/responses", json=body, headers={"Last-Event-ID": last}) as resumed:
        rest = sse(resumed)
    kinds = [e["event"] for e in rest]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and set(kinds[:-4]) == {
        "response.output_text.delta"}
    numbers = [e["data"]["sequence_number"] for e in cut + rest]
    assert numbers == list(range(len(numbers)))  # they go on where the broken stream stopped
    deltas = [e for e in cut + rest if e["event"] == "response.output_text.delta"]
    positions = [line["position"] for e in deltas for line in e["data"].get("kvstore", {}).get("trace", [])]
    done = rest[-1]["data"]["response"]
    assert positions == list(range(start, start + done["usage"]["output_tokens"]))
    text = "".join(e["data"]["delta"] for e in deltas)
    assert rest[-4]["data"]["text"] == text == done["output"][0]["content"][0]["text"] and done["id"] == rid
    assert all(e["id"] == f"{rid}/{start}/end" for e in rest[-4:])

    # the same request without the break, on a twin conversation: the same tokens and bits
    twin = client.conversations.create(extra_body={"seed": 5})
    whole = client.responses.create(model=MODEL_NAME, input="The fox", conversation=twin.id, max_output_tokens=60,
                                    extra_body={"kvstore_trace": True})
    computed = {line["position"]: line for e in deltas for line in e["data"].get("kvstore", {}).get("trace", [])}
    assert whole.output_text == text
    assert [line["token"] for line in trace_of(whole)] == [computed[p]["token"] for p in sorted(computed)]
    assert all(computed[line["position"]]["logits_sha256"] in (None, line["logits_sha256"])
               for line in trace_of(whole))  # replayed tokens carry no hash: they were not computed again
    assert client.responses.retrieve(rid).output_text == text  # the snapshot was made when it finished

    with client.responses.create(model=MODEL_NAME, input="again", previous_response_id=rid, max_output_tokens=4,
                                 stream=True) as stream:
        kinds = [e.type for e in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] in ("response.completed", "response.incomplete")


def test_a_late_last_event_id_replays_the_response_after_the_conversation_went_on(client, server):
    conv = client.conversations.create(extra_body={"seed": 21})
    body = {"model": MODEL_NAME, "input": "The fox", "conversation": conv.id, "stream": True, "max_output_tokens": 12}
    http = server.http(ALICE)
    with http.stream("POST", "/v1/responses", json=body) as first:
        whole = sse(first)  # all of it; say the client lost the end
    ask(client, "and then?", conversation=conv.id)  # the conversation goes on
    with http.stream("POST", "/v1/responses", json=body, headers={"Last-Event-ID": whole[6]["id"]}) as resumed:
        rest = sse(resumed)  # from the response's own session: the conversation holds more now
    assert [(e["event"], e["id"], e["data"]["sequence_number"]) for e in rest] == \
        [(e["event"], e["id"], e["data"]["sequence_number"]) for e in whole[7:]]
    assert [e["data"].get("delta") for e in rest] == [e["data"].get("delta") for e in whole[7:]]
    assert rest[-1]["data"]["response"]["output"] == whole[-1]["data"]["response"]["output"]

def test_a_response_survives_its_engines_death(client, server):
    conv = client.conversations.create(extra_body={"seed": 9})
    body = {"model": MODEL_NAME, "input": "The fox", "conversation": conv.id, "stream": True,
            "max_output_tokens": 100, "kvstore_trace": True}
    with server.http(ALICE).stream("POST", "/v1/responses", json=body) as stream:
        lines = stream.iter_lines()
        head = []
        while len([line for line in head if line.startswith("data:")]) < 6:
            head.append(next(lines))
        server.kill_engine()  # the pool restarts it and resubmits the job from the conversation's checkpoint
        raw = "\n".join(head + list(lines))
    events = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # nothing twice, nothing lost
    done = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    twin = client.conversations.create(extra_body={"seed": 9})
    whole = client.responses.create(model=MODEL_NAME, input="The fox", conversation=twin.id, max_output_tokens=100)
    assert text == whole.output_text == done["output"][0]["content"][0]["text"]
    assert client.responses.retrieve(done["id"]).output_text == text
    assert "engine 0 died" in server.log()


def test_kill_9_of_the_server_then_last_event_id(client, server):
    """It restarts the server (same home, same port): last in the module, with the one below."""
    conv = client.conversations.create(extra_body={"seed": 13})
    body = {"model": MODEL_NAME, "input": "The fox", "conversation": conv.id, "stream": True,
            "max_output_tokens": 100}
    with server.http(ALICE).stream("POST", "/v1/responses", json=body) as stream:
        cut = sse(stream, limit=8)
        server.kill()  # the API process; its engines checkpoint and leave
    server.start()
    with server.http(ALICE).stream("POST", "/v1/responses", json=body,
                                   headers={"Last-Event-ID": cut[-1]["id"]}) as resumed:
        rest = sse(resumed)
    events = cut + rest
    assert [e["data"]["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["data"]["delta"] for e in events if e["event"] == "response.output_text.delta")
    twin = client.conversations.create(extra_body={"seed": 13})
    whole = client.responses.create(model=MODEL_NAME, input="The fox", conversation=twin.id, max_output_tokens=100)
    assert text == whole.output_text
    rid = cut[0]["data"]["response"]["id"]
    assert client.responses.retrieve(rid).output_text == text  # acknowledged: the snapshot is in the store
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant"] and items[1].content[0].text == text


def test_a_response_cut_and_sent_again_without_last_event_id_is_that_reply_not_a_second_turn(client, server):
    """A client that lost its response (the server killed mid-stream) and sends the same request
    again, without Last-Event-ID, gets the reply it would have had, finished from the conversation's
    checkpoint: the input is not appended a second time. (It restarts the server, as the one above.)"""
    conv = client.conversations.create(extra_body={"seed": 31})
    body = {"model": MODEL_NAME, "input": "The fox", "conversation": conv.id, "stream": True,
            "max_output_tokens": 100}
    with server.http(ALICE).stream("POST", "/v1/responses", json=body) as stream:
        sse(stream, limit=8)
        server.kill()
    server.start()
    again = client.responses.create(model=MODEL_NAME, input="The fox", conversation=conv.id, max_output_tokens=100)
    twin = client.conversations.create(extra_body={"seed": 31})
    whole = client.responses.create(model=MODEL_NAME, input="The fox", conversation=twin.id, max_output_tokens=100)
    assert again.output_text == whole.output_text
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant"] and items[1].content[0].text == whole.output_text
    assert client.responses.retrieve(again.id).output_text == whole.output_text  # its snapshot
    after = ask(client, "and then?", conversation=conv.id)  # other input: the next turn
    assert after.output_text and len(client.conversations.items.list(conv.id).data) == 4
