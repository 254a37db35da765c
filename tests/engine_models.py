"""Tiny random models for the engine tests, built from transformers configs, no download.

Each model is a transformers model in float32 with weights re-drawn at a scale where attention is
sharp (the default 0.02 init makes every attention pattern nearly uniform, which would hide RoPE
and masking bugs). It is saved as a Hugging Face folder (`save_pretrained`, safetensors, plus a
`tokenizer.json`) and written as GGUF files the way llama.cpp's converter lays them out: its
tensor names, Q/K rows permuted for the `llama` architecture, GPT-2's Conv1D weights transposed,
Llama-3 rope scaling as a `rope_freqs` tensor, and a byte-level BPE tokenizer section.

For a quantized GGUF the reference is a copy of the transformers model holding the dequantized
weights, so "our logits equal transformers' logits" stays an exact-model comparison.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

Q = gguf.GGMLQuantizationType
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = "<|endoftext|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.",
    "def forward(self, x):\n    return self.proj(torch.relu(x)) + x  # residual\n",
    "Tokens are cached, checkpointed and resumed: the cache holds keys and values.",
    "Zahlen 0123456789 und Umlaute: äöü ß; café, naïve, 東京, 🙂 emoji.",
    "<html><body class=\"main\">Hello, world!</body></html>\t\t  spaces   and\n\nnewlines",
]
SAMPLE_TEXT = (
    "The fox resumes its run: keys and values stay cached.\n"
    "def f(x):\n    return x * 2  # doubled\n"
    "Über 12345 cafés in 東京 🙂🙂 — done.   Trailing spaces\t\n"
    "<|im_start|>user\nhello<|im_end|>\n"
)


# -- tokenizer -----------------------------------------------------------------------------------
def build_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary of ~300 tokens, trained on a few lines (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def tokenizer_tables(tok: Tokenizer) -> tuple[list[str], list[str], list[int]]:
    """(tokens in id order, merges as "a b", GGUF token types) as llama.cpp's converter writes them."""
    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    return tokens, merges, [int(t) for t in types]


# -- model specs -----------------------------------------------------------------------------------
def _llama3_rope() -> dict:
    # original context 64 with factors 1/4: wavelengths above 64 scaled, 16..64 smoothed, below kept,
    # so all three branches of the Llama-3 formula are exercised at head_dim 16, theta 500
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}


SPECS: dict[str, tuple[str, dict]] = {
    # name: (transformers config class, config kwargs)
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=False)),
    "llama3-rope": ("LlamaConfig", dict(num_key_value_heads=1, rope_theta=500.0, rope_scaling=_llama3_rope())),
    # head_dim 32 with 4 heads: the attention width (128) differs from the hidden size (64)
    "linear-rope": ("LlamaConfig", dict(num_key_value_heads=4, head_dim=32, rope_theta=1000.0, attention_bias=True,
                                        mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
    "gpt2": ("GPT2Config", dict()),
    # SmolLM2-135M's widths (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536) in 2 layers: reductions as
    # wide as the real model's, where a GPU's kernels might split them differently by the rows they get
    "llama-wide": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                       num_key_value_heads=3, tie_word_embeddings=True)),
    # a context of 2,048 positions: conversations of ~1k tokens (the serving scale test)
    "llama-long": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048)),
}
LLAMA_ARCH_GGUF = {"LlamaConfig": "llama", "MistralConfig": "llama", "Qwen2Config": "qwen2", "GPT2Config": "gpt2"}


def make_config(name: str, vocab_size: int, bos_id: int, eos_id: int):
    import transformers

    cls_name, kwargs = SPECS[name]
    cls = getattr(transformers, cls_name)
    if cls_name == "GPT2Config":
        return cls(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                   bos_token_id=bos_id, eos_token_id=eos_id, **kwargs)
    return cls(**{**dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
                         bos_token_id=bos_id, eos_token_id=eos_id), **kwargs})


@torch.no_grad()
def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.ndim == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(1 + 0.1 * noise)


# -- GGUF ----------------------------------------------------------------------------------------
_LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)", r"blk.\1.ffn_gate.\2"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", r"blk.\1.ffn_down.\2"),
]
_GPT2_NAMES = [
    (r"transformer\.wte\.weight", "token_embd.weight"),
    (r"transformer\.wpe\.weight", "position_embd.weight"),
    (r"transformer\.ln_f\.(weight|bias)", r"output_norm.\1"),
    (r"transformer\.h\.(\d+)\.ln_1\.(weight|bias)", r"blk.\1.attn_norm.\2"),
    (r"transformer\.h\.(\d+)\.ln_2\.(weight|bias)", r"blk.\1.ffn_norm.\2"),
    (r"transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)", r"blk.\1.attn_qkv.\2"),
    (r"transformer\.h\.(\d+)\.attn\.c_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"blk.\1.ffn_down.\2"),
]


GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # HF stores these [in, out]


def gguf_name(arch: str, hf_name: str) -> str:
    for pattern, repl in _GPT2_NAMES if arch == "gpt2" else _LLAMA_NAMES:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, repl, hf_name)
    raise KeyError(hf_name)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves become interleaved pairs (rows only)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quant_roundtrip(rows: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader gets back after `rows` was stored as `qtype` (blocks run along the last axis)."""
    if qtype == Q.F32:
        return rows
    if qtype == Q.F16:
        return rows.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype)


def encode_tensor(rows: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return rows, None
    if qtype == Q.F16:
        return rows.astype(np.float16), None
    return gguf.quants.quantize(rows, qtype), qtype


def llama3_rope_freqs(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor: per-frequency divisors that carry Llama-3 scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        old = s["original_max_position_embeddings"]
        if wavelen < old / s["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > old / s["low_freq_factor"]:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


@dataclass
class GGUFPlan:
    """Everything a GGUF file will hold; tests edit it (drop or reshape a tensor, rename the arch)."""
    arch: str
    metadata: list[tuple[str, tuple]] = field(default_factory=list)  # (GGUFWriter method name, its args)
    tensors: dict[str, tuple[np.ndarray, Q | None]] = field(default_factory=dict)

    def write(self, path: Path) -> Path:
        w = gguf.GGUFWriter(path, self.arch)
        for method, args in self.metadata:
            getattr(w, method)(*args)
        for name, (array, raw) in self.tensors.items():
            w.add_tensor(name, array, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path


def gguf_plan(model, tok: Tokenizer, qtype: Q) -> tuple[GGUFPlan, dict[str, torch.Tensor]]:
    """The GGUF contents for `model` with 2-D weights stored as `qtype`, and the dequantized
    parameters (transformers names and layout) that a faithful reader must reproduce."""
    cfg = model.config
    arch = LLAMA_ARCH_GGUF[type(cfg).__name__]
    plan = GGUFPlan(arch)
    md = plan.metadata
    tokens, merges, types = tokenizer_tables(tok)
    if arch == "gpt2":
        md += [("add_context_length", (cfg.n_positions,)), ("add_embedding_length", (cfg.n_embd,)),
               ("add_feed_forward_length", (4 * cfg.n_embd,)), ("add_block_count", (cfg.n_layer,)),
               ("add_head_count", (cfg.n_head,)), ("add_layer_norm_eps", (cfg.layer_norm_epsilon,))]
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = cfg.rope_parameters
        md += [("add_context_length", (cfg.max_position_embeddings,)), ("add_embedding_length", (cfg.hidden_size,)),
               ("add_feed_forward_length", (cfg.intermediate_size,)), ("add_block_count", (cfg.num_hidden_layers,)),
               ("add_head_count", (cfg.num_attention_heads,)), ("add_head_count_kv", (cfg.num_key_value_heads,)),
               ("add_layer_norm_rms_eps", (cfg.rms_norm_eps,)), ("add_rope_freq_base", (rope["rope_theta"],)),
               ("add_rope_dimension_count", (head_dim,)), ("add_vocab_size", (cfg.vocab_size,))]
        if head_dim != cfg.hidden_size // cfg.num_attention_heads:
            md += [("add_key_length", (head_dim,)), ("add_value_length", (head_dim,))]
        if rope.get("rope_type") == "linear":
            md += [("add_rope_scaling_type", (gguf.RopeScalingType.LINEAR,)),
                   ("add_rope_scaling_factor", (rope["factor"],))]
        if rope.get("rope_type") == "llama3":
            plan.tensors["rope_freqs.weight"] = (llama3_rope_freqs(head_dim, rope["rope_theta"], rope), None)
    md += [("add_tokenizer_model", ("gpt2",)), ("add_tokenizer_pre", ("gpt2",)), ("add_token_list", (tokens,)),
           ("add_token_merges", (merges,)), ("add_token_types", (types,)),
           ("add_bos_token_id", (tokens.index(BOS),)), ("add_eos_token_id", (tokens.index(EOS),)),
           ("add_add_bos_token", (False,)), ("add_chat_template", (CHATML,))]

    dequantized: dict[str, torch.Tensor] = {}
    for hf_name, p in model.named_parameters():
        name = gguf_name(arch, hf_name)
        a = p.detach().numpy().astype(np.float32)
        conv1d = arch == "gpt2" and p.ndim == 2 and name.split(".")[-2] in GPT2_CONV1D
        rows = a.T.copy() if conv1d else a  # GGUF stores [out, in]; HF's Conv1D is [in, out]
        store_as = qtype if rows.ndim == 2 else Q.F32  # norms and biases stay F32, as llama.cpp keeps them
        back = quant_roundtrip(rows, store_as)
        dequantized[hf_name] = torch.from_numpy(np.ascontiguousarray(back.T if conv1d else back))
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            rows = llama_cpp_permute(rows, heads)  # rows permute within whole blocks: the roundtrip commutes
        plan.tensors[name] = encode_tensor(np.ascontiguousarray(rows), store_as)
    return plan, dequantized


# -- the fixture object ------------------------------------------------------------------------------
@dataclass
class TinyModel:
    name: str
    hf: torch.nn.Module  # transformers model, float32, eval mode
    tokenizer: Tokenizer
    folder: Path  # save_pretrained + tokenizer files
    workdir: Path
    _gguf: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def gguf(self, qtype: Q = Q.F32) -> tuple[Path, torch.nn.Module]:
        """A GGUF file of this model stored as `qtype`, and the transformers model it must equal."""
        if qtype not in self._gguf:
            plan, dequantized = gguf_plan(self.hf, self.tokenizer, qtype)
            path = plan.write(self.workdir / f"{self.name}.{qtype.name}.gguf")
            reference = self.hf
            if qtype != Q.F32:
                reference = copy.deepcopy(self.hf)
                with torch.no_grad():
                    for n, p in reference.named_parameters():
                        p.copy_(dequantized[n])
            self._gguf[qtype] = (path, reference)
        return self._gguf[qtype]

    def plan(self, qtype: Q = Q.F32) -> GGUFPlan:
        """A fresh, editable GGUF plan (for writing damaged variants)."""
        return gguf_plan(self.hf, self.tokenizer, qtype)[0]

    def ids(self, n: int, seed: int = 0) -> list[int]:
        """n random token ids (not the special ones), reproducible."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(len(SPECIAL_TOKENS), self.vocab_size, (n,), generator=g).tolist()

    @torch.no_grad()
    def reference_logits(self, ids: list[int], model: torch.nn.Module | None = None) -> torch.Tensor:
        model = model or self.hf
        return model(torch.tensor([ids])).logits[0].float()


def build_tiny_model(name: str, workdir: Path, tok: Tokenizer, seed: int = 0) -> TinyModel:
    import transformers

    vocab = tok.get_vocab(with_added_tokens=True)
    cfg = make_config(name, len(vocab), vocab[BOS], vocab[EOS])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    redraw_weights(model, seed)
    model.eval()
    folder = workdir / name
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "chat_template": CHATML}))
    return TinyModel(name, model, tok, folder, workdir)
