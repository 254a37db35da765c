"""The service benchmark (issue 17): `kvstore serve` against llama.cpp's OpenAI-compatible server
(llama-cpp-python[server]) in each of its prompt-cache modes, on one multi-turn workload.

    python -m benchmarks.serve [--quick] [--threads 2] [--peer | --no-peer] [--modes none,ram,disk]
                               [--reps N] [--out DIR] [--publish]

It is also the phase "serve" of `python -m benchmarks run` (CI: `run --quick`, kvstore only unless
llama-cpp-python is installed).

Contract:
- Servers. Each runs as a subprocess in a process group of its own, on a free port of 127.0.0.1, in
  a temporary folder (kvstore: a fresh `--home`; llama.cpp: its working directory, where its disk
  cache lives), with --threads threads. It is ready when its health URL answers 200 (kvstore:
  /health, which answers 503 while loading; llama.cpp: /v1/models). A restart kills the group
  (SIGKILL) and starts the server again on the same folder; at the end it is stopped (SIGTERM, then
  SIGKILL). A server that exits or is not ready within READY_TIMEOUT_S is an error naming its log.
- Client. The official `openai` package as it is, streaming, greedy (temperature 0), `max_tokens`
  per reply.
  The model is named as the server's GET /v1/models names it. TTFT: from sending the request to
  the first chunk with non-empty content. A reply's tokens: the
  stream's usage when the server sends it (stream_options.include_usage), else its content chunks.
  The client resends the whole history every turn, as OpenAI clients do (llama.cpp's prompt cache
  works on it); for kvstore each conversation is also named by the X-Session-Id header.
- Workload. A document of `doc_chars` characters of the standard library's docstrings
  (examples/stdlib_text.py, deterministic) is the first user message of every conversation, after
  a system line of the conversation's own, so no conversation's tokens are a prefix of another's:
  what is measured is each conversation's own cache, not prefix sharing. Then short questions.
- Cases, each turn recorded with one:
  first    a conversation's first turn (the document)
  next     the next turn of the conversation that just ran
  back     a turn of a conversation after other conversations used the server
  restart  the next turn of the conversation the server ran last, after the server was killed and
           started again
  many     round-robin turns over `many` conversations on a fresh server whose llama.cpp RAM cache
           is sized (--cache_size) for `cache_conversations` of them (its disk cache keeps its
           default size) and kvstore keeps as many sessions in memory (--max-open, at least 1), so
           it restores the others from disk
- llama.cpp runs in each prompt-cache mode: none, ram (--cache True --cache_type ram), disk
  (--cache True --cache_type disk). For each case its best mode is the one with the lowest TTFT p50,
  and the ratio is that p50 ÷ kvstore's p50. Targets (TARGETS): restart ≥ 20×, back ≥ 10×,
  many ≥ 10×.
- Output: OUT/serve.json holds every turn of every repetition, the servers' start times, the
  summary per server and case (TTFT p50/p99, aggregate tok/s = completion tokens ÷ request time),
  the ratios and the targets, the load average at each turn (other work on the machine shows in
  it), the CPU (/proc/cpuinfo), threads and versions. --publish (a full run
  with the peer) also writes benchmarks/results/serve/<cpu>.json, the per-CPU file REPORT.md's
  Service section and the README are built from, and rebuilds them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
FULL = {"doc_chars": 8000, "max_tokens": 32, "conversations": 3, "back_rounds": 2, "restarts": 3, "many": 4,
        "rounds": 2, "cache_conversations": 1.5, "n_ctx": 4096, "reps": 1}
QUICK = {"doc_chars": 1600, "max_tokens": 8, "conversations": 2, "back_rounds": 1, "restarts": 2, "many": 3,
         "rounds": 1, "cache_conversations": 1.5, "n_ctx": 2048, "reps": 1}
MODES = ("none", "ram", "disk")
CASES = ("first", "next", "back", "restart", "many")
TARGETS = {"restart": 20.0, "back": 10.0, "many": 10.0}  # llama.cpp's best TTFT p50 ÷ kvstore's, at least
READY_TIMEOUT_S = 300.0
QUESTIONS = ("What is the first module this document describes?", "Name one function it mentions.",
             "What does that function return?", "Which module handles dates?", "Summarize the document in one line.",
             "Which part would a beginner read first?", "Name a class it describes.", "What is a deque?")
KV_F16_BYTES = 2  # llama.cpp's default KV cache type is f16
CHARS_PER_TOKEN = 4.0  # the stdlib text in SmolLM2's tokenizer: 9,046 characters are 2,284 tokens


def log(msg: str) -> None:
    print(msg, flush=True)


# -- servers -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Spec:
    """How to run one server: its label, argv for a port, its health path, whether it takes session ids."""
    label: str  # "kvstore", "llama.cpp none", ...
    argv: Callable[[int], list[str]]  # port -> the command
    health: str
    sessions: bool
    notes: dict = field(default_factory=dict)


class Server:
    """A server subprocess in its own process group, logging to `folder`/server-N.log."""

    def __init__(self, spec: Spec, folder: Path):
        self.spec, self.folder, self.proc, self.port, self.lives = spec, folder, None, 0, 0
        self.log_path: Path | None = None
        self.client, self.model_id = None, ""

    def start(self) -> float:
        """Start it and wait until it is ready: the seconds that took."""
        self.port, self.lives = free_port(), self.lives + 1
        self.log_path = self.folder / f"server-{self.lives}.log"
        env = server_env()
        start = time.perf_counter()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.spec.argv(self.port), cwd=self.folder, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_ready(start)
        ready = time.perf_counter() - start
        import openai

        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
        self.model_id = self.client.models.list().data[0].id  # the name this server gives its model
        return ready

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, start: float) -> None:
        import httpx

        while time.perf_counter() - start < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.label} exited with {self.proc.returncode} before it was ready: "
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + self.spec.health, timeout=5).status_code == 200:
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.spec.label} was not ready within {READY_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 15.0) -> None:
        """Signal the server's process group (the one this object started), then reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if self.proc is not None:  # whatever the group left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def server_env() -> dict:
    """This environment, without a KVSTORE_INDEX of the caller's, with this checkout importable from
    the server's own folder."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_INDEX"}
    path = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    return env | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def kvstore_spec(model: str, threads: int, home: Path, max_open: int | None = None, extra: tuple[str, ...] = (),
                 label: str = "kvstore") -> Spec:
    """`kvstore serve` on a home of its own (max_open: its --max-open, None: its default; extra: more
    options of `kvstore serve`)."""
    def argv(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "kvstore_cli", "--home", str(home), "serve", "--host", "127.0.0.1",
               "--port", str(port), "--model", model, "--threads", str(threads)]
        return cmd + (["--max-open", str(max_open)] if max_open is not None else []) + list(extra)

    notes = {"max_open": max_open} | ({"options": list(extra)} if extra else {})
    return Spec(label, argv, "/health", sessions=True, notes=notes)


def llama_spec(gguf: Path, threads: int, n_ctx: int, mode: str, cache_size: int | None) -> Spec:
    """llama-cpp-python's server in one prompt-cache mode (cache_size: its --cache_size, None: its default)."""
    def argv(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "benchmarks.llama_server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
               "--n_ctx", str(n_ctx), "--n_batch", "512", "--verbose", "True"]
        if mode != "none":
            cmd += ["--cache", "True", "--cache_type", mode]
        if cache_size is not None:
            cmd += ["--cache_size", str(cache_size)]
        return cmd

    notes = {"mode": mode, "cache_size": cache_size}
    return Spec(f"llama.cpp {mode}", argv, "/v1/models", sessions=False, notes=notes)


def kvstore_serve_status() -> str:
    """"" when this checkout's `kvstore serve` answers --help, else why it cannot be measured."""
    try:
        done = subprocess.run([sys.executable, "-m", "kvstore_cli", "serve", "--help"], capture_output=True, text=True,
                              timeout=120, cwd=HERE.parent)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`kvstore serve --help` did not run: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`kvstore serve` is not available in this checkout ({last})"
    return ""


# -- the client ------------------------------------------------------------------------------------
@dataclass
class Conversation:
    name: str
    document: str
    messages: list[dict] = field(default_factory=list)
    turns: int = 0

    def __post_init__(self):
        self.messages.append({"role": "system", "content": f"You are a concise assistant. Conversation {self.name}."})

    def ask(self) -> list[dict]:
        """The history with the next user message appended."""
        question = QUESTIONS[self.turns % len(QUESTIONS)]
        text = f"{self.document}\n\n{question}" if self.turns == 0 else question
        self.messages.append({"role": "user", "content": text})
        return self.messages

    def answered(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})
        self.turns += 1


def turn(server: Server, conv: Conversation, max_tokens: int) -> dict:
    """One streamed chat completion: its TTFT, time, tokens and the reuse the server reported."""
    headers = {"X-Session-Id": conv.name} if server.spec.sessions else {}
    messages = conv.ask()
    start = time.perf_counter()
    stream = server.client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_headers=headers)
    ttft, pieces, usage = None, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            pieces.append(text)
    total = time.perf_counter() - start
    conv.answered("".join(pieces))
    return {"ttft_s": ttft, "total_s": total, "chunks": len(pieces)} | usage_fields(usage, len(pieces))


def usage_fields(usage, chunks: int) -> dict:
    if usage is None:
        return {"completion_tokens": chunks, "tokens_from": "chunks", "prompt_tokens": None, "cached_tokens": None}
    details = getattr(usage, "prompt_tokens_details", None)
    return {"completion_tokens": usage.completion_tokens, "tokens_from": "usage", "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": getattr(details, "cached_tokens", None) if details is not None else None}


_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*[\d.]+ ms\s*/\s*(\d+) tokens")


def llama_log_facts(text: str) -> dict:
    """What llama-cpp-python's verbose log says of one request: its cache hit or miss, and the prompt
    tokens llama.cpp evaluated."""
    cache = "hit" if "cache hit" in text else "miss" if "cache miss" in text else None
    evals = _PROMPT_EVAL.findall(text)
    return {"cache": cache, "prompt_eval_tokens": int(evals[-1]) if evals else None}


# -- the workload ------------------------------------------------------------------------------------
def base_script(cfg: dict) -> list[tuple]:
    """first and next for each conversation; `back_rounds` rounds back to each; then `restarts`
    times: a restart and the next turn of the conversation the server ran last (no other one in
    between: llama.cpp's disk cache's best case, as its lookup pops the entry it matches)."""
    names = [f"c{i}" for i in range(cfg["conversations"])]
    plan = [(name, kind) for name in names for kind in ("first", "again")]
    plan += [(name, "again") for _ in range(cfg["back_rounds"]) for name in names]
    plan += [step for _ in range(cfg["restarts"]) for step in ((None, "restart"), (names[-1], "restart"))]
    return labelled(plan)


def labelled(plan: list[tuple]) -> list[tuple]:
    """("turn", name, case) and ("restart",) steps from (name, kind): a turn "again" is "next" when
    the turn before it was the same conversation's, "back" when another's."""
    steps, before = [], None
    for name, kind in plan:
        if name is None:
            steps.append(("restart",))
            continue
        case = kind if kind != "again" else "next" if before == name else "back"
        steps.append(("turn", name, case))
        before = name
    return steps


def many_script(cfg: dict) -> list[tuple]:
    """The first turns of `many` conversations, then `rounds` round-robin rounds over them."""
    names = [f"m{i}" for i in range(cfg["many"])]
    return [("turn", n, "first") for n in names] + [("turn", n, "many") for _ in range(cfg["rounds"]) for n in names]


def run_script(spec: Spec, steps: list[tuple], document: str, cfg: dict, folder: Path, tags: dict) -> tuple:
    """Run the steps against one server (restarting it where they say): (turn records, start records)."""
    folder.mkdir(parents=True, exist_ok=True)
    server, convs, turns, starts = Server(spec, folder), {}, [], []
    try:
        starts.append(tags | {"life": 1, "ready_s": server.start()})
        for step in steps:
            if step[0] == "restart":
                server.kill(signal.SIGKILL)
                starts.append(tags | {"life": server.lives + 1, "ready_s": server.start()})
                continue
            _, name, case = step
            conv = convs.setdefault(name, Conversation(name, document))
            offset = server.log_size()
            record = tags | {"case": case, "conversation": name, "turn": conv.turns, "life": server.lives,
                             "load_1min": os.getloadavg()[0]}
            record |= turn(server, conv, cfg["max_tokens"])
            if not spec.sessions:
                record |= llama_log_facts(server.log_since(offset))
            turns.append(record)
            log(f"    {spec.label:15} {case:8} {name} turn {record['turn']}: TTFT {record['ttft_s']:.3f} s")
    finally:
        server.stop()
    return turns, starts


def state_bytes_per_token(gguf: Path) -> int:
    """llama.cpp's f16 KV bytes per token of this GGUF (K and V, every layer)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def num(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    head_dim = num("embedding_length") // num("attention.head_count")
    return 2 * num("block_count") * num("attention.head_count_kv") * head_dim * KV_F16_BYTES


def ram_cache_size(gguf: Path, cfg: dict) -> int:
    """--cache_size for the `many` case: the KV of `cache_conversations` conversations at their
    longest (the document, a system line, a question and a reply per turn)."""
    tokens = cfg["doc_chars"] / CHARS_PER_TOKEN + 40 + (cfg["rounds"] + 1) * (20 + cfg["max_tokens"])
    return int(cfg["cache_conversations"] * tokens * state_bytes_per_token(gguf))


def specs(model: str, gguf: Path | None, threads: int, cfg: dict, modes: list[str], root: Path) -> list[tuple]:
    """[(spec for the base run, spec for the many run)], kvstore first, then llama.cpp per mode."""
    held = max(1, int(cfg["cache_conversations"]))  # kvstore keeps as many sessions in memory as llama.cpp's cache
    out = [(kvstore_spec(model, threads, root / "kvstore-base"),
            kvstore_spec(model, threads, root / "kvstore-many", max_open=held))]
    small = ram_cache_size(gguf, cfg) if gguf is not None else None
    for mode in modes:
        out.append((llama_spec(gguf, threads, cfg["n_ctx"], mode, None),
                    llama_spec(gguf, threads, cfg["n_ctx"], mode, small if mode == "ram" else None)))
    return out


def measure(pairs: list[tuple], cfg: dict, document: str, root: Path) -> tuple[list, list]:
    """Every repetition of both runs for every server, servers alternating: (turns, starts)."""
    turns, starts = [], []
    for rep in range(cfg["reps"]):
        for run, steps in (("base", base_script(cfg)), ("many", many_script(cfg))):
            for pair in pairs:
                spec = pair[0] if run == "base" else pair[1]
                log(f"  {spec.label}, {run} run, repetition {rep + 1}:")
                folder = root / f"rep{rep}" / run / spec.label.replace(" ", "-")
                tags = {"server": spec.label, "run": run, "rep": rep}
                t, s = run_script(spec, steps, document, cfg, folder, tags)
                turns += t
                starts += s
                shutil.rmtree(folder, ignore_errors=True)
    return turns, starts


# -- figures -----------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "min": min(xs), "max": max(xs), "n": len(xs)}


def tok_s(turns: list[dict]) -> float:
    seconds = sum(t["total_s"] for t in turns)
    return sum(t["completion_tokens"] for t in turns) / seconds if seconds else 0.0


def summarize(turns: list[dict]) -> dict:
    """{server: {"cases": {case: {ttft, tok_s, prompt/cached tokens}}, "tok_s", "turns"}}."""
    out = {}
    for server in dict.fromkeys(t["server"] for t in turns):
        mine = [t for t in turns if t["server"] == server]
        cases = {}
        for case in CASES:
            these = [t for t in mine if t["case"] == case and t["ttft_s"] is not None]
            if these:
                cases[case] = {"ttft_s": stats([t["ttft_s"] for t in these]), "tok_s": tok_s(these)}
                cases[case] |= reuse(these)
        load = [t["load_1min"] for t in mine if "load_1min" in t]
        out[server] = {"cases": cases, "tok_s": tok_s(mine), "turns": len(mine),
                       "load_1min": [min(load), max(load)] if load else None,
                       "completion_tokens": sum(t["completion_tokens"] for t in mine),
                       "no_content": sum(t["ttft_s"] is None for t in mine)}
    return out


def reuse(turns: list[dict]) -> dict:
    """Median prompt tokens, and the tokens the server reused (kvstore: cached_tokens) or
    evaluated (llama.cpp's log), where known."""
    def med(key: str):
        xs = [t[key] for t in turns if t.get(key) is not None]
        return percentile(xs, 50) if xs else None

    out = {"prompt_tokens": med("prompt_tokens"), "cached_tokens": med("cached_tokens"),
           "prompt_eval_tokens": med("prompt_eval_tokens")}
    hits = [t["cache"] for t in turns if t.get("cache")]
    if hits:
        out["cache_hits"] = hits.count("hit")
    return out


def compare(summary: dict) -> dict:
    """Per case: llama.cpp's best mode (lowest TTFT p50) and its p50/p99 ÷ kvstore's."""
    ours = summary.get("kvstore", {}).get("cases", {})
    out = {}
    for case in CASES:
        peers = {s: x["cases"][case] for s, x in summary.items() if s != "kvstore" and case in x["cases"]}
        if case not in ours or not peers:
            continue
        best = min(peers, key=lambda s: peers[s]["ttft_s"]["p50"])
        b, k = peers[best]["ttft_s"], ours[case]["ttft_s"]
        out[case] = {"best": best, "best_p50": b["p50"], "best_p99": b["p99"],
                     "ratio_p50": b["p50"] / k["p50"], "ratio_p99": b["p99"] / k["p99"]}
        if case in TARGETS:
            out[case] |= {"target": TARGETS[case], "met": out[case]["ratio_p50"] >= TARGETS[case]}
    return out


def run(cfg: dict, threads: int, model: str, peer: bool, workdir: Path, modes=MODES) -> dict:
    """The whole benchmark: figures as a JSON-able dict. kvstore is left out (with why) when this
    checkout has no `kvstore serve`; llama.cpp when `peer` is false or it is not installed."""
    import kvstore
    from kvstore.train.corpus import document as stdlib_text  # what examples/stdlib_text.py prints

    from . import llama_peer

    document = stdlib_text(cfg["doc_chars"])
    why = {"kvstore": kvstore_serve_status(), "llama.cpp": ""}
    if not peer:
        why["llama.cpp"] = "left out (--no-peer)"
    elif llama_peer.server_status()[0] is None:
        why["llama.cpp"] = llama_peer.server_status()[1]
    gguf = Path(kvstore.pull(model, quiet=True)) if Path(model).suffix != ".gguf" else Path(model)
    pairs = specs(model, gguf, threads, cfg, list(modes) if not why["llama.cpp"] else [], workdir)
    pairs = [p for p in pairs if not (p[0].label == "kvstore" and why["kvstore"])]
    held = kvstore.load_model(gguf)  # how `kvstore serve` holds it by default on this machine
    out = {"config": dict(cfg), "threads": threads, "model": model, "model_file": gguf.name, "modes": list(modes),
           "kvstore_weights": held.weights, "kvstore_dtype": held.dtype_name,
           "kvstore_prewarm": True,  # `kvstore serve`'s default, which the spec leaves as it is
           "targets": TARGETS, "not_measured": {k: v for k, v in why.items() if v}, "doc_chars": len(document),
           "servers": {p[0].label: {"base": p[0].notes, "many": p[1].notes} for p in pairs}}
    if not pairs:
        return out
    turns, starts = measure(pairs, cfg, document, workdir)
    summary = summarize(turns)
    out |= {"turns": turns, "starts": starts, "summary": summary, "ratios": compare(summary)}
    return out


# -- alone ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized: a short document, few turns (< 2 min kvstore only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="alias or .gguf path (llama.cpp needs a GGUF)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure llama.cpp's server (when llama-cpp-python[server] is installed)")
    p.add_argument("--modes", default=",".join(MODES), help="llama.cpp's prompt-cache modes to measure")
    p.add_argument("--reps", type=int, help="repetitions of the whole workload")
    p.add_argument("--out", type=Path, default=HERE / "out")
    p.add_argument("--publish", action="store_true",
                   help="write benchmarks/results/serve/<cpu>.json and rebuild REPORT.md and the README from it")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (run_script's finally) first
    cfg = dict(QUICK if args.quick else FULL)
    if args.reps:
        cfg["reps"] = args.reps
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    results = standalone(cfg, args.threads, args.model, args.peer, modes, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "serve.json"
    text = json.dumps(results, indent=1) + "\n"
    path.write_text(text)
    from . import report

    print("\n".join(report.service_section(results, None)))
    print(f"results: {path} ({results['duration_s'] / 60:.1f} min)")
    return publish(results, text) if args.publish else 0


def standalone(cfg: dict, threads: int, model: str, peer: bool, modes: list[str], quick: bool) -> dict:
    from .__main__ import machine, versions

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvstore-serve-") as tmp:
        figures = run(cfg, threads, model, peer, Path(tmp), modes)
    return {"serve": figures, "machine": machine(), "versions": versions(), "quick": quick,
            "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)), "duration_s": time.time() - started}


def publish(results: dict, text: str) -> int:
    """The per-CPU service file, then REPORT.md and the README rebuilt from the committed results."""
    from . import report
    from .__main__ import write_report

    sv = results["serve"]
    if results["quick"] or sv["not_measured"] or set(sv["modes"]) != set(MODES):
        raise SystemExit("--publish needs a full run of kvstore and llama.cpp in every mode")
    path = report.services_dir(HERE) / f"{report.cpu_slug(results)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"published: {path.relative_to(HERE.parent)}")
    suite = json.loads((HERE / "results.json").read_text())
    return write_report(suite, HERE, HERE.parent / "README.md", report.published_services(HERE, suite),
                        report.published_machines(HERE, suite))


if __name__ == "__main__":
    raise SystemExit(main())
