"""llama.cpp, through llama-cpp-python (the optional `llama` extra), as a peer: engine speed and
its per-sequence state files (`llama_state_seq_save_file` / `llama_state_seq_load_file`).

It runs the GGUF as it is (Q4_1 weights, f16 KV cache) on the same threads, with llama.cpp's own
defaults, its CPU weight repacking ("extra buffer types") included, except where that crashed:
- on CPUs with AMX, the repacked matmul path crashed at the first decode when this was written, so
  there the model is loaded with `use_extra_bufts=False` and `LlamaCpp.repack` says so (the report
  prints it beside llama.cpp's figures); `benchmarks.llama_server` does the same for the server;
- with `verbose=False`, llama-cpp-python drops llama.cpp's own error messages, so a log callback
  keeps them, and a failed load says why.
`LlamaCpp.logits(ids)` gives the logits of every position (for `benchmarks.quality`), batch by batch.
When the package is absent, `status()` says so and the suite reports llama.cpp as not measured.
"""

from __future__ import annotations

import collections
import ctypes
import os
import time
from pathlib import Path
from typing import Iterator

from .llama_server import has_amx, without_extra_bufts

_LOG: collections.deque[tuple[int, str]] = collections.deque(maxlen=200)  # (ggml log level, text)
WARN, ERROR, CONT = 2, 3, 5
_CALLBACK = None  # a reference keeps the C callback alive
REPACK_ON = "on (llama.cpp's default)"
REPACK_OFF_AMX = ("off (`use_extra_bufts=False`): on this CPU with AMX, llama.cpp's repacked matmul path crashed "
                  "at the first decode")


class LlamaUnavailable(Exception):
    """llama.cpp cannot be measured here (the message says why)."""


def status() -> tuple[str | None, str]:
    """(version, "") when llama-cpp-python imports, else (None, why not)."""
    try:
        import llama_cpp
    except ImportError as e:
        return None, f"llama-cpp-python is not installed ({e}); `pip install -e '.[llama]'` builds it"
    except OSError as e:  # the package is there but its shared library does not load
        return None, f"llama-cpp-python's library does not load: {e}"
    return getattr(llama_cpp, "__version__", "?"), ""


def server_status() -> tuple[str | None, str]:
    """status(), and whether llama-cpp-python's OpenAI-compatible server imports too (the packages of
    its `[server]` extra), so that a benchmark of servers finds out before it starts, not midway."""
    version, why = status()
    if version is None:
        return version, why
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        return None, (f"llama-cpp-python's server does not import ({e}); "
                      "`pip install -e '.[llama]'` installs it with its `[server]` extra")
    return version, ""


def _install_log() -> None:
    global _CALLBACK
    import llama_cpp

    if _CALLBACK is None:
        def keep(level: int, text: bytes, user_data) -> None:
            if level == CONT and _LOG:
                level = _LOG[-1][0]
            _LOG.append((level, text.decode("utf-8", "replace")))

        _CALLBACK = llama_cpp.llama_log_callback(keep)
        llama_cpp.llama_log_set(_CALLBACK, ctypes.c_void_p(0))


def recent_log(lines: int = 6) -> str:
    """llama.cpp's latest warnings and errors (else its latest lines), on one line."""
    picked = [t for level, t in _LOG if level in (WARN, ERROR)] or [t for _, t in _LOG]
    return " | ".join(t.strip() for t in picked[-lines:] if t.strip())


class LlamaCpp:
    """A loaded llama.cpp model with the engine interface of `benchmarks.engine` (decode, prefill,
    load_s) and the save/restore interface of `benchmarks.store.save_restore`."""

    key = "llama-cpp"
    name = "llama.cpp state file (seq save / load)"

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        import llama_cpp
        from llama_cpp import llama_cpp as lib

        _install_log()
        _LOG.clear()
        defaults = lib.llama_model_default_params
        self.repack = REPACK_ON
        if has_amx():  # repacking crashed at the first decode on this machine kind
            without_extra_bufts()
            self.repack = REPACK_OFF_AMX
        start = time.perf_counter()
        try:
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                       n_threads_batch=threads, seed=0, verbose=False)
        except (ValueError, RuntimeError) as e:
            why = f"llama.cpp did not load {gguf.name}: {e}; its log: {recent_log()!r}"
            raise LlamaUnavailable(why.replace(str(gguf.parent), "…")) from e  # no local path in the report
        finally:
            lib.llama_model_default_params = defaults
        self.load_s = time.perf_counter() - start
        self.lib = lib
        self.ids: list[int] = []
        self.weight_bytes = self.llm._model.size()  # llama.cpp's own count of its tensors' bytes
        self.about = f"the GGUF's blocks as stored, f16 KV cache; CPU weight repacking {self.repack}"

    # -- engine speed (the interface of benchmarks.engine.measure) -------------------------------
    def decode(self, prompt: list[int], n_new: int) -> tuple[list[float], list[int]]:
        """Greedy; stamps of each new token (the first comes after the prompt's prefill)."""
        self.llm.reset()
        stamps, tokens = [], []
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == n_new:
                break
        return stamps, tokens

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - start

    def logits(self, ids: list[int]) -> Iterator:
        """float32 logits `[k, vocab]` (numpy) of every position of `ids`, fed from position 0 in
        llama.cpp's batches (n_batch) into an emptied cache, batch by batch."""
        import numpy as np

        ctx, batch, vocab = self.llm._ctx, self.llm._batch, self.llm.n_vocab()
        self.llm.reset()
        ctx.kv_cache_clear()
        for start in range(0, len(ids), self.llm.n_batch):
            part = ids[start:start + self.llm.n_batch]
            batch.set_batch(batch=part, n_past=start, logits_all=True)
            ctx.decode(batch)
            yield np.ctypeslib.as_array(ctx.get_logits(), shape=(len(part), vocab)).copy()
        ctx.kv_cache_clear()

    # -- state files (the interface of benchmarks.store.save_restore) ----------------------------
    def prepare(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)
        self.ids = list(ids)

    def release(self) -> None:
        self.llm.reset()
        self.ids = []

    def save(self, path: Path) -> float:
        tokens = (self.lib.llama_token * len(self.ids))(*self.ids)
        start = time.perf_counter()
        written = self.lib.llama_state_seq_save_file(self.llm.ctx, str(path).encode(), 0, tokens, len(self.ids))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - start
        if not written:
            raise LlamaUnavailable(f"llama_state_seq_save_file wrote nothing: {recent_log()!r}")
        return elapsed

    def restore(self, path: Path) -> float:
        capacity = len(self.ids) + 16
        tokens, count = (self.lib.llama_token * capacity)(), ctypes.c_size_t(0)
        start = time.perf_counter()
        read = self.lib.llama_state_seq_load_file(self.llm.ctx, str(path).encode(), 0, tokens, capacity,
                                                  ctypes.byref(count))
        elapsed = time.perf_counter() - start
        if not read or count.value != len(self.ids) or list(tokens[:count.value]) != self.ids:
            raise LlamaUnavailable(f"llama_state_seq_load_file restored {count.value} of {len(self.ids)} tokens: "
                                   f"{recent_log()!r}")
        return elapsed


def load(gguf: Path, threads: int, n_ctx: int) -> tuple[LlamaCpp | None, str]:
    """(the peer, "") or (None, why it is not measured)."""
    version, why = status()
    if version is None:
        return None, why
    try:
        return LlamaCpp(gguf, threads, n_ctx), ""
    except LlamaUnavailable as e:
        return None, str(e)
