"""kvstore against what people would use instead: one suite, one report.

    python -m benchmarks run              # full suite (~15 min on 2 cores, then ~30 min for the store of
                                          # 100,000 sessions): publishes (below)
    python -m benchmarks run --quick      # CI-sized (< 3 min; a store of 1,000 sessions): into benchmarks/out/
    python -m benchmarks.scale [--quick]  # the store-scale phase alone: benchmarks/out/scale.json
    python -m benchmarks.serve [--quick]  # the service phase alone (`kvstore serve` vs llama.cpp's server):
                                          # benchmarks/out/serve.json; --publish: its per-CPU file
    python -m benchmarks report [--results benchmarks/results.json] [--dest DIR] [--readme README.md]

`run` loads SmolLM2-135M-Instruct in bfloat16 on --threads threads for kvstore and Hugging Face
transformers (and llama.cpp's own Q4_1 run when llama-cpp-python is installed), measures
alternately (A B A B) and writes every repetition to results.json, then the report from it.
A full run with the peers publishes: benchmarks/results.json (and a copy per CPU model in
benchmarks/results/), benchmarks/REPORT.md with plots/, and the README's Benchmarks section, all
from that one results.json, plus a Service section for each CPU's published service results
(benchmarks/results/serve/<cpu>.json, from `python -m benchmarks.serve --publish`) other than this
run's own. `report` rebuilds them from a results.json and those files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
FULL = {"lengths": [512, 1024, 2048, 4096, 8191], "save_lengths": [2048, 8191], "reps": 5, "engine_reps": 7,
        "max_wait": 10.0, "decode_new": 129, "decode_prompt": 1024, "intervals": [1, 4, 16, 64], "forks": 16,
        "fork_new": 16}
# --quick also shortens benchmarks.engine's prompts (its module constants) to these
QUICK = {"lengths": [512, 2048], "save_lengths": [2048], "reps": 2, "engine_reps": 2, "max_wait": 0.0,
         "decode_new": 33, "decode_prompt": 512, "intervals": [1, 4, 16, 64], "forks": 4, "fork_new": 4,
         "engine_prompt": 256, "engine_prefill": 512}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure, then write results.json and the report")
    run.add_argument("--quick", action="store_true", help="CI-sized: short lengths, 2 repetitions (< 3 min)")
    run.add_argument("--reps", type=int, help="repetitions per measurement (engine: --reps too)")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--model", default="smollm2", help="alias or .gguf path")
    run.add_argument("--no-peers", action="store_true", help="kvstore only (no HF transformers, no llama.cpp)")
    run.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even when it is installed")
    run.add_argument("--out", type=Path, default=OUT, help="where results.json goes (default benchmarks/out)")
    run.add_argument("--dest", type=Path,
                     help="where REPORT.md and plots/ go (default: benchmarks/ for a full run with the peers, else --out)")
    rep = sub.add_parser("report", help="write REPORT.md and plots from a results.json")
    rep.add_argument("--results", type=Path, default=HERE / "results.json")
    rep.add_argument("--dest", type=Path, default=HERE)
    rep.add_argument("--readme", type=Path, help="also put the summary table into this README's Benchmarks section")
    args = p.parse_args(argv)
    if args.command == "report":
        from . import report

        results = json.loads(args.results.read_text())
        return write_report(results, args.dest, args.readme, report.published_services(HERE, results))
    results = run_suite(args)
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1) + "\n"
    (args.out / "results.json").write_text(text)
    if args.quick or args.no_peers or args.dest is not None:  # only a full run with the peers is published
        return write_report(results, args.dest or args.out, None)
    return publish(results, text)


def publish(results: dict, text: str) -> int:
    """The committed figures, all from one results.json: it, its copy for this CPU model, the report
    and its plots, and the README's Benchmarks section."""
    from . import report

    (HERE / "results.json").write_text(text)
    per_cpu = HERE / "results" / f"{report.cpu_slug(results)}.json"
    per_cpu.parent.mkdir(exist_ok=True)
    per_cpu.write_text(text)
    print(f"results: {HERE / 'results.json'} (and {per_cpu.relative_to(HERE.parent)})")
    return write_report(results, HERE, HERE.parent / "README.md", report.published_services(HERE, results))


def write_report(results: dict, dest: Path, readme: Path | None, services: list[dict] = ()) -> int:
    from . import report

    path = report.write(results, dest, services)
    print(f"report: {path}")
    if readme is not None:
        report.update_readme(readme, results, services)
        print(f"README table: {readme}")
    return 0


def log(msg: str) -> None:
    print(msg, flush=True)


def run_suite(args) -> dict:
    os.environ.setdefault("TQDM_DISABLE", "1")  # HF's GGUF conversion bar
    import torch

    torch.set_num_threads(args.threads)
    import kvstore

    cfg = dict(QUICK if args.quick else FULL)
    if args.reps:
        cfg["reps"] = cfg["engine_reps"] = args.reps
    started = time.time()
    load = {"start": os.getloadavg()}
    t0 = time.perf_counter()
    model = kvstore.load_model(args.model, dtype="bfloat16")
    kv_load_s = time.perf_counter() - t0
    hf, llama, peers_note = load_peers(model, args)
    from . import store as kv

    settings = cfg | {"threads": args.threads, "dtype": "bfloat16", "kv_bytes_per_token": kv.kv_bytes(model, 1)}
    results = {"quick": args.quick, "settings": settings,
               "machine": machine(), "versions": versions(), "peers": peers_note, "load": load}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        store = kvstore.open_store(Path(tmp) / "home")
        phases = [
            ("engine", lambda: engine_phase(model, kv_load_s, hf, llama, cfg)),
            ("ttft", lambda: _ttft(store, model, cfg)),
            ("save_restore", lambda: _save_restore(store, model, hf, llama, cfg, Path(tmp))),
            ("checkpoint", lambda: _checkpoint(store, model, cfg)),
            ("forks", lambda: _forks(store, model, cfg)),
            ("scale", lambda: _scale(model, args.quick, Path(tmp))),
            ("serve", lambda: _serve(args, llama is not None, Path(tmp) / "serve")),
        ]
        for name, phase in phases:
            load[name] = os.getloadavg()
            log(f"{name} (load {load[name][0]:.2f}):")
            t = time.perf_counter()
            results[name] = phase()
            log(f"  ... {time.perf_counter() - t:.0f} s")
        store.close()
    load["end"] = os.getloadavg()
    results["started"] = time.strftime("%Y-%m-%d %H:%M", time.localtime(started))
    results["duration_s"] = time.time() - started
    log(f"suite: {results['duration_s']:.0f} s")
    return results


def load_peers(model, args) -> tuple:
    """(HF engine or None, llama.cpp peer or None, {peer: "" or why it is not measured})."""
    note = {"hf": "left out (--no-peers)", "llama.cpp": "left out (--no-peers)"}
    hf = llama = None
    if not args.no_peers:
        from . import engine, llama_peer

        log("loading HF transformers ...")
        hf, note["hf"] = engine.HF(Path(model.source)), ""
        if args.no_llama:
            note["llama.cpp"] = "left out (--no-llama)"
        else:
            log("loading llama.cpp ...")
            llama, note["llama.cpp"] = llama_peer.load(Path(model.source), args.threads, model.config.max_context)
            if llama is None:
                log(f"  llama.cpp not measured: {note['llama.cpp']}")
    return hf, llama, note


def engine_phase(model, kv_load_s: float, hf, llama, cfg: dict) -> dict:
    """Decode and prefill speed, kvstore vs each peer, through benchmarks.engine's A B B A loop."""
    from kvstore.engine.sequence import DEFAULT_CHUNK

    from . import engine

    engines = {"kvstore": engine.Ours(model, DEFAULT_CHUNK, kv_load_s)}
    if hf is not None:
        engines["hf"] = hf
    if llama is not None:
        engines["llama.cpp"] = llama
    if "engine_prompt" in cfg:  # quick: shorter prompts than the engine benchmark's own
        engine.DECODE_PROMPT, engine.PREFILL_LEN = cfg["engine_prompt"], cfg["engine_prefill"]
    rng = random.Random(0)
    prompt = [rng.randrange(100, model.config.vocab_size) for _ in range(max(engine.DECODE_PROMPT, engine.PREFILL_LEN))]
    raw, tokens, busy = engine.measure(engines, prompt, cfg["engine_reps"], cfg["max_wait"])
    out = {"decode_prompt": engine.DECODE_PROMPT, "decode_new": engine.DECODE_NEW, "prefill_tokens": engine.PREFILL_LEN,
           "chunk": DEFAULT_CHUNK, "others_busy_cpus": [round(b, 2) for b in busy], "raw": raw,
           "engines": {n: engine.summarize(r) | {"load_s": engines[n].load_s} for n, r in raw.items()},
           "ratios": {}, "greedy_equal_prefix": {}}
    ours = raw["kvstore"]
    for peer in [n for n in raw if n != "kvstore"]:
        theirs = raw[peer]
        out["ratios"][peer] = engine.summarize({
            "decode": [a / b for a, b in zip(ours["decode_tok_s"], theirs["decode_tok_s"])],
            "decode_steady": [a / b for a, b in zip(ours["decode_steady_tok_s"], theirs["decode_steady_tok_s"])],
            "prefill": [b / a for a, b in zip(ours["prefill_s"], theirs["prefill_s"])],
            "prefill_one_chunk": [b / a for a, b in zip(ours["prefill_one_chunk_s"], theirs["prefill_s"])]})
        out["greedy_equal_prefix"][peer] = next(
            (i for i, (a, b) in enumerate(zip(tokens["kvstore"], tokens[peer])) if a != b), len(tokens["kvstore"]))
    return out


def _ttft(store, model, cfg: dict) -> dict:
    from . import store as kv

    return kv.ttft(store, model, cfg["lengths"], cfg["reps"], log=log)


def _save_restore(store, model, hf, llama, cfg: dict, workdir: Path) -> dict:
    from . import hf_peer, store as kv

    peers = (hf_peer.peers(hf.model) if hf is not None else []) + ([llama] if llama is not None else [])
    return kv.save_restore(store, model, peers, cfg["save_lengths"], cfg["reps"], workdir, log=log)


def _checkpoint(store, model, cfg: dict) -> dict:
    from . import store as kv

    return kv.checkpoint_overhead(store, model, cfg["intervals"], cfg["reps"] + 1, cfg["decode_new"],
                                  cfg["decode_prompt"], log=log)


def _forks(store, model, cfg: dict) -> dict:
    from . import store as kv

    return kv.fork_growth(store, model, f"doc{cfg['lengths'][-1]}", cfg["forks"], cfg["fork_new"])


def _scale(model, quick: bool, workdir: Path) -> dict:
    from . import scale

    return scale.run(model, dict(scale.QUICK if quick else scale.FULL), workdir, log=log)


def _serve(args, peer: bool, workdir: Path) -> dict:
    """The service phase: `kvstore serve` (when this checkout has it) against llama.cpp's server
    (when llama.cpp is measured in this run), in subprocesses."""
    from . import serve

    workdir.mkdir(parents=True, exist_ok=True)
    return serve.run(dict(serve.QUICK if args.quick else serve.FULL), args.threads, args.model, peer, workdir)


def machine() -> dict:
    """CPU, cores, RAM and OS (no paths of this machine: the report is committed)."""
    def read(path: str) -> list[str]:
        try:
            return Path(path).read_text().splitlines()
        except OSError:
            return []

    def field(lines: list[str], key: str, sep: str) -> str | None:
        return next((ln.split(sep, 1)[1].strip().strip('"') for ln in lines if ln.startswith(key)), None)

    cpuinfo, meminfo = read("/proc/cpuinfo"), read("/proc/meminfo")
    ram = field(meminfo, "MemTotal", ":")
    os_name = field(read("/etc/os-release"), "PRETTY_NAME", "=")
    return {"cpu": field(cpuinfo, "model name", ":") or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "ram_bytes": int(ram.split()[0]) * 1024 if ram else 0,
            "os": f"{os_name}, kernel {platform.release()}" if os_name else platform.platform(terse=True),
            "arch": platform.machine(), "flags": cpu_flags(cpuinfo)}


def cpu_flags(cpuinfo: list[str]) -> list[str]:
    """The CPU's flags that choose kernels (report.CPU_FLAGS), in that order."""
    from .report import CPU_FLAGS

    present = next((set(ln.split(":", 1)[1].split()) for ln in cpuinfo if ln.startswith("flags")), set())
    return [flag for flag in CPU_FLAGS if flag in present]


def versions() -> dict:
    import torch

    from . import llama_peer

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    out["llama-cpp-python"] = llama_peer.status()[0]
    out |= client_versions()
    out["kvstore"] = git_commit()
    return out


def client_versions() -> dict:
    """The service phase's client and server packages (None: not installed)."""
    from importlib import metadata

    out = {}
    for name in ("openai", "fastapi", "uvicorn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=HERE, check=False).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + uncommitted changes in kvstore/" if git("status", "--porcelain", "--", "../kvstore") else "")


if __name__ == "__main__":
    sys.exit(main())
