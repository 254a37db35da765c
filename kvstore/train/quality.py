"""Is what the model writes text? One number: the share of the longer words it generates (four
letters or more) that are words of the text it was trained on.

`text_likeness(model, docs)` starts from the first `prompt_tokens` tokens of documents spread over
the training text (raw form: title, dashes, the docstring's first words), samples `n_new` tokens
from each through the engine's own decoding (`Sequence.generate`, seeded, temperature 0.8; past an
end-of-sequence token too, which starts another document, so that every prompt counts alike), and
cuts the continuations, special tokens left out, into words: maximal runs of ASCII letters,
lowercased. The share is the fraction of the words of `MIN_LETTERS` letters or more (counted with
repeats) found among the training text's words. Shorter ones are left out because they say
little: "the", "is", "to" are single tokens of the vocabulary, which a random model emits about as
often as a trained one (a quarter of a random model's short words are real); a longer word mostly
takes several tokens put together in the right order, which pieces of the vocabulary glued at
random almost never are. The same measure on the untrained model of the same shape
(`untrained(model, initial weights)`) is the baseline.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from ..engine.models import llama
from ..engine.sequence import Sequence
from ..engine.settings import SamplerSettings
from .corpus import Document

_WORD = re.compile(r"[A-Za-z]+")
MIN_LETTERS = 4


@dataclass
class Likeness:
    share: float  # of the generated words of MIN_LETTERS letters or more that are words of the training text
    n_words: int  # generated words of MIN_LETTERS letters or more
    n_distinct: int  # distinct generated words that are words of the text
    samples: list[str]  # the decoded continuations

    def __str__(self) -> str:
        return f"{self.share:.0%} of {self.n_words} generated words ({MIN_LETTERS}+ letters) are words of the text"


def words(text: str, min_letters: int = MIN_LETTERS) -> list[str]:
    return [w.lower() for w in _WORD.findall(text) if len(w) >= min_letters]


def vocabulary(docs: Seq[Document]) -> set[str]:
    return {w for d in docs for w in words(d.raw())}


def untrained(model, weights: dict[str, torch.Tensor]):
    """`model` (a float32 engine Model) with other weights of the same shape: e.g. the initial ones."""
    return dataclasses.replace(model, net=llama.Llama(model.config, weights), fingerprint="untrained",
                               source="untrained")


def text_likeness(model, docs: Seq[Document], *, n_prompts: int = 24, prompt_tokens: int = 12, n_new: int = 48,
                  seed: int = 0, temperature: float = 0.8) -> Likeness:
    known = vocabulary(docs)
    tok = model.tokenizer
    step = max(1, len(docs) // n_prompts)
    settings = SamplerSettings(temperature=temperature)
    found, total, distinct, samples = 0, 0, set(), []
    for i, doc in enumerate(docs[::step][:n_prompts]):
        seq = Sequence(model, tokens=tok.encode(doc.raw(), add_bos=False)[:prompt_tokens])
        new = [e.token for e in seq.generate(settings, seed=seed + i, max_new_tokens=n_new)]
        seq.close()
        text = tok.decode(new, skip_special=True)
        samples.append(text)
        ws = words(text)
        total += len(ws)
        hits = [w for w in ws if w in known]
        found += len(hits)
        distinct.update(hits)
    return Likeness(found / total if total else 0.0, total, len(distinct), samples)
