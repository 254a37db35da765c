"""Bad model input fails early with the error from kvstore.errors that names the file and tensor.

Unknown architectures, truncated files, missing and mis-shaped tensors, settings we do not
implement: each raises a precise `ModelError` subclass, never a bare exception or a model that runs
with the wrong numbers.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

import kvstore
from engine_models import Q
from kvstore.errors import MissingTensor, ModelError, TensorShapeMismatch, TruncatedFile, UnsupportedModel


def hf_copy(tiny, name, dst):
    """A copy of a tiny model's HF folder that a test may damage."""
    shutil.copytree(tiny(name).folder, dst)
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_safetensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path)


def truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep if keep >= 0 else len(data) + keep])


# -- unknown or unsupported architectures ---------------------------------------------------------
def test_unknown_hf_model_type_is_refused(tiny, tmp_path):
    folder = hf_copy(tiny, "llama-gqa", tmp_path / "m")
    edit_config(folder, model_type="falcon")
    with pytest.raises(UnsupportedModel, match="'falcon'") as e:
        kvstore.load_model(folder)
    assert str(folder) in str(e.value)


def test_unknown_gguf_architecture_is_refused(tiny, tmp_path):
    plan = tiny("llama-gqa").plan()
    plan.arch = "falcon"
    path = plan.write(tmp_path / "falcon.gguf")
    with pytest.raises(UnsupportedModel, match="'falcon'") as e:
        kvstore.load_model(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("change, what", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "yarn"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"num_key_value_heads": 3}, "KV heads"),
])
def test_unsupported_llama_settings_are_refused(tiny, tmp_path, change, what):
    folder = hf_copy(tiny, "llama-gqa", tmp_path / "m")
    edit_config(folder, **change)
    with pytest.raises(UnsupportedModel, match=what):
        kvstore.load_model(folder)


def test_unsupported_gpt2_variant_is_refused(tiny, tmp_path):
    folder = hf_copy(tiny, "gpt2", tmp_path / "m")
    edit_config(folder, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(UnsupportedModel, match="inverse layer"):
        kvstore.load_model(folder)


def test_gguf_with_a_sliding_window_is_refused(tiny, tmp_path):
    plan = tiny("llama-gqa").plan()
    plan.metadata.append(("add_sliding_window", (16,)))
    with pytest.raises(UnsupportedModel, match="sliding"):
        kvstore.load_model(plan.write(tmp_path / "swa.gguf"))


def test_gguf_with_a_sentencepiece_tokenizer_is_refused(tiny, tmp_path):
    plan = tiny("llama-gqa").plan()
    plan.metadata = [(m, a) if m != "add_tokenizer_model" else (m, ("llama",)) for m, a in plan.metadata]
    with pytest.raises(UnsupportedModel, match="tokenizer model 'llama'"):
        kvstore.load_model(plan.write(tmp_path / "spm.gguf"))


# -- truncated and unreadable files ------------------------------------------------------------------
@pytest.mark.parametrize("keep", [-1, -5000, 100, 8])
def test_truncated_gguf_is_reported_as_truncated(tiny, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    shutil.copy(tiny("llama-gqa").gguf(Q.Q8_0)[0], path)
    truncate(path, keep)
    with pytest.raises(TruncatedFile) as e:
        kvstore.load_model(path)
    assert str(path) in str(e.value)


def test_truncated_gguf_message_says_truncated_and_what_to_do(tiny, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(tiny("gpt2").gguf()[0], path)
    truncate(path, -1)
    with pytest.raises(TruncatedFile, match="truncated.*download it again"):
        kvstore.load_model(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(4096))
    with pytest.raises(TruncatedFile, match="not a readable GGUF"):
        kvstore.load_model(path)


@pytest.mark.parametrize("keep", [-1, -3000, 20])
def test_truncated_safetensors_is_reported_as_truncated(tiny, tmp_path, keep):
    folder = hf_copy(tiny, "qwen2-bias", tmp_path / "m")
    truncate(folder / "model.safetensors", keep)
    with pytest.raises(TruncatedFile) as e:
        kvstore.load_model(folder)
    assert "model.safetensors" in str(e.value)


# -- missing and mis-shaped tensors ----------------------------------------------------------------
def test_missing_gguf_tensor_is_named(tiny, tmp_path):
    plan = tiny("llama-gqa").plan()
    del plan.tensors["blk.1.ffn_down.weight"]
    path = plan.write(tmp_path / "missing.gguf")
    with pytest.raises(MissingTensor, match=r"'blk\.1\.ffn_down\.weight'") as e:
        kvstore.load_model(path)
    assert str(path) in str(e.value)


def test_missing_safetensors_tensor_is_named(tiny, tmp_path):
    folder = hf_copy(tiny, "linear-rope", tmp_path / "m")
    edit_safetensors(folder, lambda t: t.pop("model.layers.0.self_attn.o_proj.bias"))
    with pytest.raises(MissingTensor, match=r"'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        kvstore.load_model(folder)


def test_missing_shard_of_a_sharded_folder_is_named(tiny, tmp_path):
    m = tiny("llama-gqa")
    folder = tmp_path / "sharded"
    m.hf.save_pretrained(folder, max_shard_size="40KB")
    shutil.copy(m.folder / "tokenizer.json", folder)
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(MissingTensor, match=victim.name):
        kvstore.load_model(folder)


def test_untied_model_without_its_output_tensor_is_refused(tiny, tmp_path):
    folder = hf_copy(tiny, "qwen2-bias", tmp_path / "m")
    edit_safetensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensor, match="lm_head.weight"):
        kvstore.load_model(folder)


@pytest.mark.parametrize("tensor, rows", [("blk.0.attn_k.weight", 30), ("blk.1.ffn_up.weight", 96),
                                          ("blk.0.attn_norm.weight", None)])
def test_misshaped_gguf_tensor_is_named(tiny, tmp_path, tensor, rows):
    plan = tiny("llama-gqa").plan()
    array, raw = plan.tensors[tensor]
    plan.tensors[tensor] = (array[:rows] if rows else array[:-1], raw)
    path = plan.write(tmp_path / "bad-shape.gguf")
    with pytest.raises(TensorShapeMismatch, match=tensor.replace(".", r"\.")) as e:
        kvstore.load_model(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name, tensor", [("llama-gqa", "model.layers.1.self_attn.q_proj.weight"),
                                          ("gpt2", "h.0.attn.c_attn.weight")])
def test_misshaped_safetensors_tensor_is_named(tiny, tmp_path, name, tensor):
    folder = hf_copy(tiny, name, tmp_path / "m")

    def shrink(tensors):
        key = tensor if tensor in tensors else "transformer." + tensor
        tensors[key] = tensors[key][:, :-8].contiguous()

    edit_safetensors(folder, shrink)
    with pytest.raises(TensorShapeMismatch, match=tensor.replace(".", r"\.")):
        kvstore.load_model(folder)


def test_rope_freqs_of_the_wrong_length_are_refused(tiny, tmp_path):
    plan = tiny("llama3-rope").plan()
    plan.tensors["rope_freqs.weight"] = (np.ones(1, dtype=np.float32), None)
    with pytest.raises(TensorShapeMismatch, match="rope_freqs"):
        kvstore.load_model(plan.write(tmp_path / "rope.gguf"))


# -- the spec itself ---------------------------------------------------------------------------------
def test_missing_path_and_unknown_dtype_are_refused(tiny, tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        kvstore.load_model(tmp_path / "nowhere")
    with pytest.raises(ModelError, match="dtype"):
        kvstore.load_model(tiny("gpt2").folder, dtype="int8")


def test_folder_without_weights_or_config_is_refused(tiny, tmp_path):
    folder = hf_copy(tiny, "gpt2", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="safetensors"):
        kvstore.load_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json"):
        kvstore.load_model(folder)


def test_cuda_without_cuda_is_a_clear_error(tiny, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="CUDA is not available"):
        kvstore.load_model(tiny("gpt2").folder, device="cuda")
