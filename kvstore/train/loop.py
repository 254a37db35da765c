"""The training loop: a small Llama trained through the engine's own forward, in float32 on the CPU.

There is no second model definition. The weights are leaf tensors under the engine's own names
(`embed`, `norm`, `layers.{i}.wq`, ... : `models/llama.py`'s `shapes(cfg)`); each step builds
`llama.Llama(cfg, weights)` from them (cheap: it concatenates Q|K|V and gate|up, differentiably)
and runs its `forward(ids, 0, None)`, which in float32 is plain differentiable torch (embedding,
RMSNorm as LayerNorm, linear, rotary, SDPA with grouped-query heads, SwiGLU), the very code a
session runs. `cfg` is read from the `config.json` the folder will hold
(`llama.config_from_hf`), so the trained model is the loaded one by construction.

`train(docs, settings)` is deterministic: the same documents and settings (seed included) give the
same weights, bit for bit, on the same machine, torch version and thread count. All randomness
comes from generators seeded by `settings.seed` (initial weights, window offsets, the order of
the documents); it runs on `settings.threads` torch threads (1 by default: float32 on two threads
flips between a fast and a several times slower mode on small machines) with
`torch.use_deterministic_algorithms`.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..engine.config import ModelConfig
from ..engine.models import llama
from ..errors import InvalidArgument
from . import bpe, corpus

Progress = Callable[[int, int, float], None]  # (steps done, steps, loss of the last step)


@dataclass(frozen=True)
class Settings:
    """The model's size and how it is trained. The defaults train in about half a minute here.

    Each step sees `batch * context` tokens: for the first `short_steps` (a share) of the steps in
    windows of half the context (twice as many of them: the short range is learned first, at less
    cost), then in whole windows, so that every position of the context is trained."""
    vocab_size: int = 512
    hidden_size: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 192
    context: int = 256  # the model's context (max_position_embeddings), the longest training window
    steps: int = 500
    batch: int = 4  # windows of the whole context per step
    lr: float = 5e-3
    short_steps: float = 0.7
    seed: int = 0
    threads: int = 1

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name not in ("seed", "short_steps") and value <= 0:
                raise InvalidArgument(f"{name} must be positive, got {value}")
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise InvalidArgument(f"{self.n_heads} heads must divide the hidden size {self.hidden_size} and "
                                  f"group evenly over {self.n_kv_heads} KV heads")
        if (self.hidden_size // self.n_heads) % 2:
            raise InvalidArgument("the head size (hidden size / heads) must be even for rotary embeddings")
        if not 0 <= self.short_steps < 1:
            raise InvalidArgument(f"short_steps is a share of the steps, in [0, 1); got {self.short_steps}")
        if self.context < 4:
            raise InvalidArgument(f"the context must be at least 4 tokens, got {self.context}")


@dataclass
class Result:
    settings: Settings
    hf_config: dict  # what config.json holds
    config: ModelConfig  # the engine's reading of it
    tokenizer: object  # tokenizers.Tokenizer
    weights: dict[str, torch.Tensor]  # ours, trained, float32, detached
    initial: dict[str, torch.Tensor]  # ours, before the first step: the untrained model of the same shape
    losses: list[float]  # one per step
    n_tokens: int  # in the training stream
    seconds: float

    def loss_ends(self) -> tuple[float, float]:
        """Mean loss of the first and of the last 10 % of the steps."""
        n = max(1, len(self.losses) // 10)
        return sum(self.losses[:n]) / n, sum(self.losses[-n:]) / n

    def n_params(self) -> int:
        return sum(t.numel() for t in self.weights.values())


def hf_config(s: Settings, specials: dict[str, int]) -> dict:
    """The `config.json` of a Llama of these sizes: SmolLM2's kind (GQA, rotary, RMSNorm, SwiGLU), but
    with an output head of its own (tied to the embedding, the loss fell far slower here: to 4.3
    where the untied one reached 3.2, at hidden size 96, 3 layers, 300 steps)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads,
        "head_dim": s.hidden_size // s.n_heads, "max_position_embeddings": s.context,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": specials[corpus.END_OF_TEXT],
        "eos_token_id": [specials[corpus.IM_END], specials[corpus.END_OF_TEXT]],
        "pad_token_id": specials[corpus.END_OF_TEXT], "torch_dtype": "float32", "use_cache": True,
    }


def initial_weights(cfg: ModelConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    """N(0, 0.02) matrices (the output projections of each block scaled down by sqrt(2 n_layers), as
    GPT-2 does, so the residual stream starts small), norm weights 1; drawn in `shapes` order."""
    out = {}
    for name, shape in llama.shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith((".wo", ".w_down")) else 0.02
            out[name] = torch.randn(shape, generator=g) * std
    return out


def train(docs: Sequence[corpus.Document], settings: Settings = Settings(),
          progress: Progress | None = None) -> Result:
    """Tokenizer, then model, trained on `docs` (see `corpus.stream`)."""
    s = settings
    start = time.perf_counter()
    tok = bpe.train_tokenizer(_tokenizer_texts(docs), s.vocab_size)
    if tok.get_vocab_size() != s.vocab_size:
        raise InvalidArgument(f"the text yields only {tok.get_vocab_size()} tokens of vocabulary; "
                              f"ask for that many (--vocab-size) or give a longer text")
    ids = torch.tensor(corpus.stream(docs, lambda t: tok.encode(t).ids, s.seed), dtype=torch.long)
    if len(ids) < s.context + 2:
        raise InvalidArgument(f"the text is {len(ids)} tokens long; training windows of {s.context} "
                              "tokens need a longer one (or a smaller --context)")
    config = hf_config(s, bpe.special_ids(tok))
    cfg = llama.config_from_hf(config)
    with _deterministic(s.threads):
        g = torch.Generator().manual_seed(s.seed)
        weights = initial_weights(cfg, g)
        initial = {k: v.clone() for k, v in weights.items()}
        losses = list(_steps(cfg, weights, ids, s, g, progress))
    return Result(s, config, cfg, tok, {k: v.detach() for k, v in weights.items()}, initial, losses, len(ids),
                  time.perf_counter() - start)


def _tokenizer_texts(docs: Sequence[corpus.Document]) -> Iterator[str]:
    for d in docs:
        yield d.raw()
        if d.title:
            yield d.chat()


def _steps(cfg: ModelConfig, weights: dict[str, torch.Tensor], ids: torch.Tensor, s: Settings,
           g: torch.Generator, progress: Progress | None) -> Iterator[float]:
    """AdamW over `weights` (in place), a linear warm-up then a cosine decay to a tenth; yields each
    loss. The windows start anywhere in the stream (offsets drawn from `g`)."""
    params = [w.requires_grad_() for w in weights.values()]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.99), weight_decay=0.0, foreach=False)
    warmup = max(1, s.steps // 20)
    for step in range(s.steps):
        decay = 0.5 * (1 + math.cos(math.pi * step / s.steps))
        for group in opt.param_groups:
            group["lr"] = s.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * decay)
        window, n = (s.context // 2, 2 * s.batch) if step < s.short_steps * s.steps else (s.context, s.batch)
        net = llama.Llama(cfg, weights)  # the engine's forward, rebuilt from the leaves each step
        offsets = torch.randint(0, len(ids) - window - 1, (n,), generator=g).tolist()
        loss = sum(_window_loss(net, ids[o:o + window + 1]) for o in offsets) / n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        opt.step()
        value = loss.item()
        if progress is not None:
            progress(step + 1, s.steps, value)
        yield value


def _window_loss(net: llama.Llama, window: torch.Tensor) -> torch.Tensor:
    logits = net.forward(window[:-1], 0, None, last_only=False)  # [T, vocab] float32
    return F.cross_entropy(logits, window[1:])


@contextmanager
def _deterministic(threads: int):
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
        torch.set_num_threads(threads_before)
