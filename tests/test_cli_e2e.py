"""End to end through the installed `kvstore` executable, as separate processes.

`new` is killed with SIGKILL mid-generation (or stopped with SIGINT, as Ctrl-C does), then
`continue` finishes it; the trace must equal the uninterrupted run's, token for token and logits
hash for logits hash. Tiny model, `--checkpoint-every 4`, seeded sampling at temperature 0.9.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

N_NEW = 160  # the tiny model's context is 256 tokens; the chat prompt takes about 26; EOS comes at 177
RUN = ["--prompt", "hello there", "--max-new-tokens", str(N_NEW), "--temperature", "0.9", "--seed", "7",
       "--checkpoint-every", "4"]


def executable() -> str:
    beside = Path(sys.executable).parent / "kvstore"
    found = str(beside) if beside.exists() else shutil.which("kvstore")
    assert found, "the kvstore executable is not installed (pip install -e .)"
    return found


def kvstore(home: Path, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "KVSTORE_HOME": str(home)}
    return subprocess.Popen([executable(), *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finish(p: subprocess.Popen, code: int = 0, timeout: float = 240) -> tuple[str, str]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == code, f"exit {p.returncode}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in err, err
    return out, err


def trace_lines(path: Path) -> list[dict]:
    """Complete JSON lines (a line cut by a kill would be dropped)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_for_lines(path: Path, n: int, p: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(trace_lines(path)) < n:
        assert p.poll() is None, f"the run ended (exit {p.returncode}) before it could be interrupted"
        assert time.monotonic() < deadline, "no trace lines in time"
        time.sleep(0.005)


def dedup(lines: list[dict]) -> list[dict]:
    """One line per position; lines repeated for the same position must be equal."""
    table: dict[int, dict] = {}
    for line in lines:
        assert table.setdefault(line["position"], line) == line, f"two different draws at {line['position']}"
    return [table[p] for p in sorted(table)]


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> tuple[str, list[dict]]:
    """The uninterrupted run: (model folder, its trace lines)."""
    model = str(tiny("llama-gqa").folder)
    work = tmp_path_factory.mktemp("reference")
    trace = work / "ref.jsonl"
    finish(kvstore(work / "home", "new", "ref", "--model", model, *RUN, "--trace", str(trace)))
    lines = trace_lines(trace)
    assert len(lines) == N_NEW, "the reference should run to max_new_tokens (no EOS on this seed)"
    return model, lines


def test_kill_9_mid_generation_then_continue_equals_uninterrupted(reference, tmp_path):
    model, ref = reference
    trace = tmp_path / "run.jsonl"
    p = kvstore(tmp_path / "home", "new", "run", "--model", model, *RUN, "--trace", str(trace))
    wait_for_lines(trace, 45, p)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    killed_at = len(trace_lines(trace))

    out, _ = finish(kvstore(tmp_path / "home", "show", "run", "--json"))
    saved = json.loads(out)
    assert saved["active_call"] is not None  # the reply was cut: continue must finish it
    generated_before = saved["n_tokens"] - saved["active_call"]["start"]
    # at most two intervals of checkpoint_every (4) lost: the last checkpoint's, when it was still being
    # committed beside the decode, and the tokens since, up to the next one (which waits for it)
    assert killed_at - 2 * 4 <= generated_before <= killed_at

    finish(kvstore(tmp_path / "home", "continue", "run", "--trace", str(trace)))
    lines = trace_lines(trace)
    assert len(lines) == N_NEW + (killed_at - generated_before)  # lost tokens generated again, once more
    assert dedup(lines) == ref


def test_ctrl_c_checkpoints_exits_130_and_continue_equals_uninterrupted(reference, tmp_path):
    model, ref = reference
    trace = tmp_path / "run.jsonl"
    p = kvstore(tmp_path / "home", "new", "run", "--model", model, *RUN, "--trace", str(trace))
    wait_for_lines(trace, 30, p)
    p.send_signal(signal.SIGINT)
    _, err = finish(p, code=130)
    assert "stopped" in err and "kvstore continue run" in err
    stopped_at = len(trace_lines(trace))
    assert stopped_at < N_NEW

    finish(kvstore(tmp_path / "home", "continue", "run", "--trace", str(trace)))
    assert trace_lines(trace) == ref  # a clean stop loses nothing: no line is written twice
