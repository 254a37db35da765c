"""Hugging Face transformers as a peer for saving a session: its `DynamicCache` to a file and back.

The cache comes from one real HF prefill of the same tokens (same GGUF weights, bf16). Saving is
what an HF user would write: the per-layer key and value tensors with `torch.save` (restored with
`torch.load(weights_only=True)`) or with safetensors, then an fsync (kvstore's checkpoints are
durable, so the peers' saves are made durable too). Restoring ends with a `DynamicCache` that
`generate` can continue from.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvstore.fileio import fsync_path


class HFCacheFile:
    """Save / restore of one HF prefill's cache; `fmt` is "torch" or "safetensors"."""

    def __init__(self, hf_model, fmt: str):
        assert fmt in ("torch", "safetensors")
        self.model, self.fmt = hf_model, fmt
        self.key = f"hf-{fmt}"
        self.name = "HF DynamicCache, " + ("torch.save / torch.load" if fmt == "torch" else "safetensors")
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @torch.inference_mode()
    def prepare(self, ids: list[int]) -> None:
        out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = out.past_key_values
        # [1, n_kv_heads, T, head_dim] per layer
        self.layers = [(layer.keys, layer.values) for layer in cache.layers]

    def release(self) -> None:
        self.layers = None

    def save(self, path: Path) -> float:
        start = time.perf_counter()
        if self.fmt == "torch":
            torch.save({"keys": [k for k, _ in self.layers], "values": [v for _, v in self.layers]}, path)
        else:
            from safetensors.torch import save_file

            tensors = {}
            for i, (k, v) in enumerate(self.layers):
                tensors[f"{i}.keys"], tensors[f"{i}.values"] = k.contiguous(), v.contiguous()
            save_file(tensors, str(path))
        fsync_path(path)
        return time.perf_counter() - start

    def restore(self, path: Path) -> float:
        start = time.perf_counter()
        cache = self.load(path)
        elapsed = time.perf_counter() - start
        self.check(cache)
        return elapsed

    def load(self, path: Path):
        from transformers import DynamicCache

        if self.fmt == "torch":
            state = torch.load(path, weights_only=True)
            pairs = list(zip(state["keys"], state["values"]))
        else:
            from safetensors.torch import load_file

            state = load_file(str(path))
            pairs = [(state[f"{i}.keys"], state[f"{i}.values"]) for i in range(len(state) // 2)]
        return DynamicCache(pairs, config=self.model.config)

    def check(self, cache) -> None:
        """The restored cache holds exactly the saved tensors (outside the timing)."""
        if not all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
                   for layer, (k, v) in zip(cache.layers, self.layers)):
            raise AssertionError(f"{self.name}: the restored cache differs from the saved one")


def peers(hf_model) -> list[HFCacheFile]:
    return [HFCacheFile(hf_model, "torch"), HFCacheFile(hf_model, "safetensors")]
