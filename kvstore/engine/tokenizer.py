"""Text <-> token ids, and the chat template; the only place besides the CLI where text exists.

Built with the `tokenizers` library either from GGUF metadata (the `gpt2` byte-level BPE model:
tokens, merges, token types, `tokenizer.ggml.pre`) or from a Hugging Face `tokenizer.json`.
Chat templates are rendered in jinja2's immutable sandbox, with the globals HF templates use.
`StreamDecoder` turns a growing list of ids into text pieces without splitting a character.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, models, pre_tokenizers

from ..errors import ModelError, UnsupportedModel

# Split patterns of the byte-level BPE vocabularies, by GGUF `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
GPT2_STYLE = {"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "olmo", None}
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


class Tokenizer:
    """Text to ids and back, plus the model's chat template."""

    def __init__(self, backend: Backend, *, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool,
                 chat_template: str | None, special: dict[str, str | None] | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = frozenset(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special = special or {}
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_at(self, text: str, at: int) -> list[int]:
        """`text`'s ids as a sequence of `at` tokens appends them (raw text: `Session.append_text`,
        `Session.begin`, a completion's prompt): the model's BOS first only at the start (at == 0)."""
        return self.encode(text, add_bos=None if at == 0 else False)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: exact where the vocabulary spells bytes (byte-level BPE,
        GPT-2's table: a token may hold part of a character), else the UTF-8 of its text alone."""
        piece = self.backend.id_to_token(token)
        if piece is None:
            return b""
        if isinstance(self.backend.decoder, decoders.ByteLevel) and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.decode([token]).encode("utf-8")

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ModelError("this model has no chat template; feed raw text instead (--raw)")
        from jinja2 import TemplateError

        try:  # a template is model data: its errors (syntax, sandbox refusals, raise_exception) are ours
            if self._template is None:
                self._template = _sandbox().from_string(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.special.get("bos_token") or "",
                                         eos_token=self.special.get("eos_token") or "")
        except TemplateError as e:
            raise ModelError(f"the model's chat template failed: {e}") from e

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt), add_bos=False)


def _sandbox():
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# -- from GGUF -----------------------------------------------------------------------------------
def from_gguf(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelled = [t if set(t) <= alphabet else _byte_spelling(t) for t in tokens]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, ignore_merges=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == TOKEN_CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = {eos} if eos is not None else set()
    if (eot := meta.get("tokenizer.ggml.eot_token_id")) is not None:
        eos_ids.add(eot)
    return Tokenizer(backend, bos_id=bos, eos_ids=eos_ids, add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=meta.get("tokenizer.chat_template"),
                     special={"bos_token": _token(tokens, bos), "eos_token": _token(tokens, eos)})


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in GPT2_STYLE:
        raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported; known: "
                               f"{sorted(PRE_TOKENIZER_SPLITS) + sorted(p for p in GPT2_STYLE if p)}")
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_spelling(token: str) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token(tokens: list[str], index: int | None) -> str | None:
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


# -- from a Hugging Face folder ----------------------------------------------------------------------
def from_hf_folder(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelError(f"{folder}: no tokenizer.json; kvstore needs the fast-tokenizer file")
    backend = Backend.from_file(str(path))
    cfg = _read_json(folder / "tokenizer_config.json")
    gen = _read_json(folder / "generation_config.json")
    model_cfg = _read_json(folder / "config.json")
    special = {k: _token_content(cfg.get(k)) for k in ("bos_token", "eos_token")}
    bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else model_cfg.get("bos_token_id")
    eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
        eos_ids.add(backend.token_to_id(special["eos_token"]))
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    # tokenizer.json's post-processor may add BOS itself: learn whether it does, then add it ourselves.
    probe = backend.encode("a", add_special_tokens=True).ids
    add_bos = bool(cfg.get("add_bos_token", False)) or (bos_id is not None and probe[:1] == [bos_id])
    backend.post_processor = None
    return Tokenizer(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, chat_template=template,
                     special=special)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, get the text they add.

    Holds back a piece while it ends in an incomplete UTF-8 sequence, so no character is split.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special=self.skip_special)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            piece = text[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special=self.skip_special)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special=self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
