"""`kvstore serve`: the command that starts the service (click; uvicorn and the app are imported
when it runs, so `kvstore --help` stays fast)."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import signal
import sys
from pathlib import Path

import click

from .config import ServeConfig

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--model", "model", default="smollm2", show_default=True,
              help="Alias (pulled on first start), .gguf file or Hugging Face folder.")
@click.option("--served-model-name", help="The model's name in the API (default: the alias or file name).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Activations and KV dtype (and dense weights').")
@click.option("--weights", type=click.Choice(["stored", "dense", "q8_0"]),
              help="How weight matrices are held: stored (a GGUF's quantized blocks, integer kernels), dense "
                   "(dequantized), q8_0 (quantized on load) [default: stored for a GGUF file where the kernels run].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the engines run the model and hold the KV memory. On cuda each session's rows are "
                   "computed apart in a step (the bits hold; the weights are read once per session).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Engine processes, each with the model; a session is pinned to one.")
@click.option("--threads", default=0, type=click.IntRange(0, 1024),
              help="Torch threads per engine (default: the CPUs divided among the engines).")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="API keys, one per line; each key is a tenant with its own sessions. "
                   "Also $KVSTORE_API_KEYS (comma-separated).")
@click.option("--allow-unauthenticated", is_flag=True,
              help="Serve a non-loopback address without API keys (refused otherwise).")
@click.option("--allowed-origins", "origins", multiple=True, metavar="ORIGINS",
              help="Web origins whose pages may call the API from a browser (CORS), comma-separated or the "
                   "option repeated, e.g. http://localhost:3000; * for any (needs API keys, or "
                   "--allow-unauthenticated: any page the user opens could then read and delete the sessions). "
                   "None by default: pages of other origins cannot read the answers.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0, 100000),
              help="Requests that may wait for their session or an engine; beyond: 429 with Retry-After.")
@click.option("--max-running", default=8, show_default=True, type=click.IntRange(1, 1024),
              help="Requests one engine runs at once, their tokens interleaved.")
@click.option("--kv-memory", default="2GiB", show_default=True, metavar="SIZE",
              help="KV memory of the sessions held open, in blocks of 16 tokens, shared out among the engines; when "
                   "it is full the least recently used idle session is evicted (it is on disk already) and restored "
                   "on its next request.")
@click.option("--prefix-cache", default="1GiB", show_default=True, metavar="SIZE",
              help="Disk budget of the prefix cache: a request that names no session starts from the longest "
                   "stored prefix of its prompt (whole chunks, or blocks of 32 tokens where every row is computed "
                   "alone; byte-identical to a cold run) and its session is kept "
                   "as an entry, the least recently used deleted beyond SIZE (named sessions never); 0 turns it off.")
@click.option("--step-tokens", default=512, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Tokens one engine step computes at most: every generating session's next token, then "
                   "prompt rows of reading sessions while they fit.")
@click.option("--max-slowdown", default=2.0, show_default=True, type=click.FloatRange(1.0, 1000.0),
              help="How much a long prompt being read may slow the generating sessions: a step that reads prompt "
                   "rows beside their tokens takes about this many times their step alone (learnt from the steps' "
                   "times; at least 2 prompt rows a step, so every prompt is read).")
@click.option("--max-open", default=100000, show_default=True, type=click.IntRange(1, 10**9),
              help="Sessions an engine keeps in memory between requests, at most (least recently used closed first).")
@click.option("--prewarm/--no-prewarm", default=True, show_default=True,
              help="After a start (a restart, a crash), each engine restores the sessions it held open before, "
                   "the most recently used first, while no request is waiting (up to half of its --kv-memory), so "
                   "the conversations in use come back in memory; the list is kept in HOME/serve/.")
@click.option("--max-tokens", default=4096, show_default=True, type=click.IntRange(1, 10**7),
              help="The most tokens a request may generate (also the default).")
@click.option("--max-body", default=8 * 2**20, show_default=True, type=click.IntRange(1024, 2**40),
              help="Largest request body in bytes (imports: --max-import).")
@click.option("--max-import", default=4 * 2**30, show_default=True, type=click.IntRange(1024, 2**50),
              help="Largest archive accepted by POST /v1/sessions/import, in bytes.")
@click.option("--chunk-size", type=click.IntRange(1, 1 << 20),
              help="Prefill chunk of the sessions the server creates (default: the library's, 512).")
@click.option("--checkpoint-every", type=click.IntRange(1, 1 << 20),
              help="Generated tokens between checkpoints of the sessions the server creates (default: "
                   "the library's, 16). Each checkpoint's commit takes CPU beside the decode: with many "
                   "sessions decoding at once, a longer interval leaves more to the forward, and a crash "
                   "then loses more of a reply to compute again.")
@click.option("--grace", default=30.0, show_default=True, type=click.FloatRange(0, 3600),
              help="Seconds SIGTERM waits for requests in flight before checkpointing and exiting.")
@click.option("--keep-alive", default=15.0, show_default=True, type=click.FloatRange(0.05, 3600),
              help="Seconds between keep-alive comments on a stream that sends nothing (a long prompt).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="One line per request: key=value text, or a JSON object.")
@click.pass_obj
def serve(app, host, port, model, served_model_name, dtype, weights, device, workers, threads, api_key_file, allow_unauthenticated,
          origins, max_queue, max_running, kv_memory, prefix_cache, step_tokens, max_slowdown, max_open, prewarm, max_tokens, max_body, max_import, chunk_size, checkpoint_every, grace,
          keep_alive, log_format):
    """Serve the store over HTTP: an OpenAI-compatible API.

    Conversations are stored sessions: a client resends its history, the server feeds only
    what is new and keeps the rest as KV on disk.

    \b
    Endpoints: /v1/chat/completions, /v1/completions, /v1/responses, /v1/conversations,
    /v1/models, /v1/sessions (list, info, messages, fork, delete, export, import),
    /tokenize, /detokenize, /health, /metrics. A request names its session with the X-Session-Id header (or
    "session" in the body); a stream that broke is finished by resending the request
    with Last-Event-ID.
    """
    from .config import parse_size
    from .tenants import read_keys

    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: CUDA is not available here (no GPU, or a CPU-only build of "
                                   "torch); use --device cpu")

    try:
        memory = parse_size(kv_memory)
    except ValueError as e:
        raise click.UsageError(f"--kv-memory: {e}") from None
    try:
        prefix_budget = parse_size(prefix_cache, zero=True)
    except ValueError as e:
        raise click.UsageError(f"--prefix-cache: {e} (or 0: off)") from None

    try:
        keys = read_keys(api_key_file, os.environ.get("KVSTORE_API_KEYS"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise click.UsageError(f"the API keys: {e}") from None
    if api_key_file is not None and not keys:
        raise click.UsageError(f"--api-key-file {api_key_file} holds no API key (one per line)")
    if not keys and not is_loopback(host) and not allow_unauthenticated:
        raise click.UsageError(f"--host {host} is reachable from other machines and no API keys are set: pass "
                               "--api-key-file (or $KVSTORE_API_KEYS), or --allow-unauthenticated to serve it open")
    try:
        allowed = parse_origins(origins)
    except ValueError as e:
        raise click.UsageError(f"--allowed-origins: {e}") from None
    if "*" in allowed and not keys and not allow_unauthenticated:
        raise click.UsageError("--allowed-origins '*' without API keys would let any web page the user opens read "
                               "and delete the sessions: pass --api-key-file (or $KVSTORE_API_KEYS), name the "
                               "origins, or add --allow-unauthenticated to serve it so")
    config = ServeConfig(home=getattr(app, "home", None), index=getattr(app, "index", None), model=model,
                         model_id=served_model_name, dtype=dtype, weights=weights, device=device, host=host, port=port,
                         workers=workers, threads=threads, api_keys=keys, allow_open=allow_unauthenticated,
                         allowed_origins=allowed,
                         max_queue=max_queue, max_running=max_running, max_open=max_open, prewarm=prewarm, kv_memory=memory, prefix_cache=prefix_budget,
                         step_tokens=step_tokens, max_slowdown=max_slowdown, max_tokens=max_tokens, max_body=max_body, max_import=max_import,
                         chunk_size=chunk_size, checkpoint_every=checkpoint_every, grace=grace,
                         keep_alive=keep_alive, log_format=log_format)
    run(config)


def parse_origins(values: tuple[str, ...]) -> list[str]:
    """The origins of --allowed-origins (each value comma-separated): `*`, or scheme://host[:port] of
    http or https with nothing after it, as browsers send them in the Origin header; ValueError
    naming one that is not."""
    out: list[str] = []
    for part in (p.strip() for v in values for p in v.split(",")):
        if not part:
            continue
        if part != "*" and not ORIGIN.fullmatch(part):
            raise ValueError(f"{part!r} is not an origin: write scheme://host[:port] (http or https, no path), "
                             "e.g. http://localhost:3000, or * for any")
        if part not in out:
            out.append(part)
    return out


ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")


def run(config: ServeConfig) -> None:
    import uvicorn

    from .app import create_app

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if config.log_format == "json"
                                           else "%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("kvstore.serve")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=config.host, port=config.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=config.grace))
    logger.info("kvstore serve: http://%s:%d (model %s, %d engine%s)", config.host, config.port, config.served_name(),
                config.workers, "s" if config.workers > 1 else "")
    # uvicorn drains on SIGTERM (stops accepting, waits up to the grace period, then the lifespan
    # checkpoints what is left), restores the handler it found and raises the signal again: with this
    # one found, that is the end of a clean stop and the command exits 0, as a supervisor expects.
    signal.signal(signal.SIGTERM, _drained)
    server.run()


def _drained(signum, frame) -> None:
    logging.getLogger("kvstore.serve").info("kvstore serve: stopped (SIGTERM)")
