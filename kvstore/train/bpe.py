"""The tokenizer of the trained model: a byte-level BPE learned from the training text with the
`tokenizers` library, and the files that describe it in a Hugging Face folder.

- `train_tokenizer(texts, vocab_size)`: GPT-2's byte-level pre-tokenizer and decoder (every byte
  has a token, so any text encodes and decodes losslessly), `SPECIAL_TOKENS` first (ids 0, 1, 2),
  merges learned from `texts` up to `vocab_size` tokens. Deterministic: the same texts give the
  same `tokenizer.json` bytes.
- `CHAT_TEMPLATE`: ChatML (`<|im_start|>role\\n...<|im_end|>\\n` per message), the template
  SmolLM2 uses; `tokenizer_config(context)`: the `tokenizer_config.json` that names BOS/EOS and
  carries it. `<|endoftext|>` ends a raw text and `<|im_end|>` a chat turn: both are end-of-sequence
  tokens of the model (`config.json`'s `eos_token_id`).
"""

from __future__ import annotations

from typing import Any, Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import InvalidArgument
from .corpus import END_OF_TEXT, IM_END, SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (special tokens and the 256 bytes included)."""
    floor = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < floor:
        raise InvalidArgument(f"a byte-level vocabulary needs at least {floor} tokens (the special ones and "
                         f"every byte); got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def tokenizer_config(context: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": END_OF_TEXT, "eos_token": IM_END,
            "pad_token": END_OF_TEXT, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
            "model_max_length": context, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
