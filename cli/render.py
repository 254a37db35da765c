"""What the command shows: the streamed reply on stdout; progress, timings and notes on stderr.

stdout carries only what a script wants to capture (the reply, a listing, JSON). Everything about
the run itself goes to stderr: progress bars (on a terminal, for long prefills, exports, imports,
packs and verifies), the `--verbose` timing lines, and the note printed when a generation is
stopped.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import Any, Callable, Iterable, Iterator

import click
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn, TransferSpeedColumn)
from rich.text import Text

LONG_INPUT = 256  # tokens; shorter prefills finish before a bar would be worth drawing
LONG_BYTES = 256 << 20  # KV bytes; about a second of export, import, pack or verify here


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def summary_text(summary: dict[str, int]) -> str:
    """`{"raw_bytes": 2048, "extents": 3}` -> "raw 2.0 KiB, extents 3"."""
    parts = []
    for key, value in summary.items():
        if key.endswith("bytes") or key.endswith("freed"):
            parts.append(f"{key.removesuffix('_bytes').replace('_', ' ')} {human_bytes(value)}")
        else:
            parts.append(f"{key.replace('_', ' ')} {value:,}")
    return ", ".join(parts)


def note(message: str) -> None:
    click.echo(f"kvstore: {message}", err=True)


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def stream_table(headers: list[str], pages: Iterable[list[list[str]]]) -> None:
    """Plain left-aligned columns (no box drawing: the output is meant for grep and cut too), written
    a page of rows at a time: the header with the first row, each page's columns as wide as its
    cells need and never narrower than the pages before (a longer cell later shifts the columns
    from its page on). Nothing at all when there are no rows."""
    widths, started = [len(h) for h in headers], False
    for rows in pages:
        if not rows:
            continue
        widths = [max(w, *(len(r[j]) for r in rows)) for j, w in enumerate(widths)]
        for line in rows if started else [headers, *rows]:
            click.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        started = True


def stream_json_array(items: Iterable[Any]) -> None:
    """A JSON array written an item at a time: the same text as `echo_json(list(items))`."""
    first = True
    for item in items:
        click.echo("[" if first else ",")
        click.echo(textwrap.indent(json.dumps(item, indent=2, ensure_ascii=False), "  "), nl=False)
        first = False
    click.echo("[]" if first else "\n]")


def stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Bar:
    """A rich progress bar on stderr, drawn only on a terminal and only for jobs of at least `at_least`
    units (shorter ones end before a bar is worth drawing). Call it as the library's
    `progress(done, total)` callback; `done` counts from `start` (a prefill passes absolute positions).
    `on_step` runs after every call (the CLI checks its stop conditions there)."""

    def __init__(self, label: str, unit: str, at_least: int, *, start: int = 0,
                 on_step: Callable[[], None] | None = None):
        self.label, self.unit, self.at_least, self.start, self.on_step = label, unit, at_least, start, on_step
        self.progress = None
        self.task = None
        self.done = start

    def __call__(self, done: int, total: int) -> None:
        self.done = done
        if self.progress is None and total - self.start >= self.at_least and stderr_is_terminal():
            self._open(total - self.start)
        if self.progress is not None:
            self.progress.update(self.task, completed=done - self.start)
        if self.on_step is not None:
            self.on_step()

    def _open(self, total: int) -> None:
        amounts = [DownloadColumn(binary_units=True), TransferSpeedColumn()] if self.unit == "bytes" else \
            [MofNCompleteColumn(), TextColumn(self.unit), RateColumn()]
        self.progress = Progress(TextColumn(self.label), BarColumn(), *amounts, TimeElapsedColumn(),
                                 console=Console(stderr=True))
        self.progress.start()
        self.task = self.progress.add_task(self.label, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefill_bar(start: int, on_chunk: Callable[[], None] | None = None) -> Bar:
    """Tokens and tokens/s of a prefill that starts at position `start`."""
    return Bar("prefill", "tokens", LONG_INPUT, start=start, on_step=on_chunk)


def bytes_bar(label: str) -> Bar:
    """KV bytes and their rate for export, import, pack and verify."""
    return Bar(label, "bytes", LONG_BYTES)


class RateColumn(ProgressColumn):
    """Tokens per second of a prefill bar."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tok/s" if speed else "- tok/s", style="progress.data.speed")


class Stream:
    """Writes reply pieces to stdout as they come and ends the reply with a newline."""

    def __init__(self) -> None:
        self.wrote = False
        self.last = "\n"

    def write(self, piece: str) -> None:
        if piece:
            click.echo(piece, nl=False)
            self.wrote, self.last = True, piece[-1]

    def finish(self) -> None:
        if self.wrote and self.last != "\n":
            click.echo()

    def pump(self, pieces: Iterable[str], between: Callable[[], None]) -> None:
        """Write every piece, calling `between()` after each (where a stop request is honoured)."""
        for piece in pieces:
            self.write(piece)
            between()


def rate(n: int, seconds: float) -> str:
    if seconds <= 0:
        return "- tok/s"
    per_second = n / seconds
    return f"{per_second:,.0f} tok/s" if per_second >= 10 else f"{per_second:.1f} tok/s"


def session_lines(info) -> Iterator[tuple[str, str]]:
    """(label, value) pairs describing a session for `kvstore show`."""
    pending = info.n_tokens - info.n_cached
    yield "name", info.name
    yield "id", info.id
    yield "model", f"{info.model[:12]} ({info.model_source})"
    yield "dtype", info.dtype
    yield "weights", info.weights
    yield "tokens", f"{info.n_tokens:,} ({info.n_cached:,} in the KV cache, {pending:,} pending)"
    yield "checkpoints", f"{info.checkpoints:,}"
    yield "disk", human_bytes(info.disk_bytes)
    yield "seed", str(info.seed)
    yield "sampler", " ".join(f"{k}={v}" for k, v in info.sampler.items())
    yield "checkpoints at", f"every {info.chunk_size:,} tokens read, every {info.checkpoint_every:,} generated"
    if info.parent is not None:
        yield "forked from", f"{info.parent} at {info.fork_position:,} tokens"
    elif info.fork_position is not None:
        yield "forked at", f"{info.fork_position:,} tokens (parent deleted)"
    yield "forks", ", ".join(info.forks) if info.forks else "-"
    if info.active_call:
        yield "interrupted", f"a generation is unfinished; `kvstore continue {info.name}` finishes it"
    yield "created", info.created_at
    yield "updated", info.updated_at


def show_session(info) -> None:
    lines = list(session_lines(info))
    width = max(len(label) for label, _ in lines) + 1
    for label, value in lines:
        click.echo(f"{label + ':':<{width}} {value}")
