"""kvstore against what people would use instead: one suite, one report.

    python -m benchmarks run              # full suite (~30 min on 2 cores, then ~30 min for the store of
                                          # 100,000 sessions): publishes (below)
    python -m benchmarks run --quick      # CI-sized (a few minutes; a store of 1,000 sessions): into benchmarks/out/
    python -m benchmarks.quality [--quick]  # the perplexity phase alone: benchmarks/out/quality.json
    python -m benchmarks.scale [--quick]  # the store-scale phase alone: benchmarks/out/scale.json
    python -m benchmarks.serve [--quick]  # the service phase alone (`kvstore serve` vs llama.cpp's server):
                                          # benchmarks/out/serve.json; --publish: its per-CPU file
    python -m benchmarks report [--results benchmarks/results.json] [--dest DIR] [--readme README.md]

`run` loads SmolLM2-135M-Instruct for kvstore as it loads by default (the GGUF's blocks as stored,
where the native kernels run) and again with its weights dequantized to bfloat16, for Hugging Face
transformers in bfloat16, and for llama.cpp when llama-cpp-python is installed, all on --threads
threads; measures alternately (A B A B), with the machine's read bandwidth beside the decode rates;
writes every repetition to results.json, then the report from it. A full run with the peers
publishes: benchmarks/results.json and its copy for this machine kind (benchmarks/results/<cpu>.json,
`report.cpu_slug`: the CPU's name and its widest kernel path, since one name can cover CPUs of
different instruction sets), benchmarks/REPORT.md with plots/ (its table of machine kinds from every
file in benchmarks/results/) and the README's Benchmarks section, plus a Service section for each
CPU's published service results (benchmarks/results/serve/<cpu>.json, from `python -m benchmarks.serve
--publish`) other than this run's own. `report` rebuilds them from a results.json and those files.

A batching phase (benchmarks/batching.py, when it exists) runs as part of the suite: the module's
`run(model, quick=..., threads=..., log=...)` returns a JSON-able dict kept as results["batching"],
which the report renders through the module's `section(batching) -> [markdown lines]`, and whose
goals join the summary through its optional `targets(batching, add)` (report.targets' `add`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
# contexts / engine_new / prefill / engine_reps: the engine phase (decode after a prompt of each
# context, new tokens timed, prefill length); decode_new / decode_prompt: the checkpoint phase;
# quality: benchmarks.quality's text and window (None: the model's context)
FULL = {"lengths": [512, 1024, 2048, 4096, 8191], "save_lengths": [2048, 8191], "reps": 5, "engine_reps": 5,
        "max_wait": 10.0, "contexts": [1024, 2048, 8160], "engine_new": 32, "prefill": 2048,
        "decode_new": 129, "decode_prompt": 1024, "intervals": [1, 4, 16, 64], "forks": 16, "fork_new": 16,
        "quality": {"tokens": 20_000, "window": None}}
QUICK = {"lengths": [512, 2048], "save_lengths": [2048], "reps": 2, "engine_reps": 2, "max_wait": 0.0,
         "contexts": [256, 512], "engine_new": 16, "prefill": 512, "decode_new": 33, "decode_prompt": 512,
         "intervals": [1, 4, 16, 64], "forks": 4, "fork_new": 4, "quality": {"tokens": 2048, "window": 512}}


PHASES = ("engine", "quality", "batching", "ttft", "save_restore", "checkpoint", "forks", "scale", "serve")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure, then write results.json and the report")
    run.add_argument("--quick", action="store_true", help="CI-sized: short lengths, 2 repetitions (< 3 min)")
    run.add_argument("--reps", type=int, help="repetitions per measurement (engine: --reps too)")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--model", default="smollm2", help="alias or .gguf path")
    run.add_argument("--weights", choices=("stored", "dense", "q8_0"),
                     help="how kvstore holds the weights (default: the library's, the GGUF's blocks as stored where "
                          "its native kernels run); a bfloat16 row is measured beside it unless it is dense")
    run.add_argument("--no-peers", action="store_true", help="kvstore only (no HF transformers, no llama.cpp)")
    run.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even when it is installed")
    run.add_argument("--skip", default="", metavar="PHASES",
                     help=f"phases to leave out, comma-separated (of: {', '.join(PHASES)}); the report names them")
    run.add_argument("--out", type=Path, default=OUT, help="where results.json goes (default benchmarks/out)")
    run.add_argument("--dest", type=Path,
                     help="where REPORT.md and plots/ go (default: benchmarks/ for a full run with the peers, else --out)")
    rep = sub.add_parser("report", help="write REPORT.md and plots from a results.json")
    rep.add_argument("--results", type=Path, default=HERE / "results.json")
    rep.add_argument("--dest", type=Path, default=HERE)
    rep.add_argument("--readme", type=Path, help="also put the summary table into this README's Benchmarks section")
    args = p.parse_args(argv)
    if args.command == "run":
        args.skip = [name for name in args.skip.split(",") if name]
        if unknown := sorted(set(args.skip) - set(PHASES)):
            p.error(f"--skip: no phase named {', '.join(unknown)} (the phases: {', '.join(PHASES)})")
    from . import report

    if args.command == "report":
        results = json.loads(args.results.read_text())
        return write_report(results, args.dest, args.readme, report.published_services(HERE, results),
                            report.published_machines(HERE, results))
    results = run_suite(args)
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1) + "\n"
    (args.out / "results.json").write_text(text)
    if args.quick or args.no_peers or args.dest is not None:  # only a full run with the peers is published
        return write_report(results, args.dest or args.out, None, (), report.published_machines(HERE, results))
    return publish(results, text)


def publish(results: dict, text: str) -> int:
    """The committed figures, all from one results.json: it, its copy for this machine kind, the
    report and its plots, and the README's Benchmarks section."""
    from . import report

    (HERE / "results.json").write_text(text)
    per_cpu = report.machines_dir(HERE) / f"{report.cpu_slug(results)}.json"
    per_cpu.parent.mkdir(exist_ok=True)
    per_cpu.write_text(text)
    print(f"results: {HERE / 'results.json'} (and {per_cpu.relative_to(HERE.parent)})")
    return write_report(results, HERE, HERE.parent / "README.md", report.published_services(HERE, results),
                        report.published_machines(HERE, results))


def write_report(results: dict, dest: Path, readme: Path | None, services: list[dict] = (),
                 machines: list[dict] = ()) -> int:
    from . import report

    path = report.write(results, dest, services, machines)
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
    models, load_s = load_kvstore(args.model, args.weights)
    model = models["kvstore"]  # the phases after the engine's run on it
    hf, llama, peers_note = load_peers(model, args)
    from . import store as kv

    settings = cfg | {"reps_given": bool(args.reps), "threads": args.threads, "dtype": "bfloat16", "weights": model.weights,
                      "kv_bytes_per_token": kv.kv_bytes(model, 1)}
    results = {"quick": args.quick, "settings": settings, "skipped": list(args.skip),
               "machine": machine(), "versions": versions(), "peers": peers_note, "load": load}
    if llama is not None:
        results["llama_repack"] = llama.repack
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        store = kvstore.open_store(Path(tmp) / "home")
        phases = [
            ("engine", lambda: engine_phase(models, load_s, hf, llama, cfg)),
            ("quality", lambda: _quality(models, llama, hf is not None, cfg)),
            ("batching", lambda: _batching(model, args)),
            ("ttft", lambda: _ttft(store, model, cfg)),
            ("save_restore", lambda: _save_restore(store, model, hf, llama, cfg, Path(tmp))),
            ("checkpoint", lambda: _checkpoint(store, model, cfg)),
            ("forks", lambda: _forks(store, model, cfg)),
            ("scale", lambda: _scale(model, args.quick, Path(tmp))),
            ("serve", lambda: _serve(args, llama is not None, Path(tmp) / "serve")),
        ]
        assert [name for name, _ in phases] == list(PHASES)
        for name, phase in phases:
            if name in args.skip:
                log(f"{name}: left out (--skip)")
                continue
            load[name] = os.getloadavg()
            log(f"{name} (load {load[name][0]:.2f}):")
            t = time.perf_counter()
            out = phase()
            if out is not None:  # None: the phase does not exist in this checkout
                results[name] = out
            log(f"  ... {time.perf_counter() - t:.0f} s")
        store.close()
    load["end"] = os.getloadavg()
    results["started"] = time.strftime("%Y-%m-%d %H:%M", time.localtime(started))
    results["duration_s"] = time.time() - started
    log(f"suite: {results['duration_s']:.0f} s")
    return results


def load_kvstore(spec: str, weights: str | None) -> tuple[dict, dict]:
    """({"kvstore": the model as `weights` says (None: the library's default), "kvstore bf16": its
    weights dequantized to bfloat16, unless the first is that already}, {name: load seconds})."""
    import kvstore

    from .engine import OURS, OURS_DENSE

    models, load_s = {}, {}
    for name, how in ((OURS, weights), (OURS_DENSE, "dense")):
        t0 = time.perf_counter()
        models[name] = kvstore.load_model(spec, dtype="bfloat16", weights=how)
        load_s[name] = time.perf_counter() - t0
        if models[name].weights == "dense":
            break
    return models, load_s


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


def engine_phase(models: dict, load_s: dict, hf, llama, cfg: dict) -> dict:
    """Decode (per context) and prefill speed, kvstore both ways vs each peer, with the read
    bandwidth beside them, through benchmarks.engine's alternating loop."""
    from kvstore.engine.sequence import DEFAULT_CHUNK

    from . import engine

    engines = {name: engine.Ours(m, DEFAULT_CHUNK, load_s[name]) for name, m in models.items()}
    if hf is not None:
        engines["hf"] = hf
    if llama is not None:
        engines["llama.cpp"] = llama
    return engine.phase(engines, models[engine.OURS], cfg, log=log)


def _quality(models: dict, llama, with_hf: bool, cfg: dict) -> dict:
    """Perplexity per engine (benchmarks.quality), HF in float32 loaded for it (and let go after)."""
    import torch

    from . import quality
    from .engine import HF

    model = models["kvstore"]
    hf32 = HF(Path(model.source), torch.float32).model if with_hf else None
    ids = quality.text_ids(model.tokenizer, cfg["quality"]["tokens"])
    return quality.run(models, ids, cfg["quality"]["window"] or model.config.max_context, llama, hf32, log=log)


def _batching(model, args) -> dict | None:
    """benchmarks/batching.py's phase, where this checkout has it (see the module's docstring)."""
    from .report import batching_module

    batching = batching_module()
    if batching is None:
        return None
    return batching.suite_phase(model, quick=args.quick, threads=args.threads, log=log)


def _ttft(store, model, cfg: dict) -> dict:
    from . import store as kv

    return kv.ttft(store, model, cfg["lengths"], cfg["reps"], log=log)


def _save_restore(store, model, hf, llama, cfg: dict, workdir: Path) -> dict:
    from . import hf_peer, store as kv

    peers = (hf_peer.peers(hf.model) if hf is not None else []) + ([llama] if llama is not None else [])
    return kv.save_restore(store, model, peers, cfg["save_lengths"], cfg["reps"], workdir, log=log)


QUEUED_SESSIONS = 8  # sessions whose checkpoints are handed over at once (the checkpoint phase)


def _checkpoint(store, model, cfg: dict) -> dict:
    from . import store as kv

    out = kv.checkpoint_overhead(store, model, cfg["intervals"], cfg["reps"] + 1, cfg["decode_new"],
                                 cfg["decode_prompt"], log=log)
    out["queued"] = kv.queued_checkpoints(store, model, QUEUED_SESSIONS, 2 * cfg["reps"] + 1, log=log)
    return out


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
            "arch": platform.machine(), **cpu_family(cpuinfo), "flags": cpu_flags(cpuinfo), "kernels": kernel_paths()}


def cpu_family(cpuinfo: list[str]) -> dict[str, int]:
    """The CPU's family and model numbers (x86), which tell generations apart under one name
    (report.generation); nothing where /proc/cpuinfo has none."""
    def number(key: str) -> int | None:
        line = next((ln for ln in cpuinfo if ln.split(":")[0].strip() == key), None)
        value = line.split(":", 1)[1].strip() if line else ""
        return int(value) if value.isdigit() else None

    family, model = number("cpu family"), number("model")
    return {"family": family, "model": model} if family is not None and model is not None else {}


def kernel_paths() -> dict[str, str]:
    """Which kernels this process picked for each op (kvstore.engine.native's own words)."""
    from kvstore.engine import native

    return {"bfloat16 products, norms, SwiGLU, rotary": native.status(),
            "block-quantized products": native.quant_status(),
            "attention": native.attention_status(), "layer stack": native.layers_status()}


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
