"""The real SmolLM2-135M-Instruct GGUF against transformers' reading of the same file.

Token ids equal transformers' GGUF tokenizer on varied text; float32 logits on a 200-token prompt
are close to transformers' (its dequantized float32 model); 32 greedy tokens are identical to its
greedy `generate`. The model is pulled once per session (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from kvstore import SamplerSettings, Sequence

pytestmark = [pytest.mark.realmodel, pytest.mark.usefixtures("one_thread")]

CODE = '''\
import json, sys
from dataclasses import dataclass

@dataclass(frozen=True)
class Point:
    x: float = 0.0
    y: float = -1.5e-3

    def norm(self) -> float:
        return (self.x ** 2 + self.y ** 2) ** 0.5  # Euclid

if __name__ == "__main__":
    data = {"points": [Point(3, 4).__dict__], "ok": True, "n": None}
    json.dump(data, sys.stdout, indent=2)
    for i in range(10):\tprint(f"{i:>4}|{i * i:08d}", end="\\r\\n")
'''
MARKUP = '''\
<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Test &amp; demo</title></head>
<body><p class='intro'>Hello,&nbsp;<b>world</b>!</p><!-- comment --></body></html>
$ grep -rn "TODO" src/ | sort -u > todo.txt && wc -l todo.txt   # shell
SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name HAVING n > 2;
{"key": [1, 2.5, -3e10, true, null], "nested": {"a": "b\\"c"}}
'''
PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, presses "
    "operated in more than two hundred European cities, and the price of books fell sharply. Literacy spread; "
    "pamphlets, newspapers and scientific journals followed. Isn't it remarkable? It's often said they'd "
    "never have guessed what we'll do with it -- or that we've still not finished.\n\n"
    "Der schnelle braune Fuchs springt über den faulen Hund. Ça va très bien, merci ! Ñandú, año, pingüino.\n"
)
UNICODE = (
    "日本語のテキスト、東京都。中文：我们今天去公园散步。한국어 문장입니다. Русский текст: съешь же ещё этих булок. "
    "العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีครับ. Ελληνικά: Γειά σου Κόσμε.\n"
    "Combining: e\u0301 a\u0308 n\u0303; zero-width: a\u200bb\u200dc; NBSP:\u00a0|; math: ∀x∈ℝ, x²≥0 ⇒ √(x²)=|x| ≈ 3.14…\n"
    "Emoji: 🙂😂🤖👍🏽👨‍👩‍👧‍👦🇩🇪🇯🇵❤️‍🔥 🏳️‍🌈 ✔️ ★☆ ©®™\n"
)
DIGITS = (
    "0 1 12 123 1234 12345 123456 1234567890 3.14159265358979 -0.0001 1e-9 6.022e23 0x1F 0b1011 "
    "+1 (555) 010-9999, 2026-11-30T10:16:00Z, 99.5%, $1,234,567.89, 1/3, v2.13.0, IPv4 192.168.0.1\n"
)
WHITESPACE = "a  b   c    d\t\te\t \tf\n\n\ng\r\nh \n \n  i" + " " * 17 + "j\t" * 5 + "\n" * 6 + "   trailing   "
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nSummarise: <b>tokens</b> & <|im_end|>-like text<|im_end|>\n<|im_start|>assistant\n"
    "Sure!<|im_end|><|endoftext|><|im_start|><|im_end|>"
)
MARKDOWN = """\
# Release notes — v0.2

* **Faster** decode: ~2× on CPU (bf16, AMX); _prefill_ unchanged.
* Fixed `KVCache.trim(n)` when `n == length`; see [#42](https://example.org/issues/42).

| model | tok/s | notes |
|-------|------:|-------|
| 135M  | 61.5  | Q4_1  |

```rust
fn main() { let v: Vec<u32> = (1..=5).map(|x| x * x).collect(); println!("{:?}", v); }
```
```js
const sum = (xs) => xs.reduce((a, b) => a + b, 0); console.log(`sum=${sum([1, 2, 3])}`);
```
> Quote with trailing spaces\x20\x20\x20
> and an em dash — plus ellipsis…
"""
PIECES = {"code": CODE, "markdown": MARKDOWN, "markup": MARKUP, "prose": PROSE, "unicode": UNICODE, "digits": DIGITS,
          "whitespace": WHITESPACE, "chat": CHAT}
ALL_TEXT = "\n".join(PIECES.values())


@pytest.mark.parametrize("piece", list(PIECES))
def test_token_ids_equal_transformers_gguf_tokenizer(smollm2, hf_smollm2_tokenizer, piece):
    text = PIECES[piece]
    assert smollm2.tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)


def test_token_ids_of_the_whole_text_equal_transformers_and_decode_back(smollm2, hf_smollm2_tokenizer):
    assert len(ALL_TEXT) > 2500
    ids = smollm2.tokenizer.encode(ALL_TEXT)
    assert ids == hf_smollm2_tokenizer.encode(ALL_TEXT)  # with HF's own special-token policy: no BOS
    assert smollm2.tokenizer.decode(ids) == ALL_TEXT
    assert smollm2.tokenizer.decode(ids, skip_special=True) == hf_smollm2_tokenizer.decode(
        ids, skip_special_tokens=True)


def test_config_matches_the_published_shape(smollm2):
    c = smollm2.config
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_size) == ("llama", 30, 9, 3, 64, 576)
    assert (c.intermediate_size, c.vocab_size, c.max_context, c.rope_theta) == (1536, 49152, 8192, 100000.0)
    assert c.tie_embeddings and smollm2.tokenizer.eos_ids == {2}


def prompt_ids(tokenizer, n=200):
    ids = tokenizer.encode(PROSE + CODE + PROSE)
    assert len(ids) >= n
    return ids[:n]


def test_float32_logits_are_close_to_transformers(smollm2, hf_smollm2):
    ids = prompt_ids(smollm2.tokenizer)
    with torch.no_grad():
        expected = hf_smollm2(torch.tensor([ids])).logits[0].float()
    got = smollm2.logits(ids)
    assert got.shape == (200, 49152)
    assert_close(got, expected, atol=1e-3, rtol=1e-4)


def test_32_greedy_tokens_equal_transformers_generate(smollm2, hf_smollm2):
    messages = [{"role": "user", "content": "Explain in detail how a hash table works, with an example in Python."}]
    ids = smollm2.tokenizer.apply_chat_template(messages)
    seq = Sequence(smollm2)
    list(seq.extend(ids))
    ours = [e.token for e in seq.generate(SamplerSettings(), seed=0, max_new_tokens=32,
                                         stop_ids=smollm2.tokenizer.eos_ids)]
    with torch.no_grad():
        out = hf_smollm2.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=32)
    assert len(ours) == 32
    assert ours == out[0, len(ids):].tolist()


@pytest.mark.parametrize("weights", ["dense", "stored"])
def test_bfloat16_prefers_the_same_tokens_as_float32(smollm2, smollm2_path, weights):
    """Dense bfloat16 weights, and the GGUF's own Q4_1/Q8_0 blocks with 8-bit activation blocks."""
    import kvstore

    bf16 = kvstore.load_model(smollm2_path, weights=weights)
    assert bf16.dtype == torch.bfloat16 and bf16.weights == weights
    ids = prompt_ids(bf16.tokenizer, 64)
    agree = (bf16.logits(ids).argmax(-1) == smollm2.logits(ids).argmax(-1)).float().mean()
    assert agree > 0.9
