"""The native kernels' instruction paths, switched inside one process for the tests that compare them:
a CPU with AVX512 runs the AVX2 steps too when asked (`kvstore::attention_isa(set)`,
`kvstore::bf16_isa(set)`), so the arithmetic that CPUs with AVX2 alone run is checked here against
the AVX512 steps, bit for bit, on whatever CPU runs the tests. The block-quantized products take
their path per call (`qgemm`'s `isa`; tests/test_quant.py runs each)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import pytest
import torch

from kvstore.engine import native

# each setting's op and the name of its AVX512 path
SETTINGS = {"attention": ("attention_isa", "avx512"), "bf16": ("bf16_isa", "avx512-bf16")}


def best(setting: str) -> str:
    """The path this CPU takes for `setting` ("" where its native kernels do not run here)."""
    if (native.attention() if setting == "attention" else native.kernels()) is None:
        return ""
    op = getattr(torch.ops.kvstore, SETTINGS[setting][0])
    return op(op(""))  # the best set, then the setting before it back: op returns the best


@contextmanager
def on_path(setting: str, name: str):
    """The ops of `setting` on path `name` inside the block ("" for the CPU's best), as before after."""
    op = getattr(torch.ops.kvstore, SETTINGS[setting][0])
    before = op(name)
    try:
        yield
    finally:
        op(before)


@contextmanager
def avx2_everywhere():
    """The attention and the bfloat16 ops on their AVX2 steps, as a CPU without AVX512 runs them."""
    with ExitStack() as stack:
        for setting in SETTINGS:
            stack.enter_context(on_path(setting, "avx2"))
        yield


def require_both(*settings: str) -> None:
    """Skip unless this CPU runs both paths of every setting named: an AVX512 one and the AVX2 one."""
    for setting in settings or tuple(SETTINGS):
        if best(setting) != SETTINGS[setting][1]:
            pytest.skip(f"the {setting} kernels run {best(setting) or 'nothing native'} here: no AVX512 path "
                        "to compare the AVX2 one with")
