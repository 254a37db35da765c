"""The report's PNG plots (matplotlib, Agg): medians with min–max error bars."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"kvstore": "#1f77b4", "kvstore bf16": "#9ecae1", "hf": "#ff7f0e", "llama.cpp": "#2ca02c"}


def med(s: dict, scale: float = 1.0) -> float:
    return s["median"] * scale


def err(stats: list[dict], scale: float = 1.0) -> list[list[float]]:
    """matplotlib's asymmetric yerr from spreads."""
    return [[(s["median"] - s["min"]) * scale for s in stats], [(s["max"] - s["median"]) * scale for s in stats]]


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft(r: dict, path: Path) -> None:
    t = r["ttft"]
    n = [int(k) for k in t]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, name in (("recompute_s", "recompute (prefill) + 1st token"), ("resume_s", "resume (store.open) + 1st token"),
                      ("restore_s", "restore alone (warm)")):
        stats = [x[key] for x in t.values()]
        ax.errorbar(n, [med(s) for s in stats], yerr=err(stats), marker="o", capsize=3, label=name)
    for k, x in zip(n, t.values()):
        ax.annotate(f"{x['speedup']:.0f}×", (k, med(x["resume_s"])), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="tokens in the session", ylabel="seconds",
           title="Time to first token: resume vs recompute")
    ax.set_xticks(n, [f"{k:,}" for k in n])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def engine(r: dict, path: Path) -> None:
    """Decode tok/s per context (grouped bars, each engine's bandwidth limit as a tick over its bar)
    and prefill tok/s."""
    e = r["engine"]
    names, ctx = list(e["engines"]), [str(n) for n in e["contexts"]]
    n = e["prefill_tokens"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        x = [j + (i - (len(names) - 1) / 2) * width for j in range(len(ctx))]
        dec = [e["engines"][name]["decode"][c]["tok_s"] for c in ctx]
        a.bar(x, [med(s) for s in dec], width, yerr=err(dec), capsize=3, color=COLORS.get(name, "gray"), label=name)
        limits = [e["engines"][name]["decode"][c].get("limit_tok_s") for c in ctx]
        if all(v is not None for v in limits):
            a.scatter(x, limits, marker="_", s=200, color="black", zorder=3,
                      label="bandwidth limit" if i == 0 else None)
    a.set_xticks(range(len(ctx)), [f"{int(c):,}" for c in ctx])
    a.set(xlabel="tokens of context", ylabel="tokens / s", title=f"Decode ({e['decode_new']} tokens)")
    a.legend(fontsize=7)
    pre = [x["prefill_s"] for x in e["engines"].values()]
    rates = [{"median": n / s["median"], "min": n / s["max"], "max": n / s["min"]} for s in pre]
    b.bar(names, [med(s) for s in rates], yerr=err(rates), capsize=4, color=[COLORS.get(x, "gray") for x in names])
    b.set(ylabel="tokens / s", title=f"Prefill ({n:,} tokens)")
    b.tick_params(axis="x", labelsize=7, rotation=20)
    for ax in (a, b):
        ax.grid(True, axis="y", alpha=0.3)
    save(fig, path)


def save_restore(r: dict, path: Path) -> None:
    lengths = list(r["save_restore"])
    fig, axes = plt.subplots(len(lengths), 2, figsize=(10, 1.2 + 1.6 * len(lengths)), squeeze=False)
    for row, n in zip(axes, lengths):
        methods = r["save_restore"][n]
        names = list(methods)
        for ax, key, title in ((row[0], "save_s", "save"), (row[1], "restore_s", "restore (warm)")):
            stats = [methods[m][key] for m in names]
            bars = ax.barh(names, [med(s, 1e3) for s in stats], xerr=err(stats, 1e3), capsize=3,
                           color=["#1f77b4" if m.startswith("kvstore") else "#999999" for m in names])
            ax.bar_label(bars, labels=[f"{med(s, 1e3):.0f}" for s in stats], padding=8, fontsize=7)
            ax.set(xlabel="ms", title=f"{title}, {int(n):,} tokens")
            ax.set_xlim(0, max(s["max"] for s in stats) * 1e3 * 1.2)
            ax.grid(True, axis="x", alpha=0.3)
            ax.tick_params(axis="y", labelsize=7)
        row[1].set_yticklabels([])
    save(fig, path)


def checkpoint(r: dict, path: Path) -> None:
    c = r["checkpoint"]
    names = ["never", *c["every"]]
    stats = [c["none"], *(x["tok_s"] for x in c["every"].values())]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(names, [med(s) for s in stats], yerr=err(stats), capsize=4, color=["#999999"] + ["#1f77b4"] * len(c["every"]))
    for i, x in enumerate(c["every"].values(), start=1):
        ax.annotate(f"{x['overhead_pct']:+.1f} %", (i, x["tok_s"]["max"]), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=8)
    ax.set(xlabel="checkpoint every k tokens", ylabel="decode tokens / s", title="Checkpoint overhead during decode")
    ax.grid(True, axis="y", alpha=0.3)
    save(fig, path)


def growth(r: dict, path: Path) -> None:
    t, f = r["ttft"], r["forks"]
    n = [int(k) for k in t]
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(9, 6))
    for key, name in (("restore_s", "warm"), ("restore_cold_s", "cold")):
        stats = [x[key] for x in t.values()]
        a.errorbar(n, [med(s, 1e3) for s in stats], yerr=err(stats, 1e3), marker="o", capsize=3, label=name)
    a.set(xlabel="tokens", ylabel="ms", title="Restore time vs length")
    a.legend(fontsize=8)
    b.plot(n, [x["disk_bytes"] / 1e6 for x in t.values()], marker="o")
    b.set(xlabel="tokens", ylabel="MB", title="Session on disk vs length")
    k = list(range(1, len(f["fork_s"]) + 1))
    c.plot(k, [s * 1e3 for s in f["fork_s"]], marker="o")
    c.set(xlabel="fork number", ylabel="ms", title=f"Time of each fork ({f['tokens']:,}-token session)", ylim=(0, None))
    d.plot(k, [x / 1e3 for x in f["bytes_after_forks"]], marker="o", label="after the forks")
    d.plot(k, [x / 1e3 for x in f["bytes_after_decode"]], marker="o",
           label=f"after each decoded {f['new_tokens_per_fork']} tokens")
    d.set(xlabel="number of forks", ylabel="kB", title="Store growth vs fork count", ylim=(0, None))
    d.legend(fontsize=8)
    for ax in (a, b, c, d):
        ax.grid(True, alpha=0.3)
    save(fig, path)


CHARTS = (("ttft", ttft, ("ttft",)), ("engine", engine, ("engine",)), ("save_restore", save_restore, ("save_restore",)),
          ("checkpoint", checkpoint, ("checkpoint",)), ("growth", growth, ("ttft", "forks")))


def draw_all(r: dict, folder: Path) -> list[Path]:
    """Every chart whose phases ran (`run --skip` leaves some out); a chart of a phase left out is
    removed, so no plot of an earlier run stands beside this run's report."""
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for name, draw, phases in CHARTS:
        path = folder / f"{name}.png"
        if all(r.get(phase) for phase in phases):
            draw(r, path)
            made.append(path)
        else:
            path.unlink(missing_ok=True)
    return made
