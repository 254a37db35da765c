"""The converted-weights cache: a GGUF file is parsed and dequantized once per (file, dtype), in
the per-user models folder ($KVSTORE_MODELS here: one per test).

A load from the cache gives the same model (tensors, config, tokenizer, fingerprint, logits bits)
as a conversion; a changed source file is never served from a stale entry; a damaged entry is a
miss and gets rewritten; a folder that cannot be written still loads.
"""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
import torch

import kvstore
from kvstore.engine import weight_cache
from kvstore.engine import weights

Q = gguf.GGMLQuantizationType


@pytest.fixture
def gguf_file(tiny, tmp_path):
    """A private copy of a tiny quantized Llama GGUF (tests change and damage it)."""
    src, _ = tiny("llama-gqa").gguf(Q.Q8_0)
    dst = tmp_path / "model.gguf"
    shutil.copy(src, dst)
    return dst


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A fresh per-user models folder for this test."""
    folder = tmp_path / "models"
    monkeypatch.setenv("KVSTORE_MODELS", str(folder))
    return folder


def entries(models):
    return sorted((models / "cache").glob("*.safetensors"))


def no_gguf_reads(monkeypatch):
    def refuse(path):
        raise AssertionError(f"{path} was parsed although its converted weights are cached")

    monkeypatch.setattr(weights, "open_gguf", refuse)
    monkeypatch.setattr(kvstore.engine.model, "open_gguf", refuse)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_comes_from_the_cache_and_is_the_same_model(gguf_file, models, monkeypatch, dtype):
    home = models
    first = kvstore.load_model(gguf_file, dtype=dtype)
    assert len(entries(home)) == 1
    no_gguf_reads(monkeypatch)
    second = kvstore.load_model(gguf_file, dtype=dtype)
    assert second.config == first.config
    assert second.fingerprint == first.fingerprint
    text = "The fox resumes its run: keys and values stay cached."
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    ids = first.tokenizer.encode(text)
    assert torch.equal(second.logits(ids), first.logits(ids))


def test_each_dtype_has_its_own_entry(gguf_file, models):
    home = models
    kvstore.load_model(gguf_file, dtype="float32")
    kvstore.load_model(gguf_file, dtype="bfloat16")
    names = [p.name for p in entries(home)]
    assert len(names) == 2 and any("float32" in n for n in names) and any("bfloat16" in n for n in names)


def test_a_changed_source_file_is_converted_again(gguf_file, models, tmp_path, tiny, monkeypatch):
    home = models
    before = kvstore.load_model(gguf_file, dtype="float32")
    plan = tiny("llama-gqa").plan(Q.F32)  # the same model stored unquantized: other weight bits
    st = gguf_file.stat()
    plan.write(gguf_file)
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    after = kvstore.load_model(gguf_file, dtype="float32")
    assert after.fingerprint != before.fingerprint
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "other-models"))  # converts afresh
    fresh = kvstore.load_model(gguf_file, dtype="float32")
    ids = list(range(4, 40))
    assert torch.equal(after.logits(ids), fresh.logits(ids))
    assert not torch.equal(after.logits(ids), before.logits(ids))
    assert len(entries(home)) == 1, "the entry of the old file is dropped"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign-header"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(gguf_file, models, damage):
    home = models
    good = kvstore.load_model(gguf_file, dtype="float32")
    (entry,) = entries(home)
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\xff" * 64 + data[64:])
    else:
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(2)}, str(entry), metadata={"magic": "something else"})
    again = kvstore.load_model(gguf_file, dtype="float32")
    ids = list(range(4, 40))
    assert torch.equal(again.logits(ids), good.logits(ids))
    assert weight_cache.load(entry, torch.float32, weight_cache_hash(gguf_file, home)) is not None


def weight_cache_hash(path, home):
    from kvstore.engine.fingerprint import file_hash

    return file_hash(path, home / "fingerprints.json")


def test_an_unwritable_cache_folder_only_costs_speed(gguf_file, models):
    models.mkdir(parents=True)
    (models / "cache").write_text("not a folder")  # mkdir of the cache folder fails
    model = kvstore.load_model(gguf_file, dtype="float32")
    assert model.logits([5, 6, 7]).shape[0] == 3
    assert not list(models.glob(".*.tmp"))
