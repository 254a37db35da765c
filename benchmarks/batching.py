"""Many sessions at once (issue 18): `kvstore serve`'s continuous batching, paged KV memory and
prefix cache, measured against a real server over HTTP (and llama.cpp's own `llama-server`).

    python -m benchmarks.batching [--quick] [--threads 2] [--llama-server PATH | --no-peer] [--out DIR]

It is also a phase of the suite (`python -m benchmarks run`): `suite_phase(model, quick, threads, log)`
measures, `section(results)` is its report section and `targets(results, add)` puts its goals in
the report's summary.

Contract:
- Servers are benchmarks/serve.py's (`Server`, `Spec`, `kvstore_spec`): subprocesses in process
  groups of their own on free ports of 127.0.0.1, each in a folder of its own, with --threads
  threads; the client is the official `openai` package, greedy, streaming, one thread per
  concurrent session. llama.cpp's server is `llama-server` built from the llama.cpp sources of the
  llama-cpp-python SDIST_VERSION sdist (benchmarks/llama_build.py): --llama-server PATH, else
  $KVSTORE_LLAMA_SERVER, else the one in the cache folder; a full run builds it when there is none
  (unless --no-peer); when it cannot run, the results say why (`not_measured`).
- The text is the standard library's documentation (kvstore.train.corpus), cut into slices of an
  exact number of tokens with the model's tokenizer; every session gets a slice of its own, so no
  two sessions share a prefix unless the workload says so (the forks).
- Workloads (each turn's records are kept):
  decode      for each context length and number of sessions N: N sessions, each with its own
              document of that many tokens, decode `new_tokens` tokens at once (/v1/completions).
              kvstore: documents read once into base sessions; each point continues fresh forks of
              them (POST /v1/sessions/NAME/fork), so every point starts at the same context.
              llama.cpp: `llama-server --parallel max(8, N)` per point (continuous batching, its
              prompt cache warmed with the documents by one request each first). The rate is taken
              in the window where all N streams are decoding (from the last stream's first token
              to the first stream's last one): the tokens of all streams in it ÷ its length. Beside
              it the memory-bound limit: a step reads the weights once and each session's own KV,
              so N tokens per (weight bytes + Σ KV bytes) ÷ bandwidth (`limit_tok_s`), where the
              weight bytes are the GGUF's tensor data (the weights as stored), a session's KV bytes
              its context at the middle of its reply × the model's K/V bytes per token (2-byte
              elements), and the bandwidth a streaming read (`bandwidth`: a float32 sum over
              `bandwidth_mib` MiB on the same threads, best of 5) measured in this run. Beside it,
              from the server's metrics, the share of an engine step its model calls took (the
              forward and the head; the rest is the jobs' own work: sampling, events, checkpoints).
  interleave  `itl_sessions` sessions decode while another reads a `reader_tokens`-token document:
              their inter-token gaps during the read (decoders keep asking for more until it is
              read) against the gaps of the same sessions decoding alone (quiet).
  chat        stateless multi-turn conversations (the whole history resent each turn, no session
              named): prompt tokens computed per turn (usage: prompt_tokens - cached_tokens) and
              TTFT, with `--prefix-cache SIZE` and with `--prefix-cache 0`; when `kvstore serve`
              has no --prefix-cache, the server as it is, the cache "not available in this build".
  forks       `forks` forks of one `fork_doc_tokens`-token document session, each with a turn of its
              own (`fork_new_tokens` tokens), in random order (seed 0) from `fork_clients` clients,
              behind `--kv-memory fork_kv_memory`: restore p50/p99 (the server's log line per
              request: restore_s), aggregate throughput, failed requests, evictions.
- Targets (TARGETS): 8 sessions at 512 tokens ≥ 4× the rate of 1; every kvstore point ≥ 70 % of
  its limit; kvstore ≥ llama.cpp per point (reported as a ratio); the reader's p99 gap ≤ 2× the
  quiet p99; no failed fork request. A target whose figure was not measured is None, not met.
- Output: OUT/batching.json (python -m benchmarks.batching) holds every record, the summary,
  targets, the load average, CPU, threads and versions; the markdown is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import llama_build
from .llama_server import has_amx
from .serve import HERE, Server, Spec, kvstore_spec, log, percentile, stats, usage_fields

# On CPUs with AMX llama.cpp's repacked matmul path crashed (llama_peer.py); llama-server there
# (--parallel 8, default repacking) exited with SIGSEGV before it was ready (Intel Xeon, 2026-12-04)
REPACK_OFF = ("off (`--no-repack`): on this CPU with AMX, llama-server with its default repacking exited "
              "with SIGSEGV before it was ready")

FULL = {"contexts": [512, 2048], "sessions": [1, 2, 4, 8, 16], "new_tokens": 128, "reps": 2,
        "itl_sessions": 4, "itl_context": 512, "itl_new_tokens": 64, "reader_tokens": 7800,
        "chat_conversations": 4, "chat_turns": 4, "chat_doc_tokens": 1500, "chat_max_tokens": 32,
        "prefix_cache": "1GiB", "forks": 600, "fork_doc_tokens": 2048, "fork_new_tokens": 16, "fork_clients": 8,
        "fork_kv_memory": "2GiB", "kv_memory": "2GiB", "bandwidth_mib": 1024}
QUICK = {"contexts": [128, 256], "sessions": [1, 2, 4], "new_tokens": 48, "reps": 1,
         "itl_sessions": 2, "itl_context": 128, "itl_new_tokens": 32, "reader_tokens": 600,
         "chat_conversations": 2, "chat_turns": 3, "chat_doc_tokens": 600, "chat_max_tokens": 6,
         "prefix_cache": "64MiB", "forks": 8, "fork_doc_tokens": 256, "fork_new_tokens": 4, "fork_clients": 2,
         "fork_kv_memory": "24MiB", "kv_memory": "128MiB", "bandwidth_mib": 256}
TARGETS = {"scaling": {"context": 512, "sessions": 8, "times": 4.0}, "of_limit": 0.70, "vs_llama": 1.0,
           "itl_p99_ratio": 2.0, "failed": 0}
LLAMA_PARALLEL = 8  # llama-server --parallel, at least (the configuration)
CONTINUE = "\n"  # what a decode turn appends to its session's document before it generates


# -- pure figures ----------------------------------------------------------------------------------
def limit_tok_s(weight_bytes: float, kv_bytes: list[float], bandwidth: float) -> float:
    """The memory-bound decode rate of a step that reads the weights once and each session's KV once:
    len(kv_bytes) tokens per (weight_bytes + Σ kv_bytes) / bandwidth seconds."""
    return len(kv_bytes) * bandwidth / (weight_bytes + sum(kv_bytes))


def window(streams: list[dict]) -> dict | None:
    """The window where every stream is decoding (the last first token to the first last token) and
    the tokens all streams received in it (a stream's chunks weighted by its tokens per chunk); None
    when there is no such window (a stream ended before another began)."""
    times = [s["times"] for s in streams]
    if any(len(t) < 2 for t in times):
        return None
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end <= start:
        return None
    tokens = sum(sum(start < x <= end for x in s["times"]) * s["completion_tokens"] / len(s["times"]) for s in streams)
    return {"start": start, "end": end, "seconds": end - start, "tokens": tokens, "tok_s": tokens / (end - start)}


def gaps(times: list[float]) -> list[float]:
    """The gaps between consecutive chunks of one reply (its first chunk is its TTFT, not a gap)."""
    return [b - a for a, b in zip(times, times[1:])]


def gaps_within(times: list[float], start: float, end: float) -> list[float]:
    """The gaps of one reply that end inside (start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if start < b <= end]


def context_bytes(stream: dict, kv_bytes_per_token: int) -> float:
    """A decoding session's KV at the middle of its reply: its prompt (all positions before the reply)
    and half its reply."""
    return (stream["prompt_tokens"] + stream["completion_tokens"] / 2) * kv_bytes_per_token


# -- the machine and the model ---------------------------------------------------------------------
def bandwidth(threads: int, mib: int, reps: int = 5) -> dict:
    """A plain streaming read on `threads` threads: a float32 sum over `mib` MiB (far above any cache),
    best of `reps`, in bytes per second."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        x.sum()  # the pages are touched once before they are timed
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return {"bytes_per_s": x.numel() * 4 / min(times), "bytes": x.numel() * 4, "seconds": times, "threads": threads}


def model_facts(gguf: Path) -> dict:
    """The GGUF's tensor data bytes (what a decode step reads of the weights, as stored) and the K/V
    bytes of one token (every layer, 2-byte elements: kvstore's bfloat16, llama.cpp's f16)."""
    from gguf import GGUFReader

    from .serve import state_bytes_per_token

    reader = GGUFReader(str(gguf))
    return {"weight_bytes": int(sum(int(t.n_bytes) for t in reader.tensors)),
            "kv_bytes_per_token": state_bytes_per_token(gguf)}


class Texts:
    """Slices of the standard library's documentation of an exact number of tokens, each from a part of
    the text no other slice of this object took (until the text runs out and wraps)."""

    def __init__(self, gguf: Path, tokens: int):
        import kvstore
        from kvstore.train.corpus import document

        self.tokenizer = kvstore.load_tokenizer(str(gguf))
        self.ids = self.tokenizer.encode(document(int(tokens * 4.5)), add_bos=False)
        self.at = 0

    def take(self, n: int) -> str:
        if self.at + n > len(self.ids):
            self.at = 0
        piece, self.at = self.ids[self.at:self.at + n], self.at + n
        return self.tokenizer.decode(piece)


def text_tokens(cfg: dict) -> int:
    """The tokens of text every workload takes, together."""
    decode = max(cfg["sessions"]) * sum(cfg["contexts"])
    return decode + cfg["reader_tokens"] + cfg["chat_conversations"] * cfg["chat_doc_tokens"] + cfg["fork_doc_tokens"]


# -- talking to a server ---------------------------------------------------------------------------
def complete(server: Server, prompt: str, max_tokens: int, session: str | None = None,
             first_chunk: threading.Event | None = None) -> dict:
    """One streamed /v1/completions request: the time it was sent, each content chunk's arrival, its
    usage (serve.usage_fields) or its error. `first_chunk` is set when its first content arrives."""
    headers = {"X-Session-Id": session} if session else {}
    sent, times, usage = time.perf_counter(), [], None
    try:
        chunks = server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_headers=headers)
        for chunk in chunks:
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
                if first_chunk is not None:
                    first_chunk.set()
    except Exception as e:  # noqa: BLE001 -- a failed request is a figure of the benchmark
        return {"sent": sent, "times": times, "error": f"{type(e).__name__}: {e}"[:300], "session": session,
                "completion_tokens": len(times), "prompt_tokens": None, "cached_tokens": None}
    return {"sent": sent, "times": times, "error": None, "session": session} | usage_fields(usage, len(times))


def together(calls: list) -> list:
    """Run the zero-argument calls at once, one thread each: their results in order."""
    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def fork(server: Server, name: str, new_name: str) -> float:
    """POST /v1/sessions/NAME/fork: the seconds it took (RuntimeError when refused)."""
    import httpx

    t = time.perf_counter()
    r = httpx.post(f"{server.base_url}/v1/sessions/{name}/fork", json={"name": new_name}, timeout=600)
    if r.status_code != 201:
        raise RuntimeError(f"fork {name} -> {new_name}: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(server: Server) -> dict[str, float]:
    """GET /metrics as {"name{labels}": value} (without the counters' creation times)."""
    import httpx

    out = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=60).text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#") and not m[1].endswith("_created"):  # _created: a timestamp
            with contextlib.suppress(ValueError):
                out[m[1] + (m[2] or "")] = float(m[3])
    return out


def grown(after: dict, before: dict, prefix: str) -> dict[str, float]:
    """How much each sample whose name starts with `prefix` grew between two scrapes."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix)}


def steps_mean(after: dict, before: dict) -> float | None:
    """Mean sessions per engine forward between two scrapes (kvstore:batch_sessions_per_step)."""
    d = grown(after, before, "kvstore:batch_sessions_per_step_")
    count = d.get("kvstore:batch_sessions_per_step_count", 0)
    return d["kvstore:batch_sessions_per_step_sum"] / count if count else None


def step_split(after: dict, before: dict) -> dict:
    """Between two scrapes: the mean seconds of an engine step and the share of them its model calls
    took (kvstore:engine_step_seconds, kvstore:model_forward_seconds); the rest is the jobs' own work
    (sampling, events, checkpoints). {} where no step was reported (a server without these metrics)."""
    steps = grown(after, before, "kvstore:engine_step_seconds_")
    model = grown(after, before, "kvstore:model_forward_seconds_")
    count, total = steps.get("kvstore:engine_step_seconds_count", 0), steps.get("kvstore:engine_step_seconds_sum", 0)
    if not count or not total:
        return {}
    return {"step_s": total / count, "model_share": model.get("kvstore:model_forward_seconds_sum", 0) / total}


def steps_after(server: Server, before: dict, wait_s: float = 3.0) -> float | None:
    """`steps_mean` once the point's forwards have reached the metrics: an engine reports them as it
    goes idle, a moment after the last reply's end reached the client."""
    deadline = time.monotonic() + wait_s
    while (mean := steps_mean(scrape(server), before)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return mean


def server_log_records(server: Server) -> list[dict]:
    """The JSON log lines (--log-format json) of every life of this server."""
    out = []
    for path in sorted(server.folder.glob("server-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start >= 0 and '"request_id"' in line:
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line[start:]))
    return out


def serve_help() -> str:
    """`kvstore serve --help` of this checkout ("" when it does not run)."""
    try:
        done = subprocess.run([sys.executable, "-m", "kvstore_cli", "serve", "--help"], capture_output=True, text=True,
                              timeout=120, cwd=HERE.parent)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


@contextlib.contextmanager
def phase(name: str, seconds: dict):
    """Log the phase's name, then record how long it took in `seconds`."""
    log(f"  {name}:")
    start = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - start
    log(f"  ... {seconds[name]:.0f} s")


@contextlib.contextmanager
def running(spec: Spec, folder: Path):
    """A started server, stopped at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    server = Server(spec, folder)
    try:
        ready = server.start()
        log(f"  {spec.label} ready in {ready:.1f} s")
        yield server
    finally:
        server.stop()


def kvstore_server(model: str, threads: int, folder: Path, label: str, *options: str) -> Spec:
    base = ("--max-running", "64", "--max-queue", "1024", "--log-format", "json")
    return kvstore_spec(model, threads, folder / "home", extra=base + options, label=label)


def llama_server_spec(binary: Path, gguf: Path, threads: int, parallel: int, slot_tokens: int) -> Spec:
    """`llama-server` with `parallel` slots of `slot_tokens` positions each, continuous batching (its default)."""
    def argv(port: int) -> list[str]:
        return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                "-tb", str(threads), "-c", str(parallel * slot_tokens), "--parallel", str(parallel),
                *(("--no-repack",) if has_amx() else ())]

    return Spec(f"llama.cpp --parallel {parallel}", argv, "/health", sessions=False,
                notes={"parallel": parallel, "ctx": parallel * slot_tokens})


# -- workload 1: decode rate against the memory-bound limit ------------------------------------------
def point_figures(streams: list[dict], facts: dict, bw: float) -> dict:
    """A point's rate (window), its limit, and their ratio."""
    w = window(streams)
    kv = [context_bytes(s, facts["kv_bytes_per_token"]) for s in streams]
    limit = limit_tok_s(facts["weight_bytes"], kv, bw)
    out = {"limit_tok_s": limit, "kv_bytes": sum(kv), "errors": sum(s["error"] is not None for s in streams),
           "completion_tokens": [s["completion_tokens"] for s in streams]}
    if w is not None:
        out |= {"tok_s": w["tok_s"], "window_s": w["seconds"], "window_tokens": w["tokens"], "of_limit": w["tok_s"] / limit}
    return out


def kvstore_decode(server: Server, cfg: dict, texts: dict, facts: dict, bw: float) -> list[dict]:
    """Base sessions per context, then every point on fresh forks of them."""
    top = max(cfg["sessions"])
    for n in cfg["contexts"]:
        made = together([lambda i=i: complete(server, texts[n][i], 1, f"b{n}-{i}") for i in range(top)])
        bad = [m["error"] for m in made if m["error"]]
        if bad:
            raise RuntimeError(f"the base sessions of {n} tokens: {bad[0]}")
    points = []
    for rep in range(cfg["reps"]):
        for n in cfg["contexts"]:
            for count in cfg["sessions"]:
                names = [f"p{n}-{count}-{rep}-{i}" for i in range(count)]
                for i, name in enumerate(names):
                    fork(server, f"b{n}-{i}", name)
                before = scrape(server)
                streams = together([lambda s=s: complete(server, CONTINUE, cfg["new_tokens"], s) for s in names])
                p = {"server": "kvstore", "context": n, "sessions": count, "rep": rep, "load_1min": os.getloadavg()[0],
                     "sessions_per_step": steps_after(server, before)} | point_figures(streams, facts, bw)
                p |= step_split(scrape(server), before)
                points.append(p)
                log(f"    kvstore   {n:5} tokens x {count:2}: {p.get('tok_s', 0):7.1f} tok/s "
                    f"(limit {p['limit_tok_s']:.0f}, {p.get('of_limit', 0) * 100:.0f} %)")
    return points


def llama_decode(binary: Path, gguf: Path, threads: int, cfg: dict, texts: dict, facts: dict, bw: float,
                 folder: Path) -> list[dict]:
    """Every point on a fresh llama-server with --parallel max(8, N): the documents sent once each
    (its prompt cache keeps them in their slots), then the measured requests on the same documents."""
    points = []
    for rep in range(cfg["reps"]):
        for n in cfg["contexts"]:
            for count in cfg["sessions"]:
                parallel = max(LLAMA_PARALLEL, count)
                spec = llama_server_spec(binary, gguf, threads, parallel, n + cfg["new_tokens"] + 64)
                with running(spec, folder / f"llama-{n}-{count}-{rep}") as server:
                    together([lambda i=i: complete(server, texts[n][i], 1) for i in range(count)])
                    streams = together([lambda i=i: complete(server, texts[n][i], cfg["new_tokens"])
                                        for i in range(count)])
                for s in streams:  # its usage may leave the prompt out: the document's own length then
                    s["prompt_tokens"] = s["prompt_tokens"] or n
                p = {"server": "llama.cpp", "context": n, "sessions": count, "rep": rep, "parallel": parallel,
                     "load_1min": os.getloadavg()[0]} | point_figures(streams, facts, bw)
                points.append(p)
                log(f"    llama.cpp {n:5} tokens x {count:2}: {p.get('tok_s', 0):7.1f} tok/s")
    return points


def decode_summary(points: list[dict], cfg: dict) -> list[dict]:
    """Per (context, sessions): the median rate of each server over the repetitions, kvstore's limit and
    share of it, and kvstore ÷ llama.cpp."""
    rows = []
    for n in cfg["contexts"]:
        for count in cfg["sessions"]:
            row = {"context": n, "sessions": count}
            for server in ("kvstore", "llama.cpp"):
                mine = [p for p in points if p["server"] == server and p["context"] == n and p["sessions"] == count]
                rates = [p["tok_s"] for p in mine if "tok_s" in p]
                if rates:
                    row[server] = {"tok_s": percentile(rates, 50), "min": min(rates), "max": max(rates),
                                   "limit_tok_s": percentile([p["limit_tok_s"] for p in mine], 50)}
            ours = row.get("kvstore")
            if ours:
                ours["of_limit"] = ours["tok_s"] / ours["limit_tok_s"]
                steps = [p["sessions_per_step"] for p in points if p["server"] == "kvstore" and p["context"] == n
                         and p["sessions"] == count and p.get("sessions_per_step")]
                ours["sessions_per_step"] = percentile(steps, 50) if steps else None
                shares = [p["model_share"] for p in points if p["server"] == "kvstore" and p["context"] == n
                          and p["sessions"] == count and p.get("model_share")]
                ours["model_share"] = percentile(shares, 50) if shares else None
            if ours and row.get("llama.cpp"):
                row["ratio"] = ours["tok_s"] / row["llama.cpp"]["tok_s"]
            rows.append(row)
    return rows


# -- workload 2: inter-token latency while a long document is read -------------------------------------
def interleave(server: Server, cfg: dict, texts: dict, reader_text: str) -> dict:
    """The decoders' gaps alone (quiet), then while a new session reads `reader_text` (loaded)."""
    n, count = cfg["itl_context"], cfg["itl_sessions"]
    bases = [f"b{n}-{i}" for i in range(count)]
    for i, b in enumerate(bases):
        fork(server, b, f"quiet-{i}")
        fork(server, b, f"busy-{i}")
    quiet = together([lambda i=i: complete(server, CONTINUE, cfg["itl_new_tokens"], f"quiet-{i}") for i in range(count)])
    quiet_gaps = [g for s in quiet for g in gaps(s["times"])]
    started = [threading.Event() for _ in range(count)]
    done = threading.Event()

    def decoder(i: int) -> list[dict]:
        replies = []
        while not done.is_set() or len(replies) < 2:
            # its second reply's first token sets `started`: the decoders are mid-reply, not between requests
            replies.append(complete(server, CONTINUE, cfg["itl_new_tokens"], f"busy-{i}", started[i] if replies else None))
            if replies[-1]["error"]:
                started[i].set()
                break
        return replies

    with ThreadPoolExecutor(max_workers=count) as pool:
        running_decoders = [pool.submit(decoder, i) for i in range(count)]
        for e in started:  # every decoder is streaming its second reply (the first ones began together)
            e.wait(600)
        reader = complete(server, reader_text, 1, "reader")
        done.set()
        busy = [r for f in running_decoders for r in f.result()]
    read_end = reader["times"][0] if reader["times"] else time.perf_counter()
    loaded_gaps = [g for r in busy for g in gaps_within(r["times"], reader["sent"], read_end)]
    out = {"sessions": count, "context": n, "reader_tokens": reader["prompt_tokens"], "reader_s": read_end - reader["sent"],
           "replies": {"quiet": [s["completion_tokens"] for s in quiet], "during": [r["completion_tokens"] for r in busy]},
           "errors": sum(r["error"] is not None for r in quiet + busy + [reader]),
           "quiet": stats(quiet_gaps) if quiet_gaps else None, "loaded": stats(loaded_gaps) if loaded_gaps else None}
    if out["quiet"] and out["loaded"]:
        out["p99_ratio"] = out["loaded"]["p99"] / out["quiet"]["p99"]
    return out


# -- workload 3: stateless multi-turn chat, with and without the prefix cache --------------------------
def chat_run(server: Server, cfg: dict, docs: list[str], mode: str) -> list[dict]:
    """`chat_conversations` conversations, `chat_turns` turns each, round robin, no session named."""
    from .serve import Conversation, turn

    convs = [Conversation(f"s{i}", doc) for i, doc in enumerate(docs)]
    records = []
    for t in range(cfg["chat_turns"]):
        for conv in convs:
            r = turn(server, conv, cfg["chat_max_tokens"])
            computed = r["prompt_tokens"] - (r["cached_tokens"] or 0) if r["prompt_tokens"] is not None else None
            records.append({"mode": mode, "conversation": conv.name, "turn": t, "computed_tokens": computed} | r)
    return records


def chat_summary(records: list[dict]) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        mine = [r for r in records if r["mode"] == mode]
        turns = sorted({r["turn"] for r in mine})
        per_turn = {t: [r for r in mine if r["turn"] == t] for t in turns}
        out[mode] = {
            "prompt_tokens": [percentile([r["prompt_tokens"] for r in per_turn[t]], 50) for t in turns],
            "computed_tokens": [percentile([r["computed_tokens"] for r in per_turn[t]], 50) for t in turns],
            "ttft_s": stats([r["ttft_s"] for r in mine if r["ttft_s"] is not None]),
            "ttft_later_s": stats([r["ttft_s"] for r in mine if r["turn"] > 0 and r["ttft_s"] is not None] or [0.0]),
            "computed_total": sum(r["computed_tokens"] for r in mine), "prompt_total": sum(r["prompt_tokens"] for r in mine)}
    return out


# -- workload 4: more sessions than memory -------------------------------------------------------------
def forks_run(server: Server, cfg: dict, doc: str) -> dict:
    made = complete(server, doc, 1, "doc")
    if made["error"]:
        raise RuntimeError(f"the document session: {made['error']}")
    names = [f"f{i:04d}" for i in range(cfg["forks"])]
    fork_s = [fork(server, "doc", name) for name in names]
    order = names[:]
    random.Random(0).shuffle(order)
    work, lock, records = iter(order), threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                name = next(work, None)
            if name is None:
                return
            r = complete(server, f"\nNote {name}:", cfg["fork_new_tokens"], name)
            records.append(r | {"ttft_s": r["times"][0] - r["sent"] if r["times"] else None,
                                "total_s": time.perf_counter() - r["sent"]})

    before = scrape(server)
    start = time.perf_counter()
    together([client] * cfg["fork_clients"])
    wall = time.perf_counter() - start
    after = scrape(server)
    logged = {r["session"]: r for r in server_log_records(server) if r.get("session") in set(names)}
    restores = [r["restore_s"] for r in logged.values() if r.get("restore_s") is not None]
    contexts = [r.get("context") for r in logged.values()]
    tokens = sum(r["completion_tokens"] for r in records if not r["error"])
    return {"forks": len(names), "doc_tokens": made["prompt_tokens"], "fork_s": stats(fork_s), "wall_s": wall,
            "requests": len(records), "failed": sum(r["error"] is not None for r in records),
            "errors": sorted({r["error"] for r in records if r["error"]})[:5],
            "tokens": tokens, "tok_s": tokens / wall, "requests_per_s": len(records) / wall,
            "ttft_s": stats([r["ttft_s"] for r in records if r["ttft_s"] is not None] or [0.0]),
            "restore_s": stats(restores) if restores else None, "restored": len(restores),
            "contexts": {c: contexts.count(c) for c in dict.fromkeys(contexts)},
            "evictions": grown(after, before, "kvstore:kv_evictions_total").get("kvstore:kv_evictions_total", 0.0)}


# -- the whole benchmark -----------------------------------------------------------------------------
def run(cfg: dict, threads: int, model: str, workdir: Path, peer: bool = True, llama_server: str | None = None,
        build: bool = False) -> dict:
    """Every workload (see the module's docstring): figures as a JSON-able dict. llama.cpp is left out
    (with why) when `peer` is false or no llama-server is found (`build`: build one first)."""
    import kvstore

    help_text = serve_help()
    out = {"config": dict(cfg), "threads": threads, "model": model, "targets": TARGETS, "not_measured": {}}
    if "--kv-memory" not in help_text:
        out["not_measured"]["kvstore"] = "`kvstore serve` of this checkout has no --kv-memory (issue 18 not landed)"
        return out
    gguf = Path(kvstore.pull(model, quiet=True)) if Path(model).suffix != ".gguf" else Path(model)
    binary, why = llama_binary(peer, llama_server, build)
    if binary is None:
        out["not_measured"]["llama.cpp"] = why
    else:
        out["llama_server"] = {"version": llama_build.version(binary), "sdist": llama_build.SDIST_VERSION,
                               "repack": REPACK_OFF if has_amx() else "on (its default)"}
    prefix = "--prefix-cache" in help_text
    if not prefix:
        out["not_measured"]["prefix cache"] = "not available in this build (`kvstore serve` has no --prefix-cache)"
    facts = model_facts(gguf)
    bw = bandwidth(threads, cfg["bandwidth_mib"])
    log(f"  streaming read: {bw['bytes_per_s'] / 1e9:.2f} GB/s on {threads} threads; weights {facts['weight_bytes'] / 1e6:.1f} MB, "
        f"KV {facts['kv_bytes_per_token']} B/token")
    source = Texts(gguf, text_tokens(cfg))
    top = max(cfg["sessions"])
    texts = {n: [source.take(n) for _ in range(top)] for n in cfg["contexts"]}
    if cfg["itl_context"] not in texts:
        texts[cfg["itl_context"]] = [source.take(cfg["itl_context"]) for _ in range(top)]
    reader_text = source.take(cfg["reader_tokens"])
    chat_docs = [source.take(cfg["chat_doc_tokens"]) for _ in range(cfg["chat_conversations"])]
    fork_doc = source.take(cfg["fork_doc_tokens"])
    out |= {"model_file": gguf.name, "facts": facts, "bandwidth": bw}

    timed = out["phase_s"] = {}
    decode = kvstore_server(model, threads, workdir / "decode", "kvstore", "--kv-memory", cfg["kv_memory"])
    with phase("decode (kvstore) and interleaving", timed), running(decode, workdir / "decode") as server:
        points = kvstore_decode(server, cfg, texts, facts, bw["bytes_per_s"])
        if cfg["itl_context"] not in cfg["contexts"]:
            together([lambda i=i: complete(server, texts[cfg["itl_context"]][i], 1, f"b{cfg['itl_context']}-{i}")
                      for i in range(cfg["itl_sessions"])])
        out["interleave"] = interleave(server, cfg, texts, reader_text)
    if binary is not None:
        with phase("decode (llama.cpp)", timed):
            try:
                points += llama_decode(binary, gguf, threads, cfg, texts, facts, bw["bytes_per_s"], workdir / "llama")
            except RuntimeError as e:  # a server that did not start: the rest of the benchmark still runs
                out["not_measured"]["llama.cpp"] = f"llama-server failed: {e}"[:600]
                log(f"  llama.cpp not measured: {e}")
    out["points"], out["decode"] = points, decode_summary(points, cfg)

    modes = [("prefix cache", ("--prefix-cache", cfg["prefix_cache"])), ("no prefix cache", ("--prefix-cache", "0"))]
    records = []
    with phase("stateless chat", timed):
        for mode, options in modes if prefix else [("no prefix cache", ())]:
            folder = workdir / ("chat-" + mode.replace(" ", "-"))
            spec = kvstore_server(model, threads, folder, f"kvstore, {mode}", "--kv-memory", cfg["kv_memory"], *options)
            spec = dataclasses.replace(spec, sessions=False)  # no X-Session-Id: every request is stateless
            with running(spec, folder) as server:
                before = scrape(server)
                records += chat_run(server, cfg, chat_docs, mode)
                after = scrape(server)
                out.setdefault("chat_metrics", {})[mode] = (grown(after, before, "kvstore:prefix_cache")
                                                            | grown(after, before, "kvstore:prompt_tokens_total"))
    out["chat_turns"], out["chat"] = records, chat_summary(records)

    forks = kvstore_server(model, threads, workdir / "forks", "kvstore", "--kv-memory", cfg["fork_kv_memory"])
    with phase("forks behind a KV budget", timed), running(forks, workdir / "forks") as server:
        out["forks"] = forks_run(server, cfg, fork_doc)
        out["forks"] |= {"kv_memory": cfg["fork_kv_memory"],
                         "resident_bytes": cfg["forks"] * (out["forks"]["doc_tokens"] + cfg["fork_new_tokens"] + 8)
                         * facts["kv_bytes_per_token"]}
    out["verdicts"] = verdicts(out)
    return out


def llama_binary(peer: bool, explicit: str | None, build: bool) -> tuple[Path | None, str]:
    if not peer:
        return None, "left out (--no-peer)"
    binary, why = llama_build.find(explicit)
    if binary is None and build:
        log("  building llama-server (python -m benchmarks.llama_build) ...")
        try:
            binary, why = llama_build.build(), ""
        except (RuntimeError, OSError) as e:
            return None, f"llama-server could not be built: {e}"
    return binary, why


def verdicts(r: dict) -> list[dict]:
    """[{goal, figure, target, met: True | False | None (not measured)}]."""
    rows = []

    def add(goal: str, value, text: str, target: str, ok) -> None:
        rows.append({"goal": goal, "figure": text if value is not None else "not measured", "target": target,
                     "met": None if value is None else bool(ok(value))})

    targets(r, add)
    return rows


def targets(r: dict, add) -> None:
    """The goals of the issue, each through `add(goal, value, text, target, ok)` (the report's shape;
    `verdicts` collects them): value None where the figure was not measured."""
    decode = {(row["context"], row["sessions"]): row for row in r.get("decode", [])}
    s = TARGETS["scaling"]
    one, many = decode.get((s["context"], 1), {}).get("kvstore"), decode.get((s["context"], s["sessions"]), {}).get("kvstore")
    times = many["tok_s"] / one["tok_s"] if one and many else None
    add(f"decode rate, {s['sessions']} sessions at {s['context']:,} tokens ÷ 1 session", times,
        f"{times:.2f}×" if times else "", f"≥ {s['times']:.0f}×", lambda v: v >= s["times"])
    shares = [row["kvstore"]["of_limit"] for row in decode.values() if row.get("kvstore")]
    low = min(shares) if shares else None
    add("decode rate ÷ its memory-bound limit, lowest point", low, f"{low * 100:.0f} %" if low else "",
        f"≥ {TARGETS['of_limit'] * 100:.0f} %", lambda v: v >= TARGETS["of_limit"])
    ratios = [row["ratio"] for row in decode.values() if "ratio" in row]
    worst = min(ratios) if ratios else None
    add("decode rate ÷ llama-server's (continuous batching), lowest point", worst, f"{worst:.2f}×" if worst else "",
        "≥ 1×", lambda v: v >= TARGETS["vs_llama"])
    itl = r.get("interleave", {}).get("p99_ratio")
    add("inter-token p99 while a long document is read ÷ quiet p99", itl, f"{itl:.2f}×" if itl else "",
        f"≤ {TARGETS['itl_p99_ratio']:.0f}×", lambda v: v <= TARGETS["itl_p99_ratio"])
    failed = r.get("forks", {}).get("failed")
    add("failed requests, forks behind the KV budget", failed, f"{failed}", "0", lambda v: v == TARGETS["failed"])


# -- the report ----------------------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def markdown(r: dict) -> str:
    """The section of REPORT.md for one run's results."""
    lines = ["## Many sessions at once", ""]
    cfg = r.get("config", {})
    lines.append(f"`kvstore serve` with continuous batching and paged KV memory (`python -m benchmarks.batching`), "
                 f"threads: {r.get('threads')}, model {r.get('model_file', r.get('model'))}, weights as stored.")
    if r.get("bandwidth"):
        f = r["facts"]
        lines.append(f"Streaming read measured in this run: {r['bandwidth']['bytes_per_s'] / 1e9:.2f} GB/s; weights "
                     f"{f['weight_bytes'] / 1e6:.1f} MB, KV {f['kv_bytes_per_token']:,} bytes per token.")
    if r.get("llama_server"):
        lines.append(f"llama.cpp: `llama-server` from the llama-cpp-python {r['llama_server']['sdist']} sources "
                     f"({r['llama_server']['version']})"
                     + (f"; CPU weight repacking {r['llama_server']['repack']}." if "repack" in r["llama_server"] else "."))
    lines.append("")
    for what, why in r.get("not_measured", {}).items():
        lines.append(f"- Not measured: {what}: {why}")
    if r.get("not_measured"):
        lines.append("")
    if r.get("verdicts"):
        lines += ["| goal | figure | target | met |", "|---|---|---|---|"]
        mark = {True: "yes", False: "**no**", None: "not measured"}
        lines += [f"| {v['goal']} | {v['figure']} | {v['target']} | {mark[v['met']]} |" for v in r["verdicts"]]
        lines.append("")
    if r.get("decode"):
        lines += [f"Aggregate decode rate, {cfg.get('new_tokens')} tokens per session (median of {cfg.get('reps')}; the "
                  "window where every session decodes), beside the memory-bound limit "
                  "(weights + every session's KV per step, at the measured bandwidth). Model calls ÷ step: the "
                  "share of the engine's steps spent in the forward and the output head "
                  "(`kvstore:model_forward_seconds` ÷ `kvstore:engine_step_seconds`); the rest is the jobs' own "
                  "work: sampling, streaming, checkpoints:", "",
                  "| context | sessions | kvstore tok/s | limit tok/s | of limit | sessions per forward | "
                  "model calls ÷ step | llama.cpp tok/s | kvstore ÷ llama.cpp |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in r["decode"]:
            k, ll = row.get("kvstore"), row.get("llama.cpp")
            cells = [f"{row['context']:,}", str(row["sessions"])]
            cells += [f"{k['tok_s']:.1f}", f"{k['limit_tok_s']:.0f}", f"{k['of_limit'] * 100:.0f} %",
                      f"{k['sessions_per_step']:.1f}" if k.get("sessions_per_step") else "–",
                      f"{k['model_share'] * 100:.0f} %" if k.get("model_share") else "–"] if k else ["–"] * 5
            cells += [f"{ll['tok_s']:.1f}" if ll else "–", f"{row['ratio']:.2f}×" if "ratio" in row else "–"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    it = r.get("interleave")
    if it and it.get("quiet") and it.get("loaded"):
        lines += [f"Inter-token gaps of {it['sessions']} decoding sessions ({it['context']:,}-token contexts), alone and "
                  f"while another session reads {it['reader_tokens']:,} tokens ({it['reader_s']:.1f} s):", "",
                  "| | p50 | p99 | gaps |", "|---|---:|---:|---:|",
                  f"| quiet | {ms(it['quiet']['p50'])} | {ms(it['quiet']['p99'])} | {it['quiet']['n']} |",
                  f"| during the read | {ms(it['loaded']['p50'])} | {ms(it['loaded']['p99'])} | {it['loaded']['n']} |",
                  f"| during ÷ quiet | {it['loaded']['p50'] / it['quiet']['p50']:.2f}× | "
                  f"{it['loaded']['p99'] / it['quiet']['p99']:.2f}× | |", ""]
    if r.get("chat"):
        lines += [f"Stateless multi-turn chat: {cfg.get('chat_conversations')} conversations × {cfg.get('chat_turns')} "
                  "turns, the whole history resent each turn, no session named (medians per turn):", "",
                  "| server | prompt tokens per turn | computed per turn | computed, all turns | TTFT p50 | TTFT p50, "
                  "later turns |", "|---|---|---|---:|---:|---:|"]
        for mode, c in r["chat"].items():
            lines.append(f"| {mode} | {' / '.join(f'{x:,.0f}' for x in c['prompt_tokens'])} | "
                         f"{' / '.join(f'{x:,.0f}' for x in c['computed_tokens'])} | "
                         f"{c['computed_total']:,} of {c['prompt_total']:,} | {ms(c['ttft_s']['p50'])} | "
                         f"{ms(c['ttft_later_s']['p50'])} |")
        if "prefix cache" in r.get("not_measured", {}):
            lines.append("| prefix cache | not available in this build | | | | |")
        lines.append("")
    fk = r.get("forks")
    if fk:
        restore = (f"restore p50 {ms(fk['restore_s']['p50'])}, p99 {ms(fk['restore_s']['p99'])} "
                   f"({fk['restored']} restores)" if fk.get("restore_s") else "no restore logged")
        lines += [f"{fk['forks']:,} forks of a {fk['doc_tokens']:,}-token document session, one turn each "
                  f"({cfg.get('fork_new_tokens')} tokens) in random order from {cfg.get('fork_clients')} clients, "
                  f"behind --kv-memory {fk['kv_memory']} (resident and unshared they would take "
                  f"{fk['resident_bytes'] / 1e6:,.0f} MB): {restore}; {fk['tok_s']:.1f} tok/s, "
                  f"{fk['requests_per_s']:.1f} requests/s in aggregate; TTFT p50 {ms(fk['ttft_s']['p50'])}, p99 "
                  f"{ms(fk['ttft_s']['p99'])}; {fk['evictions']:.0f} evictions; **{fk['failed']} failed requests**.", ""]
    return "\n".join(lines).rstrip() + "\n"


# -- as a phase of the suite (benchmarks/__main__.py, benchmarks/report.py) -----------------------------
def suite_phase(model, quick: bool, threads: int, log=print) -> dict:
    """The suite's batching phase on the suite's model (its GGUF), in a folder of its own: a full
    run builds llama-server when none is found."""
    source = getattr(model, "source", None)
    spec = str(source) if source and Path(str(source)).suffix == ".gguf" else "smollm2"
    log(f"  batching: {'quick' if quick else 'full'} workloads on {Path(spec).name}")
    with tempfile.TemporaryDirectory(prefix="kvstore-batching-") as tmp:
        return run(dict(QUICK if quick else FULL), threads, spec, Path(tmp), build=not quick)


def section(r: dict) -> list[str]:
    return markdown(r).splitlines() + [""]


# -- alone ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batching", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized: short contexts, few sessions (about 2 min)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="alias or .gguf path (llama.cpp needs a GGUF)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure llama.cpp's llama-server (a full run builds it when none is found)")
    p.add_argument("--llama-server", help=f"the llama-server binary (also ${llama_build.ENV})")
    p.add_argument("--reps", type=int, help="repetitions of the decode points")
    p.add_argument("--out", type=Path, default=HERE / "out")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (their finally) first
    cfg = dict(QUICK if args.quick else FULL)
    if args.reps:
        cfg["reps"] = args.reps
    from .__main__ import machine, versions

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvstore-batching-") as tmp:
        figures = run(cfg, args.threads, args.model, Path(tmp), args.peer, args.llama_server, build=not args.quick)
    results = {"batching": figures, "machine": machine(), "versions": versions(), "quick": args.quick,
               "load_1min": os.getloadavg()[0], "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
               "duration_s": time.time() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "batching.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(figures))
    print(f"results: {path} ({results['duration_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
