"""A call's response format (`engine/grammar.py`): the reply is text the format accepts, whole, and
ends there; an interrupted reply resumes under its format to exactly the uninterrupted one; a bad
format is refused before anything changes; the call holds the format, not the session.

The tiny Llama's weights are random, so what it writes is noise: a format bounded in length (a
regular expression, a schema of an enum in compact JSON) shows the mask at work in every token."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

import kvstore
from kvstore.engine import grammar
from kvstore.errors import CorruptData, InvalidArgument, KvstoreError
from kvstore.store import archive
from kvstore_cli.main import cli

PHONE = {"type": "regex", "pattern": r"[0-9]{3}-[0-9]{4}"}
WORDS = {"type": "regex", "pattern": r"[a-z]{2,6}( [a-z]{2,6}){5,9}"}  # a long reply: many tokens, bounded
ANSWER = {"type": "json_schema", "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}  # compact: no whitespace runs
WARM = dict(temperature=0.9, seed=3)


def test_a_reply_held_to_a_regex_matches_it_whole_and_ends_there(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model, **WARM) as s:
        text = "".join(s.chat("hello", 40, response_format=PHONE))
        assert re.fullmatch(PHONE["pattern"], text), text
        assert s.tokens[-1] in model.tokenizer.eos_ids  # it ended as a reply ends, with the end of sequence
        assert s.messages[-1]["text"] == text and s.active_call is None
    store.close()


def test_a_json_schema_reply_is_json_the_schema_accepts(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model, **WARM) as s:
        for turn in ("yes or no?", "again", "and once more"):
            text = "".join(s.chat(turn, 40, response_format=ANSWER))
            assert json.loads(text)["answer"] in ("yes", "no", "maybe") and set(json.loads(text)) == {"answer"}, text
    store.close()


def test_the_mask_leaves_the_models_logits_alone_and_only_allowed_tokens_are_drawn(tmp_path, model):
    """The trace hashes the logits as the model computed them: a formatted reply's first token has the
    free reply's logits (same prompt, same position), and its token is one the format allows."""
    store = kvstore.open_store(tmp_path / "home")
    traces = {}
    for name, fmt in (("free", None), ("phone", PHONE)):
        with store.new(name, model, **WARM) as s:
            "".join(s.chat("hello", 8, trace=str(tmp_path / f"{name}.jsonl"), response_format=fmt))
        traces[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert traces["free"][0]["logits_sha256"] == traces["phone"][0]["logits_sha256"]
    assert traces["free"][0]["position"] == traces["phone"][0]["position"]
    allowed = grammar.Constraint(model.tokenizer, model.config.vocab_size, grammar.canonical(PHONE)).allowed()
    assert allowed[traces["phone"][0]["token"]] and not allowed.all()
    store.close()


@pytest.mark.parametrize("fmt", [WORDS, ANSWER], ids=["regex", "json_schema"])
def test_a_reply_cut_and_resumed_under_its_format_is_the_uninterrupted_one(tmp_path, model, fmt):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("whole", model, **WARM) as s:
        whole = "".join(s.chat("go on", 60, trace=str(tmp_path / "whole.jsonl"), response_format=fmt))
        whole_ids = s.tokens[s.messages[-1]["token_start"]:]
    with store.new("cut", model, **WARM) as s:
        pieces = s.chat("go on", 60, trace=str(tmp_path / "cut.jsonl"), response_format=fmt)
        for _ in range(3):
            next(pieces)
        pieces.close()  # interrupted: the call stays open, checkpointed with its format
    with store.open("cut", model) as s:
        assert s.active_call["format"] == grammar.canonical(fmt)
        "".join(s.resume(trace=str(tmp_path / "cut.jsonl")))
        assert s.messages[-1]["text"] == whole
        assert s.tokens[s.messages[-1]["token_start"]:] == whole_ids
    assert (tmp_path / "cut.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()  # tokens and logits bits
    store.close()


def test_the_next_call_is_free_text_unless_it_gives_a_format_too(tmp_path, model):
    """A format belongs to its call: greedy, the same session state, a call without one writes what
    the free model writes (here: a reply the regex would not allow), and a raw generation takes one too."""
    store = kvstore.open_store(tmp_path / "home")
    with store.new("a", model) as a, store.new("b", model) as b:
        "".join(a.chat("hello", 12, response_format=PHONE))
        "".join(b.chat("hello", 12, response_format=PHONE))
        free = "".join(a.chat("more", 12))
        assert not re.fullmatch(PHONE["pattern"], free)
        ids = list(b.generate(12, response_format=PHONE))
        assert re.fullmatch(PHONE["pattern"], model.tokenizer.decode(ids, skip_special=True))
    store.close()


@pytest.mark.parametrize("bad, why", [
    ({"type": "json"}, "unknown type 'json'"),
    ({"type": "json_schema", "schema": {"type": "foo"}}, "Invalid type: foo"),
    ({"type": "json_schema"}, "takes schema"),
    ({"type": "regex", "pattern": "a("}, "unclosed group"),
    ({"type": "regex", "pattern": "a", "flags": "i"}, "takes pattern"),
    ("not json", "not JSON text"),
    (["json_object"], "an object with a \"type\""),
])
def test_a_bad_format_is_refused_before_the_session_changes(tmp_path, model, bad, why):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model) as s:
        "".join(s.chat("hello", 4))
        before = (list(s.tokens), [dict(m) for m in s.messages])
        with pytest.raises(InvalidArgument, match=re.escape(why)):
            "".join(s.chat("again", 4, response_format=bad))
        with pytest.raises(InvalidArgument, match=re.escape(why)):
            list(s.generate(4, response_format=bad))
        assert (s.tokens, s.messages) == before and s.active_call is None
    store.close()


def test_text_and_none_ask_for_free_text_and_formats_are_canonical():
    assert grammar.canonical(None) == grammar.canonical({"type": "text"}) == grammar.canonical("") == ""
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"z": {"type": "string"}}}}
    assert grammar.canonical(fmt) == grammar.canonical(json.dumps(fmt, indent=2)) == json.dumps(fmt, separators=(",", ":"))
    assert kvstore.check_response_format(PHONE) == grammar.canonical(PHONE)


def test_a_schemas_properties_are_written_in_its_order(tmp_path, model):
    """Keys in the schema's order, not sorted (a model asked for a name, then its arguments, writes them so)."""
    order = {"type": "json_schema", "schema": {
        "type": "object", "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}}, "required": ["zeta", "alpha"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model, **WARM) as s:
        assert "".join(s.chat("hello", 20, response_format=order)) == '{"zeta":1,"alpha":2}'
    store.close()


def test_an_archive_keeps_a_call_in_progress_with_its_format_and_refuses_a_forged_one(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("whole", model, **WARM) as s:
        whole = "".join(s.chat("go on", 60, response_format=WORDS))
    with store.new("cut", model, **WARM) as s:
        pieces = s.chat("go on", 60, response_format=WORDS)
        next(pieces)
        pieces.close()
    store.export("cut", tmp_path / "cut.kvs")
    other = kvstore.open_store(tmp_path / "other")
    other.import_(tmp_path / "cut.kvs")
    with other.open("cut", model) as s:
        assert "".join(s.resume()) and s.messages[-1]["text"] == whole
    other.close()
    store.close()

    def need(ok, what):
        if not ok:
            raise CorruptData(what)

    def is_int(x, lo=0, hi=1 << 62):
        return isinstance(x, int) and lo <= x <= hi

    call = {"kind": "raw", "start": 3, "max_new_tokens": 8, "stop": []}
    archive._validate_call({**call, "format": grammar.canonical(WORDS)}, 5, [], need, is_int)
    for forged in ('{"type":"regex","pattern":"a("}', '{"type": "json_object"}', "", 7):  # bad, not canonical, none
        with pytest.raises(CorruptData, match="response_format"):
            archive._validate_call({**call, "format": forged}, 5, [], need, is_int)


def test_the_cli_holds_a_reply_to_a_regex_or_a_schema_file_and_refuses_two_formats(tmp_path, model_path):
    runner, home = CliRunner(), str(tmp_path / "home")
    out = runner.invoke(cli, ["--home", home, "new", "s", "-m", model_path, "-p", "hi", "--temperature", "0.9",
                              "--regex", PHONE["pattern"]], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert re.fullmatch(PHONE["pattern"], out.stdout.strip()), out.stdout
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(ANSWER["schema"]))
    out = runner.invoke(cli, ["--home", home, "continue", "s", "-p", "and?", "--json-schema", str(schema)],
                        catch_exceptions=False)
    assert out.exit_code == 0 and json.loads(out.stdout)["answer"] in ("yes", "no", "maybe"), out.output
    two = runner.invoke(cli, ["--home", home, "continue", "s", "-p", "x", "--json", "--regex", "a"])
    assert two.exit_code == 2 and "give one of --json and --regex" in two.output
    bad = runner.invoke(cli, ["--home", home, "new", "t", "-m", model_path, "-p", "x", "--regex", "a("])
    assert bad.exit_code != 0 and "unclosed group" in bad.output
    assert "t" not in kvstore.open_store(home).names()  # refused before the session was made


def test_a_reply_that_does_not_fit_its_recorded_format_cannot_be_resumed_under_it(tmp_path, model):
    """A call record whose reply so far breaks its format (written by hand here) is refused on
    resume, saying so, rather than resumed into text the format does not accept."""
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model, **WARM) as s:
        pieces = s.chat("hello", 40)  # free text, which the phone regex does not accept
        next(pieces)
        next(pieces)
        pieces.close()
        s.active_call["format"] = grammar.canonical(PHONE)
        with pytest.raises(KvstoreError, match="does not fit the call's response_format"):
            "".join(s.resume())
    store.close()


@pytest.mark.realmodel
def test_the_real_model_answers_in_json_its_schema_accepts(tmp_path, smollm2_path):
    """SmolLM2, greedy: asked for a person, held to a schema, it writes JSON with exactly the schema's
    keys and types, and stops when the object closes."""
    model = kvstore.load_model(smollm2_path)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    store = kvstore.open_store(tmp_path / "home")
    with store.new("person", model) as s:
        text = "".join(s.chat("Describe a person as JSON.", 80, response_format={"type": "json_schema", "schema": schema}))
        person = json.loads(text)
        assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
        assert s.tokens[-1] in model.tokenizer.eos_ids
    store.close()
