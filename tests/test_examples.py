"""The examples run, at small sizes with a tiny model (random, or the trained one), so that they cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import stdlib_text  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny) -> str:
    return str(tiny("llama-gqa").folder)


def run(args: list[str], tmp_path: Path, **env: str) -> str:
    result = subprocess.run(args, cwd=tmp_path, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result.stdout


def test_stdlib_text_is_long_real_and_stable():
    text = stdlib_text.document(20_000)
    assert len(text) >= 20_000 and text.startswith("heapq\n")
    assert text == stdlib_text.document(20_000)
    assert len(stdlib_text.document(10**9)) > 100_000  # enough for the model's whole context


def test_long_document_qa(model_dir, tmp_path):
    out = run([sys.executable, str(EXAMPLES / "long_document_qa.py"), "--model", model_dir, "--tokens", "120",
               "--max-new-tokens", "6", "-q", "What is a heap?", "-q", "What does re.sub do?"], tmp_path)
    assert "read 120 tokens once" in out
    assert len(re.findall(r"fork \+ load: \d+ ms instead of a [\d.]+ s prefill: saved", out)) == 2
    assert "Q2: What does re.sub do?" in out


def test_chat_resume_across_processes(model_dir, tmp_path):
    out = run([sys.executable, str(EXAMPLES / "chat_resume.py"), "--model", model_dir, "--max-new-tokens", "8",
               "--temperature", "0.8", "Hello!", "And then?"], tmp_path)
    assert "new session" in out and re.search(r"restored \d+ tokens in \d+ ms, no prefill", out)
    assert "2 turns in 2 processes vs one process" in out and "identical" in out


@pytest.mark.realmodel
def test_crash_recover(smollm2_path, tmp_path):
    """With the real model: a tiny one can finish 60 tokens between two polls of the script, before the kill."""
    kvstore = Path(sys.executable).parent / "kvstore"
    out = run(["bash", str(EXAMPLES / "crash_recover.sh")], tmp_path, KVSTORE=str(kvstore),
              KVSTORE_MODEL=str(smollm2_path), N="96")  # the default prompt: a story, no early end
    assert "killed after" in out and "interrupted:" in out and "kvstore continue: finish" in out
    assert "identical: every token" in out


def test_tiny_model_on_the_trained_model(trained, tmp_path):
    out = run([sys.executable, str(EXAMPLES / "tiny_model.py"), "--model", str(trained.folder), "--max-new-tokens", "40",
               "-q", "heapq.merge", "-q", "json.dumps"], tmp_path)
    assert re.search(r"raw: .* \[stopped by: (stop|eos|length)\]", out)
    assert out.count("assistant: ") == 2 and re.search(r"tokens, ended by (its end of turn|the length limit)", out)
    assert "identical to the uninterrupted reply" in out


def test_serve_client_against_a_live_server(model_dir, tmp_path):
    from serve_kit import LiveServer

    with LiveServer(tmp_path / "home", model_dir, "--chunk-size", "16", "--threads", "1",
                    env={"KVSTORE_API_KEYS": "example-key-123"}) as server:
        out = run([sys.executable, str(EXAMPLES / "serve_client.py"), "--max-tokens", "8", "--session", "demo"],
                  tmp_path, KVSTORE_URL=server.url, KVSTORE_API_KEY="example-key-123")
    assert "session demo, turn 1 (tiny):" in out and "turn 2 (streamed):" in out
    assert re.search(r"prompt \d+ tokens, 0 of them reused; \d+ generated", out)
    assert re.search(r"prompt \d+ tokens, [1-9]\d* of them reused from the stored session", out)
    assert re.search(r"stored: \d+ tokens, 4 messages", out) and "turn 2 reused turn 1's KV" in out
