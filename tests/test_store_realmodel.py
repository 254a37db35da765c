"""The real default model (SmolLM2, bfloat16) through the store, and what holds across thread
counts: a session saved by a process running 2 threads and resumed by one running 1 thread decodes
the same bits (decode is one token at a time); a prefill computed with another thread count may
differ in bits, so an interrupted prefill must resume with the same thread count (see README)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import store_harness as H

pytestmark = pytest.mark.realmodel

SCRIPT = textwrap.dedent("""
    import sys, torch, kvstore
    home, model_path, action, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(threads)
    model = kvstore.load_model(model_path)
    store = kvstore.open_store(home)
    if action == "new":
        with store.new("t", model, seed=1, temperature=0.8) as s:
            s.append_text(open(kvstore.session.__file__).read()[:2500])
            list(s.generate(4, stop_at_eos=False))
    else:
        with store.open("t", model) as s:
            list(s.generate(12, trace=sys.argv[5], stop_at_eos=False))
""")


def run(*args):
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_real_model_resume_decodes_identically_with_one_or_two_threads(tmp_path, smollm2_path):
    import shutil

    run(tmp_path / "a", smollm2_path, "new", 2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    run(tmp_path / "a", smollm2_path, "continue", 2, tmp_path / "two.jsonl")
    run(tmp_path / "b", smollm2_path, "continue", 1, tmp_path / "one.jsonl")
    two, one = H.read_trace(tmp_path / "two.jsonl"), H.read_trace(tmp_path / "one.jsonl")
    assert len(two) == 12 and one == two
