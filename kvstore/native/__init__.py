"""Native CPU kernels, compiled on first use; torch's own kernels wherever they cannot run.

`gemv_bf16()` -> the op `torch.ops.kvstore.gemv_bf16(w, x, add=None)` (contract in gemv_bf16.cpp:
bfloat16 W @ x (+ add) with AVX512-BF16 dot products, twice torch.mv's speed on a decode step here),
or None when this process multiplies with torch's kernels: KVSTORE_NATIVE=0, a CPU without
AVX512-BF16, or a build that failed (a NativeKernelWarning says why, once). The first call settles it
for the process; the build (build.py) happens once per machine and torch install.

Bits: the two kernels round differently, so decoding is exact between runs that made the same
choice. Every process on one machine makes the same one (unless KVSTORE_NATIVE differs); a session
continued where the choice differs (another kind of CPU, KVSTORE_NATIVE=0) continues exactly as a
run there would, not bit-for-bit as the first machine would have.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from .build import BuildError, is_built, load

ENV = "KVSTORE_NATIVE"
SOURCE = Path(__file__).with_name("gemv_bf16.cpp")


class NativeKernelWarning(UserWarning):
    """The native kernel could not be used; decoding goes on with torch's (slower) kernels."""


_choice: tuple[object, str] | None = None  # (the op or None, why), once settled


def gemv_bf16():
    """The native bfloat16 matrix-vector op, or None (see the module's docstring)."""
    global _choice
    if _choice is None:
        _choice = _load()
    return _choice[0]


def will_build() -> bool:
    """Whether settling the choice now compiles the kernel first (about 8 s here, once per machine)."""
    return _choice is None and os.environ.get(ENV) != "0" and shutil.which(os.environ.get("CXX") or "c++") is not None \
        and not is_built(SOURCE)


def status() -> str:
    """Which kernels this process multiplies bfloat16 with, and why: one line."""
    gemv_bf16()
    return _choice[1]


def _load() -> tuple[object, str]:
    if os.environ.get(ENV) == "0":
        return None, f"torch's kernels ({ENV}=0)"
    try:
        load(SOURCE)
    except BuildError as e:
        warnings.warn(f"kvstore: decoding with torch's kernels, about half as fast: {e}. Set {ENV}=0 to "
                      "silence this.", NativeKernelWarning, stacklevel=3)
        return None, f"torch's kernels (the native one failed to build: {str(e).splitlines()[0]})"
    if not torch.ops.kvstore.avx512_bf16():
        return None, "torch's kernels (this CPU has no AVX512-BF16)"
    return torch.ops.kvstore.gemv_bf16.default, "native AVX512-BF16 kernel"
