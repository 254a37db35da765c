"""Native CPU kernels, compiled on first use; torch's own kernels wherever they cannot run.

`kernels()` -> `Kernels`, the ops of kernels_bf16.cpp (its comment states their contract): `gemv`
(bfloat16 W @ x (+ add) with AVX512-BF16 dot products, twice torch.mv's speed on a decode step
here, or AVX2 fused multiply-adds on CPUs without it), `rms_norm`, `swiglu` and `rope_` (one pass
each where torch takes several); or None when this process computes with torch's kernels:
KVSTORE_NATIVE=0, a CPU without AVX2, or a build that failed (a NativeKernelWarning says why, once). The first call settles it for the process; the build
(build.py) happens once per machine and torch install. kvstore/engine/ops.py decides, op by op, which runs.

`quant()` -> `QuantKernels`, the block-quantized products of kernels_quant.cpp (`qgemm`, on any CPU
with AVX2: AVX512-VNNI, AVX-VNNI or AVX2, the same bits on each), or None (KVSTORE_NATIVE=0, no
AVX2, a failed build): then `quant_reference` computes the same bits with torch ops, slowly.

`attention()` -> the `attention_rows` op of attention.cpp (the attention of query rows over a paged
bfloat16 KV cache, its comment states the contract; AVX512, else AVX2 with the same arithmetic), or
None: KVSTORE_NATIVE=0, a CPU without AVX2, a failed build. Settled once per process, like `kernels()`; kvstore/engine/attention.py decides
where it runs.

`layers()` -> the `llama_layers` op of layers.cpp (a Llama forward's whole layer stack in one call,
running the three libraries' kernel steps (their headers: qgemm.h, kernels_bf16.h, attention_rows.h)
in the order the Python loop calls the kernels, in one parallel region: the same bits, without
Python's dispatch and the threads' fork and join between them), or None wherever one of the three
is missing or it fails to build; models/llama.py decides where it runs.

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
QUANT_SOURCE = Path(__file__).with_name("kernels_quant.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("attention.cpp")
LAYERS_SOURCE = Path(__file__).with_name("layers.cpp")


class NativeKernelWarning(UserWarning):
    """The native kernels could not be used; the model runs on torch's (slower) kernels."""


@dataclass(frozen=True)
class Kernels:
    gemv: Callable  # (w [rows, n], x [n], add [rows] | None) -> [rows]
    gemv_rows: Callable  # (w [rows, n], x [R, n], add [R, rows] | None) -> [R, rows]: gemv of each row
    rms_norm: Callable  # (x [..., H], weight [>= H], eps) -> [..., H]
    swiglu: Callable  # (gate_up [..., 2F]) -> [..., F]
    rope_: Callable  # (x [T, heads, hd] | [heads, hd], cos, sin) -> x, in place
    isa: str  # the path they take: "avx512-bf16" or "avx2" (the same bits but for subnormals)


AMX_INT8 = 3  # qgemm's `isa` of its AMX path


@dataclass(frozen=True)
class QuantKernels:
    qgemm: Callable  # (packed, kind, rows, cols, x [T, cols], add | None, isa) -> [T, rows]
    qembed: Callable  # (packed, kind, rows, cols, ids [n], dtype) -> [n, cols]
    isa: str  # the instruction path qgemm takes for a few rows: "avx512-vnni", "avx-vnni" or "avx2"
    paths: tuple[int, ...]  # every path this CPU runs, qgemm's `isa`: 0 AVX2, 1 AVX-VNNI, 2 AVX512-VNNI,
    # 3 AMX-INT8, which it takes for many rows (a path below the best one may be missing: AMD Zen 4 has
    # AVX512-VNNI and no AVX-VNNI)

    @property
    def amx(self) -> bool:
        return AMX_INT8 in self.paths


_choice: tuple[Kernels | None, str] | None = None  # (the kernels or None, why), once settled
_quant_choice: tuple[QuantKernels | None, str] | None = None
_attention: tuple[Callable | None, str] | None = None  # (attention_rows or None, why), once settled
_layers: tuple[Callable | None, str] | None = None  # (llama_layers or None, why), once settled


def kernels() -> Kernels | None:
    """The native bfloat16 kernels, or None (see the module's docstring)."""
    global _choice
    if _choice is None:
        _choice = _load()
    return _choice[0]


def quant() -> QuantKernels | None:
    """The native block-quantized products, or None (see the module's docstring)."""
    global _quant_choice
    if _quant_choice is None:
        _quant_choice = _load_quant()
    return _quant_choice[0]


def will_build() -> bool:
    """Whether settling the choices now compiles kernels first (about 10 s each here, once per machine)."""
    unsettled = [src for src, choice in ((SOURCE, _choice), (QUANT_SOURCE, _quant_choice),
                                         (ATTENTION_SOURCE, _attention), (LAYERS_SOURCE, _layers)) if choice is None]
    return os.environ.get(ENV) != "0" and has_compiler() and not all(is_built(src) for src in unsettled)


def status() -> str:
    """Which kernels this process multiplies bfloat16 with, and why: one line."""
    kernels()
    return _choice[1]


def quant_status() -> str:
    """Which kernels compute with block-quantized weights, and why: one line."""
    quant()
    return _quant_choice[1]


def attention_status() -> str:
    """Which attention runs over the cache, and why: one line."""
    attention()
    return _attention[1]


LOOP = "Python's loop over the layers"  # what runs where the layer stack does not
STOOD_DOWN = f"{LOOP} (a kernel library it calls is not in use)"


def layers_status() -> str:
    """Whether a forward's layer stack runs in one native call, and why: one line."""
    layers()
    return _layers[1] if _callees_in_use() else STOOD_DOWN


def layers() -> Callable | None:
    """The native layer stack of a Llama forward, or None (see the module's docstring)."""
    global _layers
    if _layers is None:
        _layers = _load_layers()
    return _layers[0] if _callees_in_use() else None


def _callees_in_use() -> bool:
    """Whether this process computes with the three kernel libraries the layer stack calls (asked at
    every call: a choice settled, or set by a test, after the stack's own)."""
    return kernels() is not None and quant() is not None and attention() is not None


def attention() -> Callable | None:
    """The native attention over a paged bfloat16 KV cache, or None (see the module's docstring)."""
    global _attention
    if _attention is None:
        _attention = _load_attention()
    return _attention[0]


def _built(source: Path, cost: str, instead: str = "torch's kernels") -> str | None:
    """Why source's library cannot serve this process (then warned once), or None once it is loaded;
    `instead`: what runs without it."""
    if os.environ.get(ENV) == "0":
        return f"{instead} ({ENV}=0)"
    try:
        load(source)
    except BuildError as e:
        warnings.warn(f"kvstore: running on {instead}, {cost}: {e}. Set {ENV}=0 to silence this.",
                      NativeKernelWarning, stacklevel=4)
        return f"{instead} (the native ones failed to build: {str(e).splitlines()[0]})"
    return None


def _load_quant() -> tuple[QuantKernels | None, str]:
    if (why := _built(QUANT_SOURCE, "quantized weights computing far slower")) is not None:
        return None, why
    isa = torch.ops.kvstore.quant_isa()
    if not isa:
        return None, "torch's kernels (this CPU has no AVX2)"
    ops = torch.ops.kvstore
    kernels = QuantKernels(ops.qgemm.default, ops.qembed.default, isa, tuple(ops.quant_paths()))
    return kernels, f"native {isa.upper()}{' and AMX-INT8' if kernels.amx else ''} block-quantized kernels"


def _load_attention() -> tuple[Callable | None, str]:
    if (why := _built(ATTENTION_SOURCE, "attention over long contexts far slower")) is not None:
        return None, why
    isa = torch.ops.kvstore.attention_isa()
    if not isa:
        return None, "torch's attention (this CPU has neither AVX512 nor AVX2)"
    return torch.ops.kvstore.attention_rows.default, f"native {isa.upper()} attention"


def _load_layers() -> tuple[Callable | None, str]:
    if not _callees_in_use():  # its calls would find no kernels: not built, not loaded
        return None, STOOD_DOWN
    if (why := _built(LAYERS_SOURCE, "decoding about a fifth slower", LOOP)) is not None:
        return None, why
    return torch.ops.kvstore.llama_layers.default, "one native call for the layer stack"


def _load() -> tuple[Kernels | None, str]:
    if (why := _built(SOURCE, "decoding about half as fast")) is not None:
        return None, why
    ops = torch.ops.kvstore
    isa = ops.bf16_isa()
    if not isa:
        return None, "torch's kernels (this CPU has neither AVX512-BF16 nor AVX2)"
    return Kernels(ops.gemv_bf16.default, ops.gemv_rows_bf16.default, ops.rms_norm_bf16.default, ops.swiglu_bf16.default,
                   ops.rope_bf16_.default, isa), f"native {isa.upper()} kernels"


def native_will_build() -> bool:
    """`will_build` under the public API's name (`kvstore.native_will_build`)."""
    return will_build()
