"""Weight reading details: every GGUF type the gguf package can dequantize loads with the right shape
and values, and llama.cpp's Q/K row permutation is undone exactly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine_models import llama_cpp_permute
from kvstore.engine.models.llama import unpermute_rows
from kvstore.engine.weights import dequantize_gguf, open_gguf

Q = gguf.GGMLQuantizationType
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def write_one(path, name, array, raw=None):
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (t,) = open_gguf(path).tensors
    return t


@pytest.mark.parametrize("qtype", K_QUANTS + [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_blocks_dequantize_to_the_packages_values_in_pytorch_shape(tmp_path, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    # random blocks; bytes below 0x70 keep every fp16 scale in them finite (no inf/NaN exponent)
    raw = np.random.default_rng(0).integers(0, 0x70, (rows, cols // block * size), dtype=np.uint8)
    t = write_one(tmp_path / "one.gguf", "blk.0.ffn_up.weight", raw, qtype)
    got = dequantize_gguf(t, torch.float32)
    assert got.shape == (rows, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype, dtype", [(Q.F32, np.float32), (Q.F16, np.float16)])
def test_float_tensors_load_exactly(tmp_path, qtype, dtype):
    array = np.random.default_rng(1).standard_normal((4, 32)).astype(dtype)
    t = write_one(tmp_path / "f.gguf", "blk.0.attn_q.weight", array)
    assert t.tensor_type == qtype
    assert torch.equal(dequantize_gguf(t, torch.float32), torch.from_numpy(array.astype(np.float32)))


def test_bf16_tensors_load_exactly_and_own_their_memory(tmp_path):
    values = torch.randn(4, 32).to(torch.bfloat16)
    raw = values.view(torch.int16).numpy().view(np.uint8)
    t = write_one(tmp_path / "b.gguf", "blk.0.attn_q.weight", raw, Q.BF16)
    got = dequantize_gguf(t, torch.bfloat16)
    assert torch.equal(got, values)
    got.add_(1)  # a view of the read-only file map would crash here


@pytest.mark.parametrize("heads, head_dim, cols", [(1, 4, 3), (4, 16, 8), (3, 64, 5)])
def test_unpermute_undoes_llama_cpp_permutation(heads, head_dim, cols):
    w = torch.randn(heads * head_dim, cols)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, heads), w)
    bias = torch.randn(heads * head_dim)
    assert torch.equal(unpermute_rows(torch.from_numpy(llama_cpp_permute(bias.numpy(), heads)), heads), bias)
