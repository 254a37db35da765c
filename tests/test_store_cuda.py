"""Sessions on CUDA (skipped without a CUDA device): byte-identical resume on CUDA, and moving a
session between devices, which restores the identical cache bytes while later logits are only
close (other kernels)."""

from __future__ import annotations

import pytest
import torch

import kvstore
import store_harness as H

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny("llama-gqa").folder


@pytest.mark.parametrize("before", [8, 0])  # resumed from a call's end (last token pending), from the prefill's state
def test_resume_on_cuda_is_byte_identical(tmp_path, folder, before):
    model = kvstore.load_model(folder, device="cuda")
    H.reference_run(tmp_path / "ref", model, "r", 20, tmp_path / "ref.jsonl")
    store = kvstore.open_store(tmp_path / "home")
    with store.new("r", model, seed=5, chunk_size=16, checkpoint_every=4) as s:
        s.append_text(H.DOCUMENT)
        list(s.generate(before, trace=tmp_path / "t.jsonl", stop_at_eos=False))
    with store.open("r", model) as s:
        assert (s.seq.hidden is not None) == (before == 0)
        list(s.generate(20 - before, trace=tmp_path / "t.jsonl", stop_at_eos=False))
    assert H.read_trace(tmp_path / "t.jsonl") == H.read_trace(tmp_path / "ref.jsonl")


@pytest.mark.parametrize("n_new", [4, 0])  # the last token pending, or its state kept (C2)
@pytest.mark.parametrize("saved_on, resumed_on", [("cpu", "cuda"), ("cuda", "cpu")])
def test_moving_between_devices_keeps_the_cache_bytes(tmp_path, folder, saved_on, resumed_on, n_new):
    store = kvstore.open_store(tmp_path / "home")
    first = kvstore.load_model(folder, device=saved_on)
    with store.new("m", first, seed=5) as s:
        s.append_text(H.DOCUMENT)
        list(s.generate(n_new, stop_at_eos=False))
        saved = [t.cpu().clone() for t in s.seq.cache.state()]
        state = s.seq.hidden.cpu().clone() if n_new == 0 else None
        expected = next_logits_of(s)
    second = kvstore.load_model(folder, device=resumed_on)
    with store.open("m", second) as s:
        assert s.seq.cache.device.type == resumed_on
        assert all(torch.equal(a, b.cpu()) for a, b in zip(saved, s.seq.cache.state()))
        if state is not None:
            assert s.seq.hidden.device.type == resumed_on and torch.equal(s.seq.hidden.cpu(), state)
        # other kernels, bfloat16 arithmetic: a logit between 4 and 8 is a multiple of 1/32 apart from
        # the other device's (one such step seen on an H200 against the CPU's native kernels)
        torch.testing.assert_close(next_logits_of(s), expected, rtol=2e-2, atol=1 / 16)


def next_logits_of(session) -> torch.Tensor:
    """The logits that predict the next token, computed on a copy (the session itself stays as it was)."""
    cache = kvstore.KVCache.from_state([t.clone() for t in session.seq.cache.state()])
    hidden = None if session.seq.hidden is None else session.seq.hidden.clone()
    return kvstore.Sequence(session.model, cache, list(session.tokens), hidden=hidden).next_logits()
