"""Text <-> ids from GGUF metadata and from tokenizer.json, and chat templates in a sandbox.

The tiny byte-level BPE vocabulary is written both ways (GGUF tokens/merges/types, and the
`tokenizers` JSON); both readers must give transformers' ids. SmolLM2's own template must render
exactly what transformers renders; a hostile template must fail, not run.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

import kvstore
from engine_models import BOS, CHATML, EOS, SAMPLE_TEXT, SPECIAL_TOKENS, Q
from kvstore.errors import ModelError
from kvstore.engine.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    SAMPLE_TEXT,
    "",
    " ",
    "plain words never seen: quizzical zephyr xylophone",
    "  leading and   inner   spaces  \n\n\n\ttabs\r\nCRLF",
    "digits 3.14159 2026-11-30 1,000,000",
    "emoji 🙂👍🏽🇩🇪 and CJK 東京都 and Ελληνικά and עברית",
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|><|endoftext|>",
    "almost special: <|im_start and im_end|> <|unknown|>",
]


@pytest.fixture(scope="module")
def toks(tiny):
    """(ours from GGUF, ours from tokenizer.json, transformers' fast tokenizer) for the tiny vocabulary."""
    m = tiny("llama-gqa")
    from_gguf = kvstore.load_model(m.gguf(Q.Q8_0)[0]).tokenizer
    from_json = kvstore.load_model(m.folder).tokenizer
    hf = PreTrainedTokenizerFast(tokenizer_file=str(m.folder / "tokenizer.json"))
    return from_gguf, from_json, hf


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_and_tokenizer_json_give_transformers_ids(toks, text):
    from_gguf, from_json, hf = toks
    expected = hf.encode(text, add_special_tokens=False)
    assert from_gguf.encode(text) == expected
    assert from_json.encode(text) == expected


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_gguf_pre_tokenizer_splits_text_like_transformers(tiny, tmp_path, pre):
    """`tokenizer.ggml.pre` picks the split pattern (digits in 1-3 or singles, contractions, spaces)."""
    from transformers import AutoTokenizer

    plan = tiny("llama-gqa").plan()
    plan.metadata = [(k, (pre,)) if k == "add_tokenizer_pre" else (k, a) for k, a in plan.metadata]
    path = plan.write(tmp_path / f"{pre}.gguf")
    text = "digits 1234567 and 12 3; it's THEY'LL don't \n\n  x\t🙂 東京 " + SAMPLE_TEXT
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert kvstore.load_model(path).tokenizer.encode(text) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(toks, text):
    for tok in toks[:2]:
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_and_known_as_bos_and_eos(toks, tiny_tokenizer):
    vocab = tiny_tokenizer.get_vocab()
    for tok in toks[:2]:
        assert [tok.encode(t) for t in SPECIAL_TOKENS] == [[vocab[t]] for t in SPECIAL_TOKENS]
        assert tok.bos_id == vocab[BOS]
        assert vocab[EOS] in tok.eos_ids
        assert tok.decode([vocab["<|im_end|>"]], skip_special=True) == ""


def test_bos_is_added_only_when_the_model_asks_for_it(tiny, tmp_path):
    m = tiny("llama-gqa")
    plan = m.plan()
    plan.metadata = [(k, (True,)) if k == "add_add_bos_token" else (k, a) for k, a in plan.metadata]
    with_bos = kvstore.load_model(plan.write(tmp_path / "bos.gguf")).tokenizer
    without = kvstore.load_model(m.gguf()[0]).tokenizer
    assert with_bos.encode("hi") == [with_bos.bos_id] + without.encode("hi")
    assert with_bos.encode("hi", add_bos=False) == without.encode("hi")
    assert without.encode("hi", add_bos=True) == with_bos.encode("hi")
    # raw text appended to a sequence (a session's append_text, begin, a completion's prompt): BOS at the start only
    assert with_bos.encode_at("hi", 0) == with_bos.encode("hi") and with_bos.encode_at("hi", 5) == without.encode("hi")
    assert without.encode_at("hi", 0) == without.encode("hi")


def test_stream_decoder_never_splits_a_character(toks):
    tok = toks[0]
    text = "naïve 🙂👍🏽 東京 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_the_text_exactly(toks, text):
    """What the logprobs entries name a token with: its bytes, a part of a character where it holds
    one (byte-level BPE), so that the tokens' bytes together are the text's UTF-8."""
    for tok in toks[:2]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert any(len(toks[0].token_bytes(i)) == 1 and toks[0].token_bytes(i)[0] >= 0x80
               for i in toks[0].encode(TEXTS[6]))  # single bytes of multi-byte characters among them


# -- chat templates -----------------------------------------------------------------------------------------
def test_chat_template_from_gguf_and_folder_render_chatml(toks):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for tok in toks[:2]:
        assert tok.chat_template == CHATML
        assert tok.render_chat(messages) == expected
        assert tok.render_chat(messages, add_generation_prompt=False) == expected.removesuffix(
            "<|im_start|>assistant\n")
        assert tok.apply_chat_template(messages) == tok.encode(expected)


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=False, chat_template=template)


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}",
    "{% for m in messages %}{{ m.update({'content': 'x'}) }}{% endfor %}",
])
def test_unsafe_chat_templates_raise_instead_of_running(toks, template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ModelError, match="chat template"):
        with_template(toks[0], template).render_chat(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_errors_are_model_errors_with_the_templates_message(toks):
    tok = with_template(toks[0], "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ModelError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelError, match="chat template"):
        with_template(toks[0], "{% for %}").render_chat([])
    with pytest.raises(ModelError, match="no chat template"):
        with_template(toks[0], None).render_chat([])


def test_templates_get_the_helpers_hf_templates_use(toks):
    tok = with_template(toks[0], "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}")
    tok.special = {"bos_token": "<s>"}
    assert tok.render_chat([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}|4|<s>'


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in haiku."}, {"role": "user", "content": "Describe rain."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write `print(42)` in 🐍 Python\n\twith tabs."}],
]


@pytest.mark.realmodel
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_smollm2_chat_template_equals_transformers(smollm2, hf_smollm2_tokenizer, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    hf = hf_smollm2_tokenizer
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ours = smollm2.tokenizer
    assert ours.render_chat(messages, add_generation_prompt=generation_prompt) == text
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == list(ids)
