"""The completions API's `echo` (`serve/routes/completions.py`): the reply begins with the prompt;
with `logprobs`, every prompt token has its entry, as evaluation harnesses ask for them
(lm-evaluation-harness' loglikelihood: `max_tokens: 0, echo: true, logprobs: 1`).

What it proves: the text is the prompt then the reply, whole and streamed (the prompt in a first
chunk of its own); the prompt's entries are the library's `Session.append_scored` for the same text
exactly (`==` on the floats), the first null, then the reply's own; a named session scores what the
request appends to it from its last state; a request of its own scores its whole prompt even where a
stored prefix could have been reused (no logits are stored); n choices each carry the same entries.
"""

from __future__ import annotations

import kvstore
from conftest import single_thread
from serve_kit import MODEL_NAME
from test_serve_chat import CHUNK, model_folder, server  # noqa: F401 (fixtures)

PROMPT = "The quick brown fox jumps over the lazy dog"
TOP = 2


def library_entries(folder: str, home, *texts: str) -> list[list[dict | None]]:
    """`append_scored` of each text in turn on one new session: its entries per text."""
    model = kvstore.load_model(folder)
    store = kvstore.open_store(home)
    with single_thread(), store.new("lib", model, chunk_size=CHUNK) as s:
        out = [s.append_scored(text, top=TOP) for text in texts]
    store.close()
    return out


def as_legacy(entries: list[dict | None]) -> list[float | None]:
    return [None if e is None else e["logprob"] for e in entries]


def test_echo_begins_the_reply_with_the_prompt_whole_and_streamed(server):
    client = server.client()
    ask = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    whole = client.completions.create(**ask).choices[0]
    plain = client.completions.create(**{**ask, "echo": False}).choices[0]
    assert whole.text == PROMPT + plain.text and whole.logprobs is None
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    assert chunks[0].text == PROMPT and "".join(c.text for c in chunks) == whole.text


def test_echoed_logprobs_are_the_librarys_scores_then_the_replys(server, model_folder, tmp_path):
    client = server.client()
    scored = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=TOP).choices[0]
    (expected,) = library_entries(model_folder, tmp_path / "lib", PROMPT)
    lp = scored.logprobs
    assert scored.text == PROMPT and lp.token_logprobs == as_legacy(expected)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for entry, top, token in zip(expected[1:], lp.top_logprobs[1:], lp.tokens[1:]):
        assert top[token] == entry["logprob"] and len(top) <= TOP + 1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    # with a reply: the prompt's entries, then the reply's own (as without echo)
    ask = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=TOP)
    both = client.completions.create(**ask, echo=True).choices[0].logprobs
    reply = client.completions.create(**ask).choices[0].logprobs
    assert both.token_logprobs == lp.token_logprobs + reply.token_logprobs and both.tokens == lp.tokens + reply.tokens
    streamed = [c.choices[0].logprobs for c in client.completions.create(**ask, echo=True, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [x for s in streamed for x in s.token_logprobs] == both.token_logprobs
    assert [x for s in streamed for x in s.text_offset] == both.text_offset


def test_a_prompt_seen_before_is_scored_whole_and_n_choices_alike(server):
    """The prefix cache holds that prompt's KV from the test before, but no logits: it is computed again."""
    client = server.client()
    ask = dict(model=MODEL_NAME, prompt=PROMPT + " again", max_tokens=0, echo=True, logprobs=1)
    first = client.completions.create(**ask)
    again = client.completions.create(**ask)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].logprobs.token_logprobs == again.choices[0].logprobs.token_logprobs
    two = client.completions.create(**{**ask, "max_tokens": 2, "n": 2, "seed": 1, "temperature": 1.0})
    prompt_len = len(first.choices[0].logprobs.tokens)
    assert [c.logprobs.token_logprobs[:prompt_len] for c in two.choices] == \
        [first.choices[0].logprobs.token_logprobs] * 2


def test_a_named_session_scores_what_the_request_appends(server, model_folder, tmp_path):
    http = server.http()
    base = {"model": MODEL_NAME, "max_tokens": 0, "session": "echo-doc"}
    assert http.post("/v1/completions", json={**base, "prompt": PROMPT}).status_code == 200
    r = http.post("/v1/completions", json={**base, "prompt": " and runs away", "echo": True, "logprobs": TOP})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    _, expected = library_entries(model_folder, tmp_path / "lib", PROMPT, " and runs away")
    assert choice["text"] == " and runs away" and expected[0] is not None  # the session's last state predicts it
    assert choice["logprobs"]["token_logprobs"] == as_legacy(expected)


def test_a_batch_of_prompts_is_scored_as_one_by_one(server):
    """lm-evaluation-harness with a batch size: several prompts in one request, each choice's entries
    those of the prompt's request alone."""
    client = server.client()
    prompts = [PROMPT, "A second text to score", PROMPT + " twice"]
    ask = dict(model=MODEL_NAME, max_tokens=0, echo=True, logprobs=1)
    batched = client.completions.create(prompt=prompts, **ask)
    for choice, prompt in zip(batched.choices, prompts):
        alone = client.completions.create(prompt=prompt, **ask).choices[0]
        assert choice.text == prompt and choice.logprobs.token_logprobs == alone.logprobs.token_logprobs
        assert choice.logprobs.tokens == alone.logprobs.tokens
