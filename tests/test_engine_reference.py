"""Our forward equals transformers' on tiny random models, from HF folders and from GGUF files.

Each architecture the engine claims (Llama with grouped-query attention and tied embeddings, Qwen2's
q/k/v bias, Llama-3 rope scaling, linear rope scaling with o/mlp biases and a head_dim apart from
hidden/heads, Mistral, GPT-2) is built from a transformers config, saved both ways, loaded by
`kvstore.load_model` in float32 and compared logit by logit.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

import kvstore
from engine_models import SPECS, Q

pytestmark = pytest.mark.usefixtures("one_thread")
ARCHS = list(SPECS)


def ours(path, dtype="float32"):
    """Dense weights: these tests hold the dequantizer and the forward to transformers' (the stored,
    block-quantized path has its own tests: tests/test_quant.py)."""
    return kvstore.load_model(path, dtype=dtype, weights="dense")


@pytest.mark.parametrize("name", ARCHS)
def test_hf_folder_logits_equal_transformers(tiny, name):
    m = tiny(name)
    ids = m.ids(48)
    assert_close(ours(m.folder).logits(ids), m.reference_logits(ids))


@pytest.mark.parametrize("name", ARCHS)
def test_gguf_logits_equal_transformers(tiny, name):
    m = tiny(name)
    path, reference = m.gguf(Q.F32)
    ids = m.ids(48)
    assert_close(ours(path).logits(ids), m.reference_logits(ids, reference))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_quantized_llama_gguf_equals_transformers_on_dequantized_weights(tiny, qtype):
    m = tiny("llama-gqa")
    path, reference = m.gguf(qtype)
    ids = m.ids(32)
    assert_close(ours(path).logits(ids), m.reference_logits(ids, reference))


@pytest.mark.parametrize("name", ["qwen2-bias", "llama3-rope", "linear-rope", "gpt2"])
def test_q8_0_gguf_of_other_architectures_equals_transformers(tiny, name):
    m = tiny(name)
    path, reference = m.gguf(Q.Q8_0)
    ids = m.ids(32)
    assert_close(ours(path).logits(ids), m.reference_logits(ids, reference))


def test_quantized_weights_really_differ_from_the_originals(tiny):
    """Guards the test above: the dequantized reference is not the float32 model in disguise."""
    m = tiny("llama-gqa")
    _, reference = m.gguf(Q.Q4_0)
    ids = m.ids(16)
    assert not torch.allclose(m.reference_logits(ids, reference), m.reference_logits(ids), atol=1e-3)


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_gguf_and_hf_folder_give_the_same_model(tiny, name):
    m = tiny(name)
    a, b = ours(m.folder), ours(m.gguf(Q.F32)[0])
    fields = ("arch", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
              "intermediate_size", "max_context", "tie_embeddings")
    assert [getattr(a.config, f) for f in fields] == [getattr(b.config, f) for f in fields]
    ids = m.ids(24)
    assert_close(a.logits(ids), b.logits(ids))


def test_sharded_safetensors_folder_loads_like_a_single_file(tiny, tmp_path):
    m = tiny("qwen2-bias")
    folder = tmp_path / "sharded"
    m.hf.save_pretrained(folder, max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((m.folder / f).read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = m.ids(24)
    assert torch.equal(ours(folder).logits(ids), ours(m.folder).logits(ids))


@pytest.mark.parametrize("dtype, atol, rtol", [("bfloat16", 0.15, 0.05), ("float16", 0.02, 0.01)])
def test_half_precision_logits_are_close_to_float32(tiny, dtype, atol, rtol):
    m = tiny("llama-gqa")
    ids = m.ids(32)
    half = ours(m.folder, dtype)
    assert half.dtype == getattr(torch, dtype)
    logits = half.logits(ids)
    assert logits.dtype == torch.float32
    assert_close(logits, m.reference_logits(ids), atol=atol, rtol=rtol)


def test_default_dtype_is_bfloat16(tiny):
    assert kvstore.load_model(tiny("gpt2").folder).dtype == torch.bfloat16


def test_config_is_read_from_both_sources(tiny):
    m = tiny("llama3-rope")
    for model in (ours(m.folder), ours(m.gguf(Q.F32)[0])):
        c = model.config
        assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 2, 4, 1, 16)
        assert c.vocab_size == m.vocab_size
    assert ours(m.folder).config.rope_scaling["rope_type"] == "llama3"


def test_fingerprint_depends_on_the_weights(tiny):
    a = tiny("llama-gqa")
    assert ours(a.folder).fingerprint == ours(a.folder).fingerprint
    assert ours(a.folder).fingerprint != ours(a.gguf(Q.Q8_0)[0]).fingerprint
    assert ours(a.gguf(Q.F32)[0]).fingerprint != ours(a.gguf(Q.Q8_0)[0]).fingerprint


@pytest.mark.parametrize("name, qtype", [("llama-gqa", Q.Q8_0), ("qwen2-bias", Q.F32)])
def test_transformers_reads_the_test_gguf_as_the_same_model(tiny, name, qtype):
    """Guards the fixture writer: its llama.cpp conventions (Q/K permutation for llama, none for
    qwen2, names, tokenizer section) are the ones transformers' own GGUF reader undoes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine_models import SAMPLE_TEXT

    m = tiny(name)
    path, reference = m.gguf(qtype)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = m.ids(24)
    assert_close(m.reference_logits(ids, hf), m.reference_logits(ids, reference))
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert hf_tok.encode(SAMPLE_TEXT, add_special_tokens=False) == m.tokenizer.encode(SAMPLE_TEXT).ids


def test_a_mistral_sliding_window_bounds_the_context(tiny, tmp_path):
    """Attention within a window equals full attention up to the window's size: the context ends there."""
    import shutil

    folder = tmp_path / "windowed"
    shutil.copytree(tiny("mistral").folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"sliding_window": 32}))
    model = ours(folder)
    assert model.config.max_context == 32
    ids = tiny("mistral").ids(32)
    assert_close(model.logits(ids), tiny("mistral").reference_logits(ids))
    with pytest.raises(kvstore.errors.ModelError, match="context"):
        model.logits(ids + ids[:1])
