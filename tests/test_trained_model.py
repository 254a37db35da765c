"""Contract C1 on the tiny trained model (conftest's `trained`: real text, no download), through
the library and through the `kvstore` command: closed, killed or interrupted and resumed, a
session produces the tokens and logits bits of a run that never stopped. Its text is text, so its
replies end where a real model's do, at an end-of-sequence token, and a resumed reply ends at the
same one; a chat turn in a new process follows the same template turn as one in the first.
"""

from __future__ import annotations

import itertools
import json
import random
import signal

import pytest

import kvstore
import store_harness as H
from test_cli_e2e import dedup, finish, kvstore as command, trace_lines, wait_for_lines

N_NEW = 48
QUESTIONS = ("heapq.merge", "json.dumps", "bisect.insort", "re.sub", "csv.reader", "textwrap.fill")


@pytest.fixture(scope="module")
def model_path(trained) -> str:
    return str(trained.folder)


@pytest.fixture(scope="module")
def model(model_path):
    return kvstore.load_model(model_path)  # bfloat16, as sessions run by default


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("trained-reference")
    trace = tmp / "reference.jsonl"
    tokens = H.reference_run(tmp / "home", model, "ref", N_NEW, trace, **H.SAMPLED)
    return tokens, H.by_position(H.read_trace(trace))


def new_session(home, model, name="s"):
    store = kvstore.open_store(home)
    s = store.new(name, model, seed=5, chunk_size=16, checkpoint_every=4, **H.SAMPLED)
    s.append_text(H.DOCUMENT)
    return store, s


def test_close_and_reopen_equals_uninterrupted(tmp_path, model, reference):
    store, s = new_session(tmp_path / "home", model)
    H.assert_matches(reference, *H.closed_and_reopened(store, s, model, N_NEW, tmp_path / "t.jsonl"))


def test_resume_in_a_new_process(tmp_path, model_path, model, reference):
    store, s = new_session(tmp_path / "home", model)
    s.close()
    trace = tmp_path / "t.jsonl"
    proc, conn = H.start(H.child_generate, str(tmp_path / "home"), model_path, "s", N_NEW, str(trace), 2)
    H.run_to_end(proc, conn)
    H.assert_matches(reference, store.tokens("s"), H.read_trace(trace))


@pytest.mark.parametrize("round_", range(3))
def test_sigkill_at_a_random_moment_then_resume(tmp_path, model_path, model, reference, round_):
    rng = random.Random(f"trained-{round_}")
    store, s = new_session(tmp_path / "home", model)
    s.close()
    trace = tmp_path / "t.jsonl"
    proc, conn = H.start(H.child_generate, str(tmp_path / "home"), model_path, "s", N_NEW, str(trace), 2)
    H.wait_for(conn, "ready")
    acked = [m for m in H.kill_after(proc, conn, rng.uniform(0.0, 0.2)) if m[0] == "ack"]
    with store.open("s", model) as s:
        if acked:
            assert len(s.tokens) >= acked[-1][2]
        if s.active_call:
            list(s.resume(trace=trace))
        else:
            list(s.generate(len(reference[0]) - len(s.tokens), trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


def chat_ending_at_eos(store, model, max_new: int = 100) -> tuple[str, str, int]:
    """(session, question, seed) of the first chat, over QUESTIONS and seeds, whose reply ends at an
    end-of-sequence token before max_new tokens: the trained model's replies end, a random one's don't."""
    for n, (question, seed) in enumerate(itertools.product(QUESTIONS, range(4))):
        with store.new(f"live-{n}", model, seed=seed, **H.SAMPLED) as s:
            list(s.chat(question, max_new_tokens=max_new))
            if s.tokens[-1] in model.tokenizer.eos_ids and len(s.tokens) - s.messages[-1]["token_start"] < max_new:
                return f"live-{n}", question, seed
    pytest.fail("no reply of the trained model ended at an end-of-sequence token")


def test_a_reply_cut_short_and_resumed_ends_at_the_same_end_of_sequence(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    live, question, seed = chat_ending_at_eos(store, model)
    reply = store.messages(live)[-1]
    with store.new("cut", model, seed=seed, checkpoint_every=4, **H.SAMPLED) as s:
        pieces = s.chat(question, max_new_tokens=100)
        list(itertools.islice(pieces, 2))  # stop mid-reply: the call stays active
        pieces.close()
        assert len(s.tokens) < reply.token_end
    with store.open("cut", model) as s:
        assert s.active_call is not None
        list(s.resume())
        assert s.tokens == store.tokens(live) and s.tokens[-1] in model.tokenizer.eos_ids
        assert s.active_call is None and s.messages[-1]["text"] == reply.text
        after = "".join(s.chat("json.loads", max_new_tokens=24))
    with store.open(live, model) as s:
        assert "".join(s.chat("json.loads", max_new_tokens=24)) == after  # and the turn after it


# -- through the command ----------------------------------------------------------------------------
RAW = ["--raw", "--prompt", "heapq\n-----\nHeap queue algorithm", "--max-new-tokens", "64", "--temperature", "0.9",
       "--checkpoint-every", "4", "--threads", "1"]


def test_the_command_killed_mid_generation_then_continued_equals_uninterrupted(model_path, tmp_path):
    for seed in range(5):  # a seed whose text does not end before the kill (the trained model's texts do end)
        ref_trace = tmp_path / f"ref-{seed}.jsonl"
        finish(command(tmp_path / "ref", "new", f"ref{seed}", "--model", model_path, *RAW, "--seed", str(seed),
                       "--trace", str(ref_trace)))
        ref = trace_lines(ref_trace)
        if len(ref) > 24:
            break
    else:
        pytest.fail("every reference run ended within 24 tokens")
    trace = tmp_path / "run.jsonl"
    p = command(tmp_path / "home", "new", "run", "--model", model_path, *RAW, "--seed", str(seed),
                "--trace", str(trace))
    wait_for_lines(trace, 12, p)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    finish(command(tmp_path / "home", "continue", "run", "--trace", str(trace), "--threads", "1"))
    assert dedup(trace_lines(trace)) == ref


def test_chat_turns_in_two_processes_equal_one_library_session(model_path, model, tmp_path, one_thread):
    home = tmp_path / "home"
    finish(command(home, "new", "c", "--model", model_path, "--prompt", "heapq.merge", "-n", "40", "--seed", "3",
                   "--temperature", "0.9", "--threads", "1"))
    finish(command(home, "continue", "c", "--prompt", "bisect.insort", "-n", "30", "--threads", "1"))
    out, _ = finish(command(home, "history", "c", "--json"))
    turns = json.loads(out)
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    with kvstore.open_store(tmp_path / "lib").new("c", model, seed=3, temperature=0.9) as s:
        replies = ["".join(s.chat("heapq.merge", max_new_tokens=40)),
                   "".join(s.chat("bisect.insort", max_new_tokens=30))]
        assert s.tokens == kvstore.open_store(home).tokens("c")
    assert [turns[1]["text"], turns[3]["text"]] == replies
