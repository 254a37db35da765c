"""Native CPU kernels, compiled on first use; torch's own kernels wherever they cannot run.

`kernels()` -> `Kernels`, the ops of kernels_bf16.cpp (its comment states their contract): `gemv`
(bfloat16 W @ x (+ add) with AVX512-BF16 dot products, twice torch.mv's speed on a decode step
here), `rms_norm`, `swiglu` and `rope_` (one pass each where torch takes several); or None when this
process computes with torch's kernels: KVSTORE_NATIVE=0, a CPU without AVX512-BF16, or a build that
failed (a NativeKernelWarning says why, once). The first call settles it for the process; the build
(build.py) happens once per machine and torch install. kvstore/engine/ops.py decides, op by op, which runs.

`attention()` -> the `attention_rows` op of attention.cpp (the attention of query rows over a paged
bfloat16 KV cache, its comment states the contract), or None: KVSTORE_NATIVE=0, a CPU without AVX512,
a failed build. Settled once per process, like `kernels()`; kvstore/engine/attention.py decides
where it runs.

Bits: the two kernels round differently, so decoding is exact between runs that made the same
choice. Every process on one machine makes the same one (unless KVSTORE_NATIVE differs); a session
continued where the choice differs (another kind of CPU, KVSTORE_NATIVE=0) continues exactly as a
run there would, not bit-for-bit as the first machine would have.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .build import BuildError, has_compiler, is_built, load

ENV = "KVSTORE_NATIVE"
SOURCE = Path(__file__).with_name("kernels_bf16.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("attention.cpp")


class NativeKernelWarning(UserWarning):
    """The native kernels could not be used; the model runs on torch's (slower) kernels."""


@dataclass(frozen=True)
class Kernels:
    gemv: Callable  # (w [rows, n], x [n], add [rows] | None) -> [rows]
    rms_norm: Callable  # (x [..., H], weight [>= H], eps) -> [..., H]
    swiglu: Callable  # (gate_up [..., 2F]) -> [..., F]
    rope_: Callable  # (x [T, heads, hd] | [heads, hd], cos, sin) -> x, in place


_choice: tuple[Kernels | None, str] | None = None  # (the kernels or None, why), once settled
_attention: tuple[Callable | None, str] | None = None  # (attention_rows or None, why), once settled


def kernels() -> Kernels | None:
    """The native bfloat16 kernels, or None (see the module's docstring)."""
    global _choice
    if _choice is None:
        _choice = _load()
    return _choice[0]


def will_build() -> bool:
    """Whether settling the choice now compiles the kernels first (about 10 s here, once per machine)."""
    unsettled = [src for src, choice in ((SOURCE, _choice), (ATTENTION_SOURCE, _attention)) if choice is None]
    return os.environ.get(ENV) != "0" and has_compiler() and not all(is_built(src) for src in unsettled)


def status() -> str:
    """Which kernels this process multiplies bfloat16 with, and why: one line."""
    kernels()
    return _choice[1]


def attention() -> Callable | None:
    """The native attention over a paged bfloat16 KV cache, or None (see the module's docstring)."""
    global _attention
    if _attention is None:
        _attention = _load_attention()
    return _attention[0]


def _built(source: Path) -> str | None:
    """Why source's library cannot serve this process (then warned once), or None once it is loaded."""
    if os.environ.get(ENV) == "0":
        return f"torch's kernels ({ENV}=0)"
    try:
        load(source)
    except BuildError as e:
        warnings.warn(f"kvstore: running on torch's kernels, decoding about half as fast: {e}. Set {ENV}=0 to "
                      "silence this.", NativeKernelWarning, stacklevel=4)
        return f"torch's kernels (the native ones failed to build: {str(e).splitlines()[0]})"
    return None


def _load_attention() -> tuple[Callable | None, str]:
    why = _built(ATTENTION_SOURCE)
    if why is not None:
        return None, why
    if not torch.ops.kvstore.attention_avx512():
        return None, "torch's attention (this CPU has no AVX512)"
    return torch.ops.kvstore.attention_rows.default, "native AVX512 attention"


def _load() -> tuple[Kernels | None, str]:
    why = _built(SOURCE)
    if why is not None:
        return None, why
    ops = torch.ops.kvstore
    if not ops.avx512_bf16():
        return None, "torch's kernels (this CPU has no AVX512-BF16)"
    return Kernels(ops.gemv_bf16.default, ops.rms_norm_bf16.default, ops.swiglu_bf16.default,
                   ops.rope_bf16_.default), "native AVX512-BF16 kernels"


def native_will_build() -> bool:
    """`will_build` under the public API's name (`kvstore.native_will_build`)."""
    return will_build()
