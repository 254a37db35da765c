"""Block-quantized weights computed as stored (Q4_0, Q4_1, Q8_0): the formats, the kernels, the model.

- The packed layout reads back the GGUF blocks it was made from, and their values are gguf-py's.
- The native product equals the torch reference (kvstore/engine/quant_reference.py, the arithmetic
  the kernel's header states) bit for bit, on every instruction path this CPU has (AVX2, AVX-VNNI,
  AVX512-VNNI), in bfloat16 and float32, for any number of rows, with a bias or a residual added.
- A row's bits do not depend on the other rows (1 row alone or among 16) nor on the thread count.
- A block of activations holding NaN or an infinity makes its row's products NaN on every path, with
  the same bits; a block of subnormals alone quantizes to zeros.
- A model on stored weights is close to the same model on dequantized weights, and computes the same
  bits with the native kernel as with the reference (float32: every other op is torch's in both).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kvstore
from conftest import threads
from engine_models import Q
from kvstore.engine import native, ops, quant, quant_reference

KINDS = ["Q4_0", "Q4_1", "Q8_0"]
ISAS = {"avx2": 0, "avx-vnni": 1, "avx512-vnni": 2}  # and AMX-INT8: native.AMX_INT8
needs_kernel = pytest.mark.skipif(native.quant() is None, reason=f"this process uses {native.quant_status()}")


def paths() -> list[int]:
    """The instruction paths this CPU runs (not every one below the best: Zen 4 has AVX512-VNNI and no
    AVX-VNNI); the best among them."""
    k = native.quant()
    if k is None:
        return []
    assert max(p for p in k.paths if p != native.AMX_INT8) == ISAS[k.isa]
    return list(k.paths)


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> quant.Blocks:
    """GGUF blocks as gguf-py's quantizer writes them, from random weights."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(Q, kind))
    return quant.Blocks(kind, torch.from_numpy(np.ascontiguousarray(raw)), cols)


def rows_of(T: int, cols: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cols, generator=g) * 2
    x[0, :32] = 0  # a block of zeros: its scale is 0
    return x.to(dtype)


def kernel(w: quant.Packed, x: torch.Tensor, add=None, isa: int = -1) -> torch.Tensor:
    return native.quant().qgemm(w.data, quant.KINDS[w.kind], w.rows, w.cols, x, add, isa)


# -- the formats ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_packed_blocks_read_back_as_gguf_stores_and_dequantizes_them(kind):
    blocks = random_blocks(kind, 37, 96)  # 37 rows: the last group of 16 is padded
    packed = quant.pack(blocks)
    for a, b in zip(blocks.fields(), packed.unpack()):
        assert (a is None and b is None) or torch.equal(a, b)
    values = gguf.quants.dequantize(blocks.raw.numpy(), getattr(Q, kind))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(values))
    ids = torch.tensor([36, 0, 17, 16, 36])
    assert torch.equal(packed.embed(ids, torch.float32), torch.from_numpy(values)[ids])


def test_q8_0_on_load_makes_the_bytes_gguf_makes():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((20, 64)).astype(np.float32)
    w[3, :32] = 0
    w[4, 0] = 127 * 0.25  # exact halves after scaling: rounded away from zero, as llama.cpp does
    w[4, 1:32] = 0.125
    ours = quant.quantize_q8_0(torch.from_numpy(w))
    assert torch.equal(ours.raw, torch.from_numpy(gguf.quants.quantize(w, Q.Q8_0)))


def test_rows_move_as_whole_blocks():
    blocks = random_blocks("Q4_1", 8, 64)
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    moved = blocks.map_rows(lambda raw: raw[order])
    assert torch.equal(moved.dequantize(), blocks.dequantize()[order])
    both = quant.cat_rows([blocks, moved])
    assert torch.equal(both.dequantize(), torch.cat([blocks.dequantize(), moved.dequantize()]))


# -- the product ---------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 40])
def test_the_kernel_equals_the_reference_bit_for_bit_on_every_path(kind, dtype, T):
    w = quant.pack(random_blocks(kind, 37, 576))
    x = rows_of(T, 576, dtype)
    bias = rows_of(1, 37, dtype, seed=2)[0]
    residual = rows_of(T, 37, dtype, seed=3)
    for add in (None, bias, residual):
        expected = quant_reference.qgemm(w, x, add)
        for isa in paths():
            assert torch.equal(kernel(w, x, add, isa), expected), (isa, None if add is None else add.shape)


def extreme_blocks(kind: str, rows: int, cols: int) -> quant.Blocks:
    """Blocks whose every quant is the largest in magnitude (Q4: 15, Q8_0: -128), scale 1, minimum 0."""
    block = {"Q4_0": [0x00, 0x3C] + [0xFF] * 16, "Q4_1": [0x00, 0x3C, 0, 0] + [0xFF] * 16,
             "Q8_0": [0x00, 0x3C] + [0x80] * 32}[kind]
    raw = torch.tensor(block * (rows * cols // 32), dtype=torch.uint8).view(rows, -1)
    return quant.Blocks(kind, raw, cols)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_the_largest_products_sum_exactly_on_every_path(kind):
    """Every quant at its largest magnitude against activations that quantize to +-127: the integer
    sums are at their bounds (the AVX2 path adds a block's Q4 pair sums in int16), and still exact."""
    w = quant.pack(extreme_blocks(kind, 16, 256))
    x = torch.ones(3, 256)
    x[1] = -1.0
    x[2, ::2] = -1.0
    for dtype in (torch.bfloat16, torch.float32):
        expected = quant_reference.qgemm(w, x.to(dtype))
        assert torch.equal(quant_reference.qgemm(w, x.to(dtype)).float().abs().amax(dim=1)[:2],
                           torch.full((2,), {"Q4_0": 7.0, "Q4_1": 15.0, "Q8_0": 128.0}[kind] * 256).to(dtype).float())
        for isa in paths():
            assert torch.equal(kernel(w, x.to(dtype), None, isa), expected), isa


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers (NaN equals NaN of the same bits)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_nonfinite_activations_make_their_rows_nan_with_the_same_bits_on_every_path(kind, dtype):
    """A block holding NaN or an infinity makes every product of its row NaN, as the reference's, with
    the same bits on every path (each quantizes it the same way: AVX2 for the AVX2 and AVX-VNNI paths,
    AVX512 for the AVX512-VNNI and AMX ones; a NaN's own bits are not the reference's: torch writes
    NaN into bfloat16 its own way); subnormals, signed zeros and huge finite values are ordinary
    blocks, a block of subnormals alone quantizing to zeros."""
    w = quant.pack(random_blocks(kind, 16, 256, seed=3))
    x = rows_of(9, 256, torch.float32, seed=4)
    tiny = torch.finfo(torch.float32).tiny
    nan, inf = float("nan"), float("inf")
    for row, (at, value) in enumerate([(0, nan), (8, nan), (31, nan), (3, inf), (17, -inf)]):
        x[row, 32 * row + at] = value
    x[5, 64:96] = nan  # a block of NaN alone
    x[6, 0], x[6, 40], x[6, 100] = tiny / 4, -0.0, 1e30
    x[7, 64:96] = tiny / 8  # a block of subnormals alone
    x = x.to(dtype)
    expected = quant_reference.qgemm(w, x)
    nan = expected.isnan()
    assert nan[:6].all() and not nan[6:].any()
    first = kernel(w, x, None, paths()[0])
    for isa in paths():
        got = kernel(w, x, None, isa)
        assert torch.equal(bits(got), bits(first)), isa  # NaN's bits too
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], expected[~nan]), isa
    x16 = torch.cat([x] * 2)[:16]  # AMX takes a full tile where the CPU has it
    assert torch.equal(bits(kernel(w, x16, None, -1)), bits(torch.cat([first] * 2)[:16]))


@needs_kernel
def test_a_path_this_cpu_lacks_is_refused_not_run():
    """Asking for an instruction path the CPU does not have is an error, not an illegal instruction
    that kills the process (on Zen 4, AVX-VNNI lies below the best path and is missing)."""
    w = quant.pack(random_blocks("Q4_1", 16, 64))
    x = rows_of(1, 64, torch.bfloat16)
    for isa in sorted({*ISAS.values(), native.AMX_INT8} - set(paths())) + [4, -2]:
        with pytest.raises(RuntimeError, match="not available on this CPU"):
            kernel(w, x, None, isa)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_thread_count(kind):
    w = quant.pack(random_blocks(kind, 3072, 576, seed=5))
    x = rows_of(16, 576, torch.bfloat16, seed=6)
    with threads(1):
        one_thread = kernel(w, x)
    with threads(2):
        batch = kernel(w, x)
    assert torch.equal(one_thread, batch)
    for t in (0, 5, 15):
        assert torch.equal(kernel(w, x[t:t + 1])[0], batch[t])
    assert torch.equal(kernel(w, x[5:9]), batch[5:9])


def test_the_reference_is_close_to_the_float64_product():
    """8-bit activations cost about a percent of the products' spread, no more."""
    blocks = random_blocks("Q4_1", 64, 576, seed=7)
    x = rows_of(8, 576, torch.float32, seed=8)
    exact = x.double() @ blocks.dequantize().double().T
    ours = quant_reference.qgemm(quant.pack(blocks), x).double()
    assert (ours - exact).abs().max() < 0.02 * exact.abs().max()


@needs_kernel
def test_bad_input_is_refused_with_a_clear_error():
    w = quant.pack(random_blocks("Q8_0", 16, 64))
    k = native.quant().qgemm
    with pytest.raises(RuntimeError, match="x must be a \\[T, 64\\]"):
        k(w.data, 2, 16, 64, torch.zeros(1, 32), None, -1)
    with pytest.raises(RuntimeError, match="uint8 CPU tensor of"):
        k(w.data[:-1], 2, 16, 64, torch.zeros(1, 64), None, -1)
    with pytest.raises(RuntimeError, match="unknown block kind"):
        k(w.data, 7, 16, 64, torch.zeros(1, 64), None, -1)
    with pytest.raises(RuntimeError, match="not available|lacks"):
        k(w.data, 2, 16, 64, torch.zeros(1, 64), None, 9)


# -- the model -----------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_a_model_on_stored_blocks_is_close_to_the_dequantized_one(tiny, qtype):
    m = tiny("llama-gqa")
    path, _ = m.gguf(qtype)
    stored = kvstore.load_model(path, dtype="float32", weights="stored")
    dense = kvstore.load_model(path, dtype="float32", weights="dense")
    assert (stored.weights, dense.weights) == ("stored", "dense")
    ids = m.ids(32)
    a, b = stored.logits(ids), dense.logits(ids)
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@needs_kernel
@pytest.mark.parametrize("name, qtype", [("llama-gqa", Q.Q4_1), ("qwen2-bias", Q.Q4_0), ("gpt2", Q.Q8_0)])
def test_the_native_kernel_and_the_reference_give_a_model_the_same_bits(tiny, monkeypatch, name, qtype):
    """float32 activations: every other op is torch's either way, so the whole forward must agree."""
    m = tiny(name)
    model = kvstore.load_model(m.gguf(qtype)[0], dtype="float32", weights="stored")
    ids = m.ids(24)
    native_logits = model.logits(ids)
    monkeypatch.setattr(native, "_quant_choice", (None, "torch's kernels (test)"))
    assert torch.equal(model.logits(ids), native_logits)


def test_q8_0_on_load_quantizes_every_matrix_of_a_folder(tiny):
    m = tiny("llama-gqa")
    model = kvstore.load_model(m.folder, dtype="float32", weights="q8_0")
    assert model.weights == "q8_0"
    assert isinstance(model.net.layers[0].wqkv, quant.Packed) and isinstance(model.net.embed, quant.Packed)
    dense = kvstore.load_model(m.folder, dtype="float32")
    assert dense.weights == "dense"
    ids = m.ids(16)
    assert (model.logits(ids) - dense.logits(ids)).abs().max() < 0.05 * dense.logits(ids).abs().max()


def test_the_default_holds_a_gguf_files_blocks_where_the_kernels_run(tiny):
    path, _ = tiny("llama-gqa").gguf(Q.Q4_1)
    expected = "stored" if native.quant() is not None else "dense"
    assert kvstore.load_model(path).weights == expected
    assert kvstore.load_model(tiny("llama-gqa").gguf(Q.F16)[0], weights="stored").weights == "dense"  # no blocks
    with pytest.raises(kvstore.errors.ModelError, match="use one of stored, dense, q8_0"):
        kvstore.load_model(path, weights="int4")


def test_residual_and_bias_ride_in_the_one_rounding():
    w = quant.pack(random_blocks("Q8_0", 32, 64))
    x, residual = rows_of(3, 64, torch.bfloat16), rows_of(3, 32, torch.bfloat16, seed=9)
    fused = ops.add_linear(residual, x, w, None)
    assert torch.equal(fused, quant_reference.qgemm(w, x, residual))
    bias = rows_of(1, 32, torch.bfloat16, seed=10)[0]
    assert torch.equal(ops.add_linear(residual, x, w, bias), residual + quant_reference.qgemm(w, x, bias))


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_embedding_rows_read_natively_equal_the_reference(kind, dtype):
    packed = quant.pack(random_blocks(kind, 37, 96, seed=11))
    ids = torch.tensor([36, 0, 17, 16, 36])
    assert torch.equal(ops.embed(ids, packed, dtype), packed.embed(ids, dtype))
    with pytest.raises(RuntimeError, match="row 37 is not in"):
        ops.embed(torch.tensor([37]), packed, dtype)


def test_large_packed_matrices_live_in_huge_pages_and_compute_the_same_bits(monkeypatch):
    """`pack` puts a matrix of 64 KiB or more in `quant.WEIGHT_MEMORY` (huge pages where the system
    has them; ordinary memory elsewhere): the same records either way, so the same products."""
    from kvstore.engine.buffers import HugeArena

    blocks = random_blocks("Q4_1", 512, 576)  # 184 KiB packed
    monkeypatch.setattr(quant, "WEIGHT_MEMORY", HugeArena(least=1 << 60))  # nothing goes to huge pages
    plain = quant.pack(blocks)
    monkeypatch.setattr(quant, "WEIGHT_MEMORY", HugeArena())
    huge = quant.pack(blocks)
    assert torch.equal(plain.data, huge.data) and huge.data.is_contiguous() and huge.data.data_ptr() % 64 == 0
    x = rows_of(3, 576, torch.bfloat16)
    assert torch.equal(ops.qgemm(huge, x), ops.qgemm(plain, x))
