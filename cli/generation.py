"""`kvstore new` and `kvstore continue`: feed input to a session and stream the reply.

Input is `--prompt`, else `--file`, else stdin when it is not a terminal. A chat turn goes through
the model's chat template; `--raw` feeds the text as is. The reply streams to stdout.

Stopping: the first Ctrl-C (or SIGTERM) asks for a stop at the next safe point (after the current
token or prefill chunk); the session checkpoints and the command exits with 128 + the signal number
(130 for Ctrl-C). A second one interrupts at once; the library still checkpoints on the way out.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import click

import kvstore

from .render import Stream, Timer, note, prefill_bar, rate

SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class Options:
    prompt: str | None
    file: IO[str] | None
    raw: bool
    model: str | None
    max_new_tokens: int
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: dict[int, float] | None
    json_object: bool
    json_schema: IO[str] | None
    regex: str | None
    checkpoint_every: int | None
    device: str
    dtype: str | None
    weights: str | None
    threads: int | None
    trace: Path | None
    verbose: bool
    fmt: dict[str, Any] | None = field(default=None, init=False)  # --json, --json-schema or --regex (read_format)

    @property
    def sampling(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*SAMPLING, "logit_bias") if getattr(self, k) is not None}

    @property
    def call(self) -> dict[str, Any]:
        """What a generating call takes besides its length and trace: the sampler settings and the
        response format (`read_format`'s)."""
        return {**self.sampling, **({"response_format": self.fmt} if self.fmt is not None else {})}

    def stat(self, message: str) -> None:
        if self.verbose:
            note(message)


def generation_options(continuing: bool) -> Callable:
    """The options `new` and `continue` share; on `continue` the defaults are the session's own."""
    model_help = ("Model file or alias [default: the session's own]." if continuing else
                  f"Model: alias, .gguf file or Hugging Face folder [default: {kvstore.DEFAULT_MODEL}].")
    every_default = "the session's" if continuing else str(kvstore.DEFAULT_CHECKPOINT_EVERY)
    dtype_default = "the session's" if continuing else kvstore.DEFAULT_DTYPE
    weights_default = ("the session's" if continuing else
                       "stored for a GGUF file where kvstore's integer kernels run (AVX2 and up), else dense")
    o = click.option
    options = [
        o("--prompt", "-p", metavar="TEXT", help="Input text (else --file, else stdin when it is not a terminal)."),
        o("--file", "-f", type=click.File("r", encoding="utf-8"), metavar="FILE",
          help="Read the input from FILE ('-': stdin)."),
        o("--raw", is_flag=True, help="Feed the input as is, without the chat template (documents, completion)."),
        o("--model", "-m", metavar="MODEL", help=model_help),
        o("--max-new-tokens", "-n", type=click.IntRange(min=0), default=kvstore.DEFAULT_MAX_NEW_TOKENS, show_default=True,
          help="Most tokens to generate."),
        o("--temperature", type=click.FloatRange(min=0), help="Sampling temperature (0: greedy)."),
        o("--top-k", type=click.IntRange(min=0), help="Keep the K most likely tokens (0: off)."),
        o("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus sampling mass (1: off)."),
        o("--min-p", type=click.FloatRange(0, 1, max_open=True), help="Drop tokens below P x the top one (0: off)."),
        o("--repetition-penalty", type=click.FloatRange(0, min_open=True), help="Penalise recent tokens (1: off)."),
        o("--presence-penalty", type=click.FloatRange(-2, 2),
          help="Subtract this from the logit of each token the reply has generated (OpenAI's; 0: off)."),
        o("--frequency-penalty", type=click.FloatRange(-2, 2),
          help="Subtract this times how often the reply has generated a token from its logit (OpenAI's; 0: off)."),
        o("--logit-bias", metavar="ID=BIAS", multiple=True, callback=logit_bias,
          help="Add BIAS (-100 to 100) to token ID's logit before sampling (OpenAI's logit_bias; repeat for more "
               "tokens; 100 or -100 all but forces or bans it). On `continue`, replaces the session's."),
        o("--json", "json_object", is_flag=True,
          help="The reply is a JSON object: only tokens that keep it valid JSON are sampled, and it ends when the "
               "object closes (OpenAI's response_format json_object)."),
        o("--json-schema", type=click.File("r", encoding="utf-8"), metavar="FILE",
          help="The reply is JSON that the JSON schema in FILE accepts (OpenAI's response_format json_schema)."),
        o("--regex", metavar="PATTERN", help="The reply matches the regular expression PATTERN, whole."),
        o("--checkpoint-every", type=click.IntRange(min=1),
          help=f"Checkpoint every N generated tokens [default: {every_default}]."),
        o("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
          help="Where the model runs."),
        o("--dtype", type=click.Choice(kvstore.DTYPE_NAMES),
          help=f"Activations and KV dtype (and dense weights') [default: {dtype_default}]."),
        o("--weights", type=click.Choice(kvstore.WEIGHT_FORMATS),
          help="How weight matrices are held: stored (a GGUF's Q4_0/Q4_1/Q8_0 blocks as they are, multiplied by "
               "integer kernels), dense (dequantized into --dtype), q8_0 (quantized on load). A session continues "
               f"only on its own [default: {weights_default}]."),
        o("--threads", type=click.IntRange(min=1), help="CPU threads for torch (bits can differ across counts)."),
        o("--trace", type=click.Path(dir_okay=False, path_type=Path),
          help="Append one JSON line per generated token (position, id, logits sha256) to FILE."),
        o("--verbose", "-v", is_flag=True, help="Print timings (load, restore, prefill, decode) on stderr."),
    ]

    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def logit_bias(ctx: click.Context, param: click.Parameter, given: tuple[str, ...]) -> dict[int, float] | None:
    """--logit-bias ID=BIAS ... -> {ID: BIAS}, None when none is given."""
    bias = {}
    for item in given:
        token, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not ID=BIAS (a token id and a number, e.g. 42=-100)") from None
    return bias or None


def register(cli: click.Group) -> None:
    cli.add_command(new)
    cli.add_command(continue_)


@click.command()
@click.argument("session")
@click.option("--system", "-s", help="System prompt of the chat.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Sampling seed (draws depend on seed and position only).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help=f"Prefill chunk in tokens, a checkpoint after each [default: {kvstore.DEFAULT_CHUNK}]; larger "
                   "reads long texts faster, with fewer checkpoints.")
@generation_options(continuing=False)
@click.pass_obj
def new(app, session: str, system: str | None, seed: int, chunk_size: int | None, **kwargs):
    """Create a session, read the input into it and stream the reply."""
    o = Options(**kwargs)
    text = read_input(o)
    o.fmt = read_format(o)
    if system is not None and o.raw:
        raise click.UsageError("--system belongs to chat turns; with --raw, put it in the text")
    store = app.store
    store.check_new_name(session)
    model = load(o, o.model or kvstore.DEFAULT_MODEL, o.dtype, o.weights, app.home)
    if text is not None:  # refuse an input the context cannot hold, or one with no token, before anything is created
        tokens = first_turn_tokens(model, text, system, o.raw)
        if tokens == 0:
            raise kvstore.errors.InvalidArgument(
                "the input is empty: there is nothing to read or continue. Give some text (-p, -f or stdin), or "
                "no input at all to create an empty session")
        model.check_context(tokens)
    settings = dict(o.sampling)
    if o.checkpoint_every is not None:
        settings["checkpoint_every"] = o.checkpoint_every
    with Stops() as stops:
        try:
            with store.new(session, model, seed=seed, system=system, chunk_size=chunk_size, **settings) as s:
                if text is None:
                    note(f"created session {session!r} (no input; `kvstore continue {session} -p ...` adds a turn)")
                    return
                run_turn(s, text, o, stops)
        except (Stopped, KeyboardInterrupt) as e:  # a closed stdout: the group's (main.py), after the checkpoint
            stopped(store, session, e)


@click.command(name="continue")
@click.argument("session")
@generation_options(continuing=True)
@click.pass_obj
def continue_(app, session: str, **kwargs):
    """Add a turn; with no input, finish an interrupted reply or go on."""
    o = Options(**kwargs)
    text = read_input(o)
    o.fmt = read_format(o)
    store = app.store
    info = store.info(session)
    store.check_writable(session)  # at once, before a model is loaded
    model = load(o, o.model or info.model_source, o.dtype or info.dtype, o.weights or info.weights, app.home)
    with Stops() as stops:
        try:
            timer = Timer()
            with store.open(session, model, device=o.device) as s:
                o.stat(f"restore: {len(s.tokens):,} tokens ({s.n_cached:,} cached) from disk in "
                       f"{timer.elapsed:.3f} s, no prefill")
                if o.checkpoint_every is not None:
                    s.checkpoint_every = o.checkpoint_every
                run_turn(s, text, o, stops)
        except (Stopped, KeyboardInterrupt) as e:  # a closed stdout: the group's (main.py), after the checkpoint
            stopped(store, session, e)


# -- the steps ---------------------------------------------------------------------------------------
def read_format(o: Options) -> dict[str, Any] | None:
    """--json, --json-schema or --regex as the library's response_format (None: free text), checked
    before anything is loaded or created."""
    given = [name for name, on in (("--json", o.json_object), ("--json-schema", o.json_schema is not None),
                                    ("--regex", o.regex is not None)) if on]
    if len(given) > 1:
        raise click.UsageError(f"give one of {' and '.join(given)}: a reply has one format")
    fmt = None
    if o.json_object:
        fmt = {"type": "json_object"}
    elif o.regex is not None:
        fmt = {"type": "regex", "pattern": o.regex}
    elif o.json_schema is not None:
        try:
            fmt = {"type": "json_schema", "schema": json.loads(o.json_schema.read())}
        except ValueError as e:
            raise click.BadParameter(f"{o.json_schema.name} is not JSON text ({e})", param_hint="--json-schema") from None
    if fmt is not None:
        kvstore.check_response_format(fmt)
    return fmt


def read_input(o: Options) -> str | None:
    if o.prompt is not None and o.file is not None:
        raise click.UsageError("give --prompt or --file, not both")
    if o.prompt is not None:
        return o.prompt
    if o.file is not None:
        return o.file.read()
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.read() or None


def load(o: Options, spec: str, dtype: str | None, weights: str | None, home):
    if o.threads is not None:
        import torch

        torch.set_num_threads(o.threads)
    timer = Timer()
    if o.device == "cpu" and (dtype in (None, "bfloat16") or weights != "dense") and kvstore.native_will_build():
        note("compiling kvstore's native kernels, once for this machine (about a minute)")
    model = kvstore.load_model(spec, dtype=dtype, device=o.device, home=home, weights=weights)
    o.stat(f"model: {model.source} ({model.dtype_name}, {model.weights} weights, {o.device}) loaded in "
           f"{timer.elapsed:.1f} s")
    return model


def first_turn_tokens(model, text: str, system: str | None, raw: bool) -> int:
    """How many tokens the first input of a new session takes (raw text, or a chat turn)."""
    if raw:
        return len(model.tokenizer.encode(text))
    turn = [{"role": "system", "content": system}] if system is not None else []
    return len(model.tokenizer.apply_chat_template(turn + [{"role": "user", "content": text.strip()}]))


def run_turn(s, text: str | None, o: Options, stops: "Stops") -> None:
    if text is None and s.active_call:
        if o.call or o.max_new_tokens != kvstore.DEFAULT_MAX_NEW_TOKENS:
            note("finishing the interrupted generation with its own settings; sampling and format options are ignored")
        pieces = s.resume(trace=o.trace)
    elif text is None:
        if not s.tokens:
            raise click.ClickException(f"session {s.name!r} is empty: give it input (--prompt, --file or stdin)")
        pieces = decode(s, s.generate(o.max_new_tokens, trace=o.trace, **o.call), stops)
    elif o.raw:  # the text and the generation after it recorded as one call: stopped anywhere, `continue` finishes it
        timer, before = Timer(), len(s.tokens)
        with prefill_bar(s.n_cached, on_chunk=stops.check) as bar:
            s.begin(text, o.max_new_tokens, progress=bar, **o.call)
        added = s.active_call["start"] - before
        o.stat(f"prefill: {added:,} tokens in {timer.elapsed:.2f} s ({rate(added, timer.elapsed)})")
        pieces = s.resume(trace=o.trace)
    else:
        pieces = s.chat(text.strip(), o.max_new_tokens, trace=o.trace, **o.call)
    out, meter = Stream(), Meter(s, o.verbose)
    try:
        out.pump(meter.wrap(pieces), stops.check)
    finally:
        pieces.close()  # a stop lands between tokens: the generator's cleanup checkpoints
        out.finish()
    if o.verbose:
        meter.report()


class Meter:
    """Timings of one reply for --verbose: the prompt (chat turns), the first token, the decode rate."""

    def __init__(self, s, verbose: bool) -> None:
        self.s, self.verbose, self.n0, self.timer = s, verbose, len(s.tokens), Timer()
        self.first: tuple[float, int] | None = None
        self.gen_start = self.n0

    def wrap(self, pieces: Iterator[str]) -> Iterator[str]:
        for piece in pieces:
            if self.first is None:
                self.first = (self.timer.elapsed, len(self.s.tokens))
                call_start = (self.s.active_call or {}).get("start", self.n0)
                if call_start > self.n0:
                    self.gen_start = call_start
                    if self.verbose:
                        note(f"prompt: {call_start - self.n0:,} tokens")
            yield piece

    def report(self) -> None:
        if self.first is None:
            note("decode: no new text")
            return
        (t1, n1), t2, n2 = self.first, self.timer.elapsed, len(self.s.tokens)
        note(f"decode: {n2 - self.gen_start:,} tokens; first text after {t1:.2f} s, then {rate(n2 - n1, t2 - t1)}")


def decode(s, ids: Iterator[int], stops: "Stops") -> Iterator[str]:
    """Text pieces of generated ids (raw generation), checking for a stop after every token."""
    def checked() -> Iterator[int]:
        for token in ids:
            yield token
            stops.check()

    try:
        yield from s.text(checked())
    finally:
        ids.close()


def stopped(store, name: str, e: BaseException) -> None:
    """After a stop by a signal: say where the session stands, exit with 128 + its number."""
    code = 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)
    try:
        info = store.info(name)
    except kvstore.errors.KvstoreError:  # stopped before the session was created
        note("stopped")
        raise click.exceptions.Exit(code) from None
    what = "a reply is unfinished: `kvstore continue {0}` finishes it" if info.active_call else \
        "`kvstore continue {0}` goes on from there"
    note(f"stopped; {name!r} is checkpointed at {info.n_tokens:,} tokens; " + what.format(name))
    raise click.exceptions.Exit(code)


# -- stop requests -----------------------------------------------------------------------------------
class Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class Stops:
    """SIGINT/SIGTERM while a session is open: the first one asks for a stop at the next `check()`,
    a second one raises KeyboardInterrupt at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
        elif self.signum > 0:  # asked twice before a safe point came: stop now
            raise KeyboardInterrupt
        # else: a stop is already being carried out (checkpointing); let it finish

    def check(self) -> None:
        if self.signum is not None:
            signum, self.signum = self.signum, -1  # now stopping: later checks pass, signals wait
            if signum > 0:
                raise Stopped(signum)

    def __enter__(self) -> "Stops":
        try:
            self.saved = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        except ValueError:  # not the main thread: keep Python's defaults
            self.saved = {}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
