"""The `kvstore` command through click's CliRunner, in a private home per test (conftest's autouse).

Every command on its normal path, then every error path: one line `Error: ...`, exit status 1 (2 for
usage errors), never a traceback. Models are tiny random ones (engine_models), so replies are
gibberish; what is checked is what was stored, streamed and reported.
"""

from __future__ import annotations

import json
import os
import signal
import traceback

import pytest
import torch
from click.testing import CliRunner

import engine_models
import kvstore
from kvstore.session import Session
from kvstore_cli import render
from kvstore_cli.main import cli

SEEDED = ["--temperature", "0.9", "--seed", "7"]


@pytest.fixture(scope="module")
def model_dir(tiny) -> str:
    return str(tiny("llama-gqa").folder)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory, tiny_tokenizer) -> str:
    """The same architecture and shapes as model_dir, other weights."""
    workdir = tmp_path_factory.mktemp("other-weights")
    return str(engine_models.build_tiny_model("llama-gqa", workdir, tiny_tokenizer, seed=1).folder)


def kv(*args: str, code: int = 0, input: str | None = None):
    """Run `kvstore ARGS`; check the exit status; never a traceback."""
    result = CliRunner().invoke(cli, list(args), input=input)
    shown = f"kvstore {' '.join(args)} -> {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    if result.exc_info and not isinstance(result.exception, SystemExit):
        shown += "\n" + "".join(traceback.format_exception(*result.exc_info))
    assert result.exit_code == code, shown
    assert "Traceback" not in result.output, shown
    return result


def info(name: str) -> dict:
    return json.loads(kv("show", name, "--json").stdout)


def store():
    return kvstore.open_store()


def make(name: str, model_dir: str, *extra: str, prompt: str = "hello there", n: int = 8):
    return kv("new", name, "--model", model_dir, "--prompt", prompt, "-n", str(n), *extra)


# -- new -------------------------------------------------------------------------------------------
def test_new_chat_streams_the_reply_and_stores_the_turn(model_dir):
    r = make("s", model_dir, *SEEDED, n=12)
    messages = store().messages("s")
    assert [(m.role, m.text) for m in messages][0] == ("user", "hello there")
    reply = messages[1]
    assert reply.role == "assistant" and r.stdout in (reply.text, reply.text + "\n")
    i = info("s")
    assert i["n_tokens"] == reply.token_end and i["sampler"]["temperature"] == 0.9 and i["seed"] == 7
    assert i["active_call"] is None


def test_new_raw_from_a_file_from_stdin_and_with_a_system_prompt(model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog.")
    kv("new", "from-file", "--model", model_dir, "--raw", "--file", str(doc), "-n", "0")
    assert store().tokens("from-file") == kvstore.load_model(model_dir).tokenizer.encode(doc.read_text())
    kv("new", "from-stdin", "--model", model_dir, "--raw", "-n", "0", input=doc.read_text())
    assert store().tokens("from-stdin") == store().tokens("from-file")
    kv("new", "sys", "--model", model_dir, "--system", "Be brief.", "-p", "hi", "-n", "2")
    assert [m.role for m in store().messages("sys")][:2] == ["system", "user"]


def test_new_without_input_creates_an_empty_session(model_dir):
    r = kv("new", "empty", "--model", model_dir)
    assert "created session 'empty'" in r.stderr and r.stdout == ""
    assert info("empty")["n_tokens"] == 0


def test_new_records_checkpoint_every_and_writes_a_trace(model_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    kv("new", "t", "--model", model_dir, "-p", "hi", "-n", "10", "--checkpoint-every", "3",
       "--trace", str(trace), *SEEDED)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    tokens = store().tokens("t")
    assert [x["token"] for x in lines] == tokens[len(tokens) - len(lines):]
    assert all(len(x["logits_sha256"]) == 64 for x in lines)
    assert info("t")["checkpoints"] >= 1 + 10 // 3


def test_logit_bias_forces_or_bans_tokens_and_stays_the_sessions_setting(model_dir, tmp_path):
    trace = tmp_path / "b.jsonl"
    kv("new", "b", "--model", model_dir, "--raw", "-p", "hello", "-n", "5", "--logit-bias", "5=100",
       "--logit-bias", "9=-100", "--trace", str(trace), *SEEDED)
    assert [json.loads(x)["token"] for x in trace.read_text().splitlines()] == [5] * 5
    assert info("b")["sampler"]["logit_bias"] == [[5, 100.0], [9, -100.0]]
    kv("continue", "b", "-n", "3", "--logit-bias", "5=0")
    assert info("b")["sampler"]["logit_bias"] == [[5, 0.0]]  # replaced, not merged
    for bad, why in (("5", "is not ID=BIAS"), ("x=1", "is not ID=BIAS"), ("5=101", "logit_bias maps token ids"),
                     ("99999=1", "logit_bias names token id 99999")):
        r = kv("continue", "b", "-n", "1", "--logit-bias", bad, code=2 if "ID=BIAS" in why else 1)
        assert why in r.output, r.output
    assert info("b")["sampler"]["logit_bias"] == [[5, 0.0]]


def test_continue_checkpoint_every_is_saved_like_the_sampling_overrides(model_dir):
    """`continue --checkpoint-every N` applies to this run and stays the session's setting, as
    `--temperature` does; a later `continue` without it keeps N."""
    make("ce", model_dir, n=2)
    assert info("ce")["checkpoint_every"] == kvstore.DEFAULT_CHECKPOINT_EVERY
    kv("continue", "ce", "-n", "9", "--checkpoint-every", "3", "--temperature", "0.5")
    i = info("ce")
    assert i["checkpoint_every"] == 3 and i["sampler"]["temperature"] == 0.5
    before = i["checkpoints"]
    kv("continue", "ce", "-n", "9")
    after = info("ce")
    assert after["checkpoint_every"] == 3 and after["checkpoints"] - before >= 9 // 3


@pytest.mark.parametrize("raw", [True, False])
def test_new_with_an_input_longer_than_the_context_creates_nothing(model_dir, tmp_path, raw):
    """The tiny model's context is 256 tokens: a longer input is refused before a session exists."""
    big = tmp_path / "big.txt"
    big.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    message = error("new", "big", "--model", model_dir, "--file", str(big), *(["--raw"] if raw else []))
    assert "exceed the model's context of 256" in message and "start a new session with less text" in message
    assert store().names() == []
    make("big", model_dir)  # the name is still free


def test_new_with_an_empty_raw_input_creates_nothing(model_dir):
    """Raw text of no tokens is refused before a session exists (it once left an empty session behind,
    whose name the retry then found taken); no input at all still makes an empty session."""
    assert kvstore.load_tokenizer(model_dir).encode("") == []
    message = error("new", "empty", "--model", model_dir, "--raw", "-p", "")
    assert "the input is empty" in message and "-p, -f or stdin" in message
    assert store().names() == []
    kv("new", "empty", "--model", model_dir, "--raw", "-p", "Some text.", "-n", "2")  # the name is still free
    kv("new", "no-input", "--model", model_dir)
    assert info("no-input")["n_tokens"] == 0


def test_new_reads_in_chunks_of_the_chosen_size(model_dir):
    text = "The quick brown fox jumps over the lazy dog. " * 4
    kv("new", "chunked", "--model", model_dir, "--raw", "-p", text, "-n", "0", "--chunk-size", "8")
    i = info("chunked")
    assert i["chunk_size"] == 8 and i["checkpoints"] >= (i["n_tokens"] - 1) // 8
    assert "every 8 tokens read" in kv("show", "chunked").stdout
    kv("new", "default-chunks", "--model", model_dir, "-p", "hi", "-n", "0")
    assert info("default-chunks")["chunk_size"] == 512


def test_verbose_timings_go_to_stderr_only(model_dir):
    r = make("v", model_dir, "--verbose")
    assert "model:" in r.stderr and "decode:" in r.stderr
    assert "kvstore:" not in r.stdout
    r = kv("continue", "v", "-p", "again", "-n", "4", "--verbose")
    assert "restore:" in r.stderr and "no prefill" in r.stderr


def test_a_first_build_of_the_decode_kernel_is_announced(model_dir, monkeypatch):
    from kvstore.engine import native

    monkeypatch.setattr(native, "will_build", lambda: True)
    r = make("k", model_dir)
    assert "compiling kvstore's native kernels, once for this machine" in r.stderr
    monkeypatch.setattr(native, "will_build", lambda: False)
    assert "compiling" not in kv("continue", "k", "-p", "again", "-n", "2").stderr
    assert "compiling" not in make("k32", model_dir, "--dtype", "float32").stderr


def test_prefill_bar_with_tokens_per_second_on_a_terminal(model_dir, monkeypatch):
    monkeypatch.setattr(render, "stderr_is_terminal", lambda: True)
    monkeypatch.setattr(render, "LONG_INPUT", 8)
    r = kv("new", "bar", "--model", model_dir, "--raw", "-p", "The quick brown fox jumps over the lazy dog. " * 3,
           "-n", "2", "--verbose")
    assert "tok/s" in r.stderr and "prefill" in r.stderr


def test_export_import_pack_and_verify_draw_byte_bars_on_a_terminal(model_dir, monkeypatch, tmp_path):
    make("big", model_dir)
    monkeypatch.setattr(render, "stderr_is_terminal", lambda: True)
    monkeypatch.setattr(render, "LONG_BYTES", 1)
    archive = str(tmp_path / "big.kvs")
    for label, args in [("export", ["export", "big", "-o", archive]), ("import", ["import", archive, "--as", "copy"]),
                        ("pack", ["pack", "copy"]), ("verify", ["verify"])]:
        r = kv(*args)
        assert label in r.stderr and "/s" in r.stderr, (label, r.stderr)
        assert label not in r.stdout
    monkeypatch.setattr(render, "LONG_BYTES", 1 << 40)  # a short job draws nothing
    assert kv("verify").stderr == ""


def test_threads_option_sets_torch_threads(model_dir):
    before = torch.get_num_threads()
    try:
        make("threads", model_dir, "--threads", "1", n=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- continue --------------------------------------------------------------------------------------
def test_continue_adds_a_chat_turn(model_dir):
    make("c", model_dir)
    before = info("c")["n_tokens"]
    kv("continue", "c", "-p", "and then?", "-n", "4")
    roles = [m.role for m in store().messages("c")]
    assert roles == ["user", "assistant", "user", "assistant"] and info("c")["n_tokens"] > before


def test_continue_without_input_keeps_generating_identically(model_dir):
    """new -n 6 then continue -n 6 equals new -n 12 (raw, seeded sampling, no EOS in the way)."""
    args = ["--raw", "-p", "The fox resumes its run", *SEEDED]
    kv("new", "whole", "--model", model_dir, *args, "-n", "12")
    kv("new", "split", "--model", model_dir, *args, "-n", "6")
    kv("continue", "split", "-n", "6")
    whole = store().tokens("whole")
    assert len(whole) == len(kvstore.load_model(model_dir).tokenizer.encode("The fox resumes its run")) + 12
    assert store().tokens("split") == whole


def test_continue_finishes_an_interrupted_reply(model_dir):
    make("ref", model_dir, *SEEDED, n=30)
    model = kvstore.load_model(model_dir)
    with store().new("cut", model, seed=7, temperature=0.9) as s:
        reply = s.chat("hello there", max_new_tokens=30)
        for _ in range(5):
            next(reply)
        reply.close()  # stopped mid-reply: checkpointed with the generation still pending
    assert info("cut")["active_call"] is not None
    r = kv("continue", "cut")
    assert store().tokens("cut") == store().tokens("ref")
    assert info("cut")["active_call"] is None and r.stdout


def test_ctrl_c_checkpoints_exits_130_and_continue_finishes(model_dir, monkeypatch):
    make("ref", model_dir, *SEEDED, n=30)
    real_chat = Session.chat

    def chat_then_ctrl_c(self, *args, **kwargs):
        for i, piece in enumerate(real_chat(self, *args, **kwargs)):
            yield piece
            if i == 3:
                raise KeyboardInterrupt

    monkeypatch.setattr(Session, "chat", chat_then_ctrl_c)
    r = kv("new", "int", "--model", model_dir, "-p", "hello there", "-n", "30", *SEEDED, code=130)
    assert "stopped" in r.stderr and "kvstore continue int" in r.stderr
    monkeypatch.setattr(Session, "chat", real_chat)
    kv("continue", "int")
    assert store().tokens("int") == store().tokens("ref")


def test_a_raw_prompt_stopped_while_it_is_read_is_finished_by_continue_never_read_twice(model_dir, monkeypatch):
    """Raw text and the generation after it are one recorded call (`Session.begin`): Ctrl-C while the
    text is read leaves the call, which `continue` finishes with its own length and settings, the
    text read once (as the same `new` uninterrupted)."""
    args = ["--raw", "-p", "The quick brown fox jumps over the lazy dog. " * 4, *SEEDED, "-n", "6", "--chunk-size", "8"]
    kv("new", "ref", "--model", model_dir, *args)
    real = Session.finish_prefill

    def first_chunk_then_ctrl_c(self, *, progress=None):
        def chunk_read(done, total):
            progress(done, total)
            raise KeyboardInterrupt
        return real(self, progress=chunk_read)

    monkeypatch.setattr(Session, "finish_prefill", first_chunk_then_ctrl_c)
    r = kv("new", "cut", "--model", model_dir, *args, code=130)
    assert "kvstore continue cut" in r.stderr
    monkeypatch.setattr(Session, "finish_prefill", real)
    cut = info("cut")
    assert cut["active_call"] is not None and 0 < cut["checkpoints"] and len(store().tokens("cut")) < len(store().tokens("ref"))
    kv("continue", "cut")
    assert store().tokens("cut") == store().tokens("ref") and info("cut")["active_call"] is None


def test_sigterm_stops_after_the_current_token_and_exits_143(model_dir, monkeypatch):
    make("ref", model_dir, *SEEDED, n=30)
    real_chat = Session.chat

    def chat_then_sigterm(self, *args, **kwargs):
        for i, piece in enumerate(real_chat(self, *args, **kwargs)):
            if i == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the CLI's handler only records it
            yield piece

    monkeypatch.setattr(Session, "chat", chat_then_sigterm)
    r = kv("new", "term", "--model", model_dir, "-p", "hello there", "-n", "30", *SEEDED, code=143)
    assert "stopped" in r.stderr and info("term")["active_call"] is not None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored
    monkeypatch.setattr(Session, "chat", real_chat)
    kv("continue", "term")
    assert store().tokens("term") == store().tokens("ref")


def test_sampling_options_on_continue_are_kept(model_dir):
    make("samp", model_dir)
    kv("continue", "samp", "-p", "more", "-n", "2", "--temperature", "0.5", "--top-k", "5")
    sampler = info("samp")["sampler"]
    assert sampler["temperature"] == 0.5 and sampler["top_k"] == 5


# -- the other verbs -------------------------------------------------------------------------------
def test_list_table_json_and_empty(model_dir):
    r = kv("list")
    assert r.stdout == "" and "no sessions" in r.stderr
    make("b", model_dir)
    make("a", model_dir)
    lines = kv("list").stdout.splitlines()
    assert lines[0].split()[:2] == ["NAME", "TOKENS"] and [x.split()[0] for x in lines[1:]] == ["a", "b"]
    records = json.loads(kv("list", "--json").stdout)
    assert [x["name"] for x in records] == ["a", "b"] and all(x["disk_bytes"] > 0 for x in records)


def test_list_pages_with_limit_and_after_and_says_on_stderr_how_to_get_the_next_page(model_dir):
    make("doc", model_dir, n=2)
    for name in ("b", "c", "d", "e"):
        kv("fork", "doc", name)
    r = kv("list", "--limit", "2")
    assert [x.split()[0] for x in r.stdout.splitlines()] == ["NAME", "b", "c"]
    assert "kvstore list --limit 2 --after c" in r.stderr
    r = kv("list", "--json", "--limit", "2", "--after", "c")
    assert [x["name"] for x in json.loads(r.stdout)] == ["d", "doc"]  # stdout stays JSON
    assert "kvstore list --json --limit 2 --after doc" in r.stderr
    r = kv("list", "--json", "--limit", "2", "--after", "doc")
    assert [x["name"] for x in json.loads(r.stdout)] == ["e"] and "more" not in r.stderr
    r = kv("list", "--after", "e")
    assert r.stdout == "" and "no sessions after 'e'" in r.stderr
    kv("list", "--limit", "0", code=2)


def test_list_without_a_limit_streams_every_page_as_one_listing(model_dir, monkeypatch):
    from kvstore_cli import manage

    make("doc", model_dir, n=2)
    for i in range(6):
        kv("fork", "doc", f"fork-{i}" + "x" * i)  # later pages have longer names
    monkeypatch.setattr(manage.Listing, "PAGE", 2)
    expected = [i.to_dict() for i in store().list()]
    assert kv("list", "--json").stdout == json.dumps(expected, indent=2, ensure_ascii=False) + "\n"
    lines = kv("list").stdout.splitlines()
    assert [x.split()[0] for x in lines] == ["NAME"] + [e["name"] for e in expected]
    starts = [x.index(x.split()[1], len(x.split()[0])) for x in lines]  # where the TOKENS column begins
    assert starts[0] == starts[1] and starts == sorted(starts) and starts[-1] > starts[0]  # widened, never narrowed


def test_list_into_a_closed_pipe_ends_quietly_with_status_141(model_dir):
    """`kvstore list | head`: no `Error: ... Broken pipe`, status 141 (128 + SIGPIPE) as the other
    verbs; whether the pipe breaks inside the listing or at the last flush."""
    import subprocess
    import sys

    make("doc", model_dir, n=2)
    command = [sys.executable, "-m", "kvstore_cli"]
    for n_forks in (0, 300):  # all of it in stdout's buffer at the end; pages of writes that fill it
        s = store()
        for i in range(len(s.names()) - 1, n_forks):
            s.fork("doc", f"fork-{i:03d}")
        for args in (["list"], ["list", "--json"]):
            read, write = os.pipe()
            os.close(read)  # the reader is gone before the first byte
            done = subprocess.run(command + args, stdout=write, stderr=subprocess.PIPE, text=True,
                                  env=os.environ.copy())
            os.close(write)
            assert (done.returncode, done.stderr) == (141, ""), (n_forks, args)
    shell = f"{' '.join(command)} list --json | head -n 1; exit ${{PIPESTATUS[0]}}"  # a real reader that stops
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=os.environ.copy())
    assert (done.returncode, done.stdout, done.stderr) == (141, "[\n", "")


def test_a_reply_into_a_closed_pipe_is_checkpointed_and_ends_quietly_with_status_141(model_dir):
    """`kvstore new ... | head -c 1`: the reply stops where the pipe broke, the session is saved with
    what was generated (its call unfinished, for `continue`), and the command ends with 141."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "kvstore_cli", "new", "piped", "--model", model_dir, "--raw", "-p",
                           "The fox resumes its run", "-n", "40"], stdout=write, stderr=subprocess.PIPE, text=True,
                          env=os.environ.copy())
    os.close(write)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr
    i = info("piped")
    assert i["active_call"] is not None and i["n_tokens"] > i["active_call"]["start"]  # kept what it made
    kv("continue", "piped")  # and finishes it
    assert info("piped")["active_call"] is None


def test_show_text_and_json(model_dir):
    make("s", model_dir)
    text = kv("show", "s").stdout
    for label in ("model:", "tokens:", "checkpoints:", "disk:", "forks:"):
        assert label in text
    record = info("s")
    assert record["name"] == "s" and record["model_source"] == model_dir


def test_history_text_json_and_raw_spans(model_dir):
    make("h", model_dir)
    kv("continue", "h", "--raw", "-p", " plain text", "-n", "0")
    entries = json.loads(kv("history", "h", "--json").stdout)
    assert [e["role"] for e in entries] == ["user", "assistant", "text"]
    assert entries[0]["text"] == "hello there" and entries[2]["text"].startswith(" plain text")
    assert "--- user" in kv("history", "h").stdout


def test_history_says_where_a_system_message_was_restated_and_not_read_again(model_dir):
    make("r", model_dir, "--system", "Be brief.")
    with store().open("r", kvstore.load_model(model_dir)) as s:
        s.restate_system("Be brief.")
        at = len(s.tokens)
        "".join(s.chat("and then?", max_new_tokens=2))
    shown = kv("history", "r").stdout
    assert f"--- system (restated at token {at:,}: the one in effect, not read again)\nBe brief." in shown
    assert "--- system (tokens 0-0)" in shown  # the one the session was made with, read with the first turn


def test_fork_all_and_at(model_dir):
    make("p", model_dir)
    n = info("p")["n_tokens"]
    r = kv("fork", "p", "child")
    assert "forked 'p'" in r.stderr
    kv("fork", "p", "early", "--at", "5")
    assert info("child")["n_tokens"] == n and info("early")["n_tokens"] == 5
    assert info("early")["parent"] == "p" and sorted(info("p")["forks"]) == ["child", "early"]
    kv("continue", "early", "-n", "3")  # a fork is a session of its own
    assert info("p")["n_tokens"] == n


def test_rm_keeps_forks(model_dir):
    make("p", model_dir)
    kv("fork", "p", "child")
    kv("rm", "p")
    assert store().names() == ["child"]
    kv("continue", "child", "-n", "2")
    assert kv("verify").stdout == "child: ok\n"


def test_export_import_roundtrip(model_dir, tmp_path):
    make("e", model_dir, *SEEDED)
    archive = tmp_path / "e.kvs"
    r = kv("export", "e", "-o", str(archive))
    assert archive.exists() and "exported 'e'" in r.stderr
    kv("import", str(archive), "--as", "e2")
    assert store().tokens("e2") == store().tokens("e")
    kv("rm", "e")
    kv("import", str(archive))  # under its exported name
    assert sorted(store().names()) == ["e", "e2"]
    kv("continue", "e2", "-n", "2")


def test_export_keeps_a_file_that_is_there_unless_forced(model_dir, tmp_path):
    """An archive already at --output may be the only copy of a session deleted since: export refuses
    to replace it (exit 1, the file untouched) unless told --force."""
    make("x1", model_dir, *SEEDED)
    make("x2", model_dir, *SEEDED, prompt="something else")
    archive = tmp_path / "x.kvs"
    kv("export", "x1", "-o", str(archive))
    first = archive.read_bytes()
    r = kv("export", "x2", "-o", str(archive), code=1)
    assert "exists" in r.stderr and "--force" in r.stderr
    assert archive.read_bytes() == first
    kv("export", "x2", "-o", str(archive), "--force")
    assert archive.read_bytes() != first
    kv("import", str(archive), "--as", "back")
    assert store().tokens("back") == store().tokens("x2")


def test_pack_then_continue(model_dir):
    make("pk", model_dir)
    r = kv("pack", "pk")
    assert "packed 'pk'" in r.stderr
    kv("verify", "pk")
    kv("continue", "pk", "-p", "more", "-n", "2")


def test_verify_and_gc(model_dir):
    assert "no sessions" in kv("verify").stderr
    make("g", model_dir)
    assert kv("verify").stdout == "g: ok\n"
    assert kv("verify", "g").stdout == "g: ok\n"
    assert "gc:" in kv("gc").stderr


def test_pull_prints_the_model_path(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kvstore, "pull", lambda alias, home=None: calls.append(alias) or tmp_path / "m.gguf")
    assert kv("pull").stdout.strip() == str(tmp_path / "m.gguf") and calls == ["smollm2"]


def test_home_option_overrides_the_environment(model_dir, tmp_path):
    home = tmp_path / "elsewhere"
    kv("--home", str(home), "new", "x", "--model", model_dir)
    assert (home / "kvstore.db").exists()
    assert kv("list", "--json").stdout.strip() == "[]"
    assert json.loads(kv("--home", str(home), "list", "--json").stdout)[0]["name"] == "x"


def test_version_and_help():
    assert "kvstore, version" in kv("--version").stdout
    assert "Commands:" in kv("--help").stdout


# -- error paths -----------------------------------------------------------------------------------
def error(*args: str, code: int = 1, input: str | None = None) -> str:
    r = kv(*args, code=code, input=input)
    lines = [x for x in r.stderr.splitlines() if x.startswith("Error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["show"], ["history"], ["continue"], ["fork", "NAME", "other"], ["rm"],
                                  ["export", "NAME", "-o", "x.kvs"], ["pack"], ["verify"]])
def test_unknown_session(args):
    args = [a.replace("NAME", "ghost") for a in args]
    if "ghost" not in args:
        args.append("ghost")
    assert "no session named 'ghost'" in error(*args)


def test_existing_name(model_dir, tmp_path):
    make("x", model_dir)
    make("y", model_dir)
    assert "exists" in error("new", "x", "--model", model_dir, "-p", "hi")
    assert "exists" in error("fork", "x", "y")
    kv("export", "x", "-o", str(tmp_path / "x.kvs"))
    assert "exists" in error("import", str(tmp_path / "x.kvs"), "--as", "y")


def test_busy_session(model_dir):
    make("busy", model_dir)
    with store().open("busy", kvstore.load_model(model_dir)):
        for args in (["continue", "busy", "-p", "hi"], ["continue", "busy"], ["rm", "busy"], ["pack", "busy"]):
            assert "open for writing in another process" in error(*args)
    kv("continue", "busy", "-n", "1")  # free again


def test_wrong_model_or_dtype(model_dir, other_model_dir):
    make("m", model_dir)
    message = error("continue", "m", "--model", other_model_dir, "-p", "hi")
    assert "cannot continue with this model" in message and "other weights" in message
    assert "bfloat16" in error("continue", "m", "--dtype", "float32", "-p", "hi")


def test_corrupt_file(model_dir):
    make("bad", model_dir)
    session_dir = kvstore.open_store().session_dir(info("bad")["id"])
    layer = session_dir / "layer-000.kv"
    data = bytearray(layer.read_bytes())
    data[10] ^= 0xFF
    layer.write_bytes(bytes(data))
    assert "checksum" in error("continue", "bad", "-n", "1")
    r = kv("verify", code=1)
    assert r.stdout.startswith("bad: ") and "checksum" in r.stdout
    assert "1 of 1 session(s) have problems" in r.stderr


def test_truncated_file(model_dir):
    make("short", model_dir)
    layer = kvstore.open_store().session_dir(info("short")["id"]) / "layer-001.kv"
    os.truncate(layer, 100)
    assert "truncated" in error("continue", "short", "-n", "1")


def test_bad_archives(tmp_path, model_dir):
    junk = tmp_path / "junk.kvs"
    junk.write_bytes(b"not an archive at all" * 10)
    assert "not a kvstore archive" in error("import", str(junk))
    make("a", model_dir)
    good = tmp_path / "a.kvs"
    kv("export", "a", "-o", str(good))
    data = bytearray(good.read_bytes())
    data[-5] ^= 0xFF
    damaged = tmp_path / "damaged.kvs"
    damaged.write_bytes(bytes(data))
    assert "damaged" in error("import", str(damaged), "--as", "a2")
    assert "a2" not in store().names()


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a" * 200, "-leading"])
def test_invalid_names(model_dir, name, tmp_path):
    args = ["new", name, "--model", model_dir, "-p", "hi"] if not name.startswith("-") else \
        ["new", "--model", model_dir, "-p", "hi", "--", name]
    assert "invalid session name" in error(*args)
    assert not (tmp_path / "escape").exists()


def test_missing_model_and_bad_alias():
    assert "no such file or folder" in error("new", "x", "--model", "no/such/model", "-p", "hi")
    assert "unknown model alias" in error("pull", "no-such-alias")


def test_store_index_missing(model_dir):
    make("orphan", model_dir)
    home = kvstore.open_store().home
    (home / "kvstore.db").unlink()
    for extra in ("kvstore.db-wal", "kvstore.db-shm"):
        (home / extra).unlink(missing_ok=True)
    assert "kvstore.db is missing" in error("list")
    assert not (home / "kvstore.db").exists()


def test_fork_position_out_of_range(model_dir):
    make("f", model_dir)
    assert "fork position must be between 1 and" in error("fork", "f", "g", "--at", "100000")


def test_usage_errors(model_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    assert "not both" in kv("new", "u", "--model", model_dir, "-p", "a", "-f", str(doc), code=2).stderr
    assert "--system" in kv("new", "u", "--model", model_dir, "--raw", "-s", "x", "-p", "a", code=2).stderr
    kv("new", "u", "--top-p", "0", code=2)
    kv("export", "u", code=2)  # -o is required
    assert "u" not in store().names()


# -- library behaviour the CLI relies on ---------------------------------------------------------------
def test_chat_interrupted_during_its_prefill_can_be_resumed(model_dir):
    model = kvstore.load_model(model_dir)
    message = "The quick brown fox jumps over the lazy dog, again and again."
    with store().new("whole", model, seed=1, chunk_size=4, temperature=0.9) as s:
        reply = "".join(s.chat(message, max_new_tokens=8))
    s = store().new("cut", model, seed=1, chunk_size=4, temperature=0.9)

    def ctrl_c_mid_prefill(head, n_tokens, n_cached):
        if 0 < n_cached < n_tokens - 1:
            raise KeyboardInterrupt

    s.on_checkpoint = ctrl_c_mid_prefill
    with pytest.raises(KeyboardInterrupt):
        for _ in s.chat(message, max_new_tokens=8):
            pass
    s.on_checkpoint = None
    s.close()
    with store().open("cut", model) as s:
        assert "".join(s.resume()) == reply
    assert store().tokens("cut") == store().tokens("whole")
    assert [m.role for m in store().messages("cut")] == ["user", "assistant"]


def test_continue_an_empty_session_without_input_says_what_to_do(model_dir):
    kv("new", "empty", "--model", model_dir)
    assert "is empty: give it input" in error("continue", "empty")


@pytest.mark.cuda
def test_new_and_continue_on_cuda(model_dir):
    """On one device a split run equals a whole one; a CPU session continues on CUDA (values close, C1)."""
    args = ["--raw", "-p", "The fox resumes its run", *SEEDED, "--device", "cuda"]
    kv("new", "whole", "--model", model_dir, *args, "-n", "12")
    kv("new", "split", "--model", model_dir, *args, "-n", "6")
    kv("continue", "split", "-n", "6", "--device", "cuda")
    assert store().tokens("split") == store().tokens("whole")
    kv("new", "moved", "--model", model_dir, "--raw", "-p", "The fox resumes its run", "-n", "4")
    kv("continue", "moved", "-n", "4", "--device", "cuda")
    assert info("moved")["n_tokens"] == info("whole")["n_tokens"] - 4


# -- start-up --------------------------------------------------------------------------------------
def test_index_only_commands_never_load_torch(model_dir):
    """list, show, fork, rm and gc read and write the index and files only: they start in about a
    second instead of paying torch's import (several seconds here)."""
    import subprocess
    import sys

    make("doc", model_dir)
    script = ("import sys\nfrom kvstore_cli.main import cli\n"
              "for args in (['list'], ['show', 'doc'], ['fork', 'doc', 'side'], ['rm', 'side'],"
              " ['gc']):\n"
              "    try:\n        cli(args)\n    except SystemExit as e:\n        assert not e.code, (args, e.code)\n"
              "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert "doc" in done.stdout
