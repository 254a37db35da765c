"""Helpers for the store tests: reference runs, trace files, and children to kill.

Children are started from a forkserver that has imported torch and kvstore once, so a child
that loads a tiny model and starts generating costs a fraction of a second; each reports every
acknowledged checkpoint (`("ack", head, n_tokens, n_cached)`) on a pipe before it can be killed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch

import kvstore

DOCUMENT = "The store keeps every layer's keys and values on disk; a session resumes where it stopped. "
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}
_CTX = None


def context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "kvstore", "store_harness"])
    return _CTX


def flip_byte(path: Path, offset: int) -> None:
    """Damage one stored byte (bit 6 flipped)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def tmpfs_refused() -> str | None:
    """Why a tmpfs of a process's own (`unshare -rm`, a mount namespace and a user namespace, then a
    small tmpfs: a disk that really fills up) cannot be had here; None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -rm and a tmpfs mount refused: {probe.stderr.strip()[:200]}"


def read_trace(path: Path) -> list[dict]:
    """Complete JSON lines of a trace (a line cut by a kill is ignored)."""
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def by_position(lines: list[dict]) -> dict[int, dict]:
    table: dict[int, dict] = {}
    for line in lines:
        assert table.setdefault(line["position"], line) == line, f"two different draws at {line['position']}"
    return table


def reference_run(home: Path, model, name: str, n_new: int, trace: Path, *, seed: int = 5, chunk_size: int = 16,
                  checkpoint_every: int = 4, **sampling) -> list[int]:
    """An uninterrupted session: document, then n_new tokens; returns all its token ids."""
    store = kvstore.open_store(home)
    with store.new(name, model, seed=seed, chunk_size=chunk_size, checkpoint_every=checkpoint_every,
                   **sampling) as s:
        s.append_text(DOCUMENT)
        list(s.generate(n_new, trace=trace, stop_at_eos=False))
        tokens = list(s.tokens)
    store.close()
    return tokens


def closed_and_reopened(store, s, model, n_new: int, trace: Path) -> tuple[list[int], list[dict]]:
    """Generate a third of `n_new` tokens, close the session, reopen it in this process and generate
    the rest: (its tokens, the trace lines of both parts), to compare with an uninterrupted run."""
    list(s.generate(n_new // 3, trace=trace, stop_at_eos=False))
    s.close()
    with store.open(s.name, model) as s:
        list(s.generate(n_new - n_new // 3, trace=trace, stop_at_eos=False))
        return s.tokens, read_trace(trace)


def assert_matches(reference, tokens, trace_lines):
    """Contract C1: `tokens` and every traced line equal the uninterrupted run's (tokens, lines by position)."""
    ref_tokens, ref_lines = reference
    assert tokens == ref_tokens
    got = by_position(trace_lines)
    assert got, "the resumed run traced nothing"
    for position, line in got.items():
        assert line == ref_lines[position], f"position {position} differs from the uninterrupted run"


# -- children --------------------------------------------------------------------------------------
def _report(conn):
    def on_checkpoint(head, n_tokens, n_cached):
        conn.send(("ack", head, n_tokens, n_cached))
    return on_checkpoint


def child_generate(home: str, model_path: str, name: str, n_new: int, trace: str, threads: int, conn,
                   url: str | None = None) -> None:
    """Open an existing session (index: `url`, else the home's) and generate; every checkpoint is
    reported before going on."""
    torch.set_num_threads(threads)
    model = kvstore.load_model(model_path)
    store = kvstore.open_store(home, url=url)
    session = store.open(name, model)
    session.on_checkpoint = _report(conn)
    conn.send(("ready", len(session.tokens)))
    for _ in session.generate(n_new, trace=trace, stop_at_eos=False):
        pass
    session.close()
    conn.send(("done", len(session.tokens)))


def child_hold(home: str, model_path: str, name: str, conn) -> None:
    """Open an existing session as its writer and hold it, doing nothing, until killed (a writer
    that never finishes before the test is done with it, however fast the machine)."""
    model = kvstore.load_model(model_path)
    session = kvstore.open_store(home).open(name, model)
    conn.send(("ready", len(session.tokens)))
    time.sleep(600)


def child_new_document(home: str, model_path: str, name: str, text: str, chunk_size: int, conn, **sampling) -> None:
    """Create a session and prefill a document chunk by chunk, reporting each checkpoint."""
    torch.set_num_threads(2)
    model = kvstore.load_model(model_path)
    store = kvstore.open_store(home)
    session = store.new(name, model, seed=5, chunk_size=chunk_size, checkpoint_every=4, **sampling)
    session.on_checkpoint = _report(conn)
    conn.send(("ready", 0))
    session.append_text(text)
    session.close()
    conn.send(("done", len(session.tokens)))


def child_churn(home: str, url: str | None, model_path: str, prefix: str, rounds: int, conn) -> None:
    """Sessions made, forked, packed and deleted in a loop (same seeds in every child: their packed
    KV is identical, so the children share blobs); sends ("done", names kept)."""
    torch.set_num_threads(1)
    model = kvstore.load_model(model_path)
    store = kvstore.open_store(home, url=url)
    for i in range(rounds):
        with store.new(f"{prefix}{i}", model, seed=i, chunk_size=8, checkpoint_every=2) as s:
            s.append_text(DOCUMENT * 2)
            list(s.generate(10, stop_at_eos=False))
        store.fork(f"{prefix}{i}", f"{prefix}{i}-fork")
        if i % 2:
            store.pack(f"{prefix}{i}")
            store.delete(f"{prefix}{i}")
    conn.send(("done", sorted(n for n in store.names() if n.startswith(prefix))))


def child_gc(home: str, url: str | None, rounds: int, conn) -> None:
    """gc over and over while others write."""
    store = kvstore.open_store(home, url=url)
    for _ in range(rounds):
        store.gc()
    conn.send(("done", rounds))


def churn_with_gc(home: str, url: str | None, model_path: str, model) -> None:
    """Three children make, fork, pack and delete sessions (sharing blobs) while a fourth runs gc;
    then every session kept is listed, verifies clean and opens."""
    kvstore.open_store(home, url=url).close()
    children = [start(child_churn, home, url, model_path, f"w{w}-", 4) for w in range(3)]
    children.append(start(child_gc, home, url, 40))
    kept = set()
    for proc, conn in children:
        done = [m for m in run_to_end(proc, conn, timeout=300) if m[0] == "done"]
        kept.update(done[0][1] if isinstance(done[0][1], list) else [])
    store = kvstore.open_store(home, url=url)
    assert set(store.names()) == kept and len(kept) == 3 * (4 + 2)
    assert all(not problems for problems in store.verify().values())
    for name in sorted(kept):
        with store.open(name, model) as s:
            assert s.seq.cache.length == store.info(name).n_cached
    store.close()


def start(target, *args, ctx=None):
    """Run target(*args, conn) in a child (of `ctx`, else this module's forkserver); returns
    (process, parent end of the pipe). Keyword arguments go through `functools.partial(target, ...)`."""
    ctx = ctx or context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def wait_for(conn, kind: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(max(0.0, deadline - time.monotonic())):
            msg = conn.recv()
            if msg[0] == kind:
                return msg
    raise TimeoutError(f"child sent no {kind!r}")


def kill_after(proc, conn, delay: float) -> list[tuple]:
    """SIGKILL the child `delay` seconds from now (or when it ends); returns every message it sent."""
    messages = []
    deadline = time.monotonic() + delay
    try:
        while time.monotonic() < deadline and proc.is_alive():
            if conn.poll(max(0.0, min(0.005, deadline - time.monotonic()))):
                messages.append(conn.recv())
    except EOFError:  # the child ended (and closed its end) before the deadline
        pass
    if proc.is_alive():
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended, and its parent (the forkserver) reaped it, since is_alive()
            pass
    proc.join(10)
    while True:
        try:
            if not conn.poll(0):
                break
            messages.append(conn.recv())
        except (EOFError, OSError):
            break
    return messages


def run_to_end(proc, conn, timeout: float = 120.0) -> list[tuple]:
    messages = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if conn.poll(0.05):
                messages.append(conn.recv())
                if messages[-1][0] == "done":
                    break
        except EOFError:
            break
    proc.join(30)
    assert proc.exitcode == 0, f"child failed with exit code {proc.exitcode}"
    return messages


# -- a tiny full disk --------------------------------------------------------------------------------
def enospc_child(home: str, model_path: str) -> None:
    """Run inside `unshare -rm` with `home` on a small tmpfs: fill it, hit ENOSPC, recover; print JSON."""
    import errno

    from kvstore.errors import StoreFull

    model = kvstore.load_model(model_path)
    store = kvstore.open_store(home)
    result = {}
    with store.new("s", model, seed=1, checkpoint_every=2) as s:
        s.append_text(DOCUMENT)
        list(s.generate(4, stop_at_eos=False))
    committed = store.tokens("s")
    filler = Path(home) / "filler"
    with open(filler, "wb", buffering=0) as f:  # take every free byte
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            result["filler_errno"] = e.errno == errno.ENOSPC
    s = store.open("s", model)
    try:
        list(s.generate(100, stop_at_eos=False))
        result["raised"] = None
    except StoreFull as e:
        result["raised"] = "StoreFull"
        result["message"] = str(e)
    finally:
        try:
            s.close()
        except StoreFull:
            result["close_raised"] = "StoreFull"
    result["alive"] = True
    result["lock_released"] = not s.lock.held
    with store.open("s", model) as again:  # the last good checkpoint loads
        result["tokens_ok"] = again.tokens[: len(committed)] == committed
        result["loads"] = True
        filler.unlink()
        list(again.generate(4, stop_at_eos=False))  # space is back: checkpoints work again
        again.checkpoint()
    result["verify"] = store.verify("s")
    print("RESULT " + json.dumps(result))
