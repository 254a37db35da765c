"""A system message restated (`Session.restate_system`): a client that sends its instructions with every
turn (OpenAI's Responses API asks that of clients that continue a response) leaves them once in the
context. The restated message stands in the session's history with its turn and holds no tokens: the
turns after it have the tokens and logits bits (equal trace lines) of a session where it was never
sent, after a close and reopen and in a fork; only the system message in effect can be restated.
"""

from __future__ import annotations

import pytest

import kvstore
from kvstore.errors import InvalidArgument


def test_a_restated_system_message_adds_no_token_and_changes_no_bit(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")

    def conversation(name: str, restate: bool) -> tuple[list[int], str, list[dict]]:
        with store.new(name, model, seed=3, chunk_size=16) as s:
            s.add_message("system", "Be brief.")
            "".join(s.chat("Hello", max_new_tokens=6))
            if restate:
                assert s.system_in_effect == "Be brief."
                s.restate_system("Be brief.")
        with store.open(name, model) as s:  # reopened: the history the chat template gets comes from the index
            trace = tmp_path / f"{name}.jsonl"
            "".join(s.chat("And then?", max_new_tokens=6, trace=trace))
            return list(s.tokens), trace.read_text(), list(s.messages)

    tokens, trace, messages = conversation("restated", True)
    plain_tokens, plain_trace, plain_messages = conversation("plain", False)
    assert tokens == plain_tokens and trace == plain_trace  # the same context, bit for bit
    at = messages[3]["token_start"]
    assert messages[3] == {"ordinal": 3, "role": "system", "text": "Be brief.", "token_start": at, "token_end": at}
    assert at == plain_messages[3]["token_start"] > 0  # where the next turn's tokens begin
    strip = lambda ms: [(m["role"], m["text"], m["token_start"], m["token_end"]) for m in ms]  # noqa: E731
    assert strip(messages[:3] + messages[4:]) == strip(plain_messages)
    shown = store.history("restated")
    assert [kvstore.restated(e) for e in shown] == [False, False, False, True, False, False]
    assert shown[3]["text"] == "Be brief."

    for name in ("restated", "plain"):  # a fork reads the history as its parent does
        store.fork(name, f"{name}-fork")
        with store.open(f"{name}-fork", model) as s:
            "".join(s.chat("Once more", max_new_tokens=4))
    assert store.tokens("restated-fork") == store.tokens("plain-fork")
    store.close()


def test_only_the_system_message_in_effect_can_be_restated(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model, seed=3, system="Be brief.") as s:
        with pytest.raises(InvalidArgument, match="only the system message in effect"):
            s.restate_system("Be brief.")  # nothing read yet: the message made with the session is still to come
        "".join(s.chat("Hello", max_new_tokens=3))
        s.add_message("system", "Be long.")
        with pytest.raises(InvalidArgument, match="add it with add_message"):
            s.restate_system("Be brief.")  # no longer in effect
        before = (list(s.tokens), len(s.messages))
        s.restate_system("Be long.")
        assert list(s.tokens) == before[0] and len(s.messages) == before[1] + 1
    store.close()
