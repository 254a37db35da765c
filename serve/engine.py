"""The engine process: it holds the model and runs the jobs the API process sends (`jobs.py`).

It talks to the API process over one duplex pipe, in dicts:
- API -> engine: `{"op": "run", "id", **job}`, `{"op": "cancel", "id"}`, `{"op": "stop"}`;
- engine -> API: `{"event": "ready", "model", "pid"}` once the model is loaded, then the events of
  each job with its `id` (a cancelled job sends nothing more: it checkpoints as it closes); a step's
  events go in one message, `{"event": "step", "events": [...]}`, in the order the jobs made them:
  one wake-up of the API process per step, not one per session (it shares the CPUs with the engine).

Every running job is advanced one event per step, a token or a prefill chunk, so one long reply
or one long prompt does not hold back another session's tokens; the step's model calls are one
batched forward (`batching.py`: every decode token and the prompt chunks that fit the step's token
budget), each session's bits as the library computes them alone (C9). Sessions stay open (their writer
lock held, their cache in memory) between requests, up to `max_open`, least recently used closed
first; a session is only ever written by the engine it is pinned to. When the API process goes away (the pipe's end is closed: a crash, a kill),
or on `stop`, every job is closed and every session checkpointed before the process exits.
"""

from __future__ import annotations

import os
import signal
import time
from collections import OrderedDict
from typing import Any

import kvstore

from . import conversations, jobs
from .batching import BatchedModel, Batcher
from .prewarm import Prewarm, WorkingSet

jobs.KINDS.update(conversations.KINDS)  # the Responses and Conversations APIs' jobs


class Engine:
    """The model, the store and the sessions this engine has open."""

    def __init__(self, store, model, *, max_open: int = 16, busy_wait: float = 10.0, step_tokens: int = 512,
                 kv_memory: int | None = None, max_slowdown: float = 2.0):
        self.batcher = Batcher(model, step_tokens, max_slowdown)
        cfg = model.config
        self.pool = None if kv_memory is None else kvstore.BlockPool.for_budget(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype=model.dtype, budget_bytes=kv_memory, device=model.device)
        if self.pool is not None:
            self.pool.on_full = self.evict
        # the sessions' model: its feed and head calls wait for the step's batch (batching.py), its
        # caches live in the paged KV memory
        self.model = BatchedModel(model, self.batcher,
                                  None if self.pool is None else lambda: kvstore.PagedCache(self.pool))
        self.store, self.max_open, self.busy_wait = store, max_open, busy_wait
        self.sessions: OrderedDict[str, Any] = OrderedDict()
        self.busy: dict[str, str] = {}  # job id -> the session it runs on (never evicted while it runs)
        self.index = 0  # this engine's number among the server's
        self.evictions = 0
        self.token_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * model.dtype.itemsize

    def writer(self, name: str, *, create: dict[str, Any] | None = None, wait: bool = False):
        """(session, how, restore) for `name`: kept open ("reused"), reopened from the store
        ("restored", with the seconds and bytes that took) or created ("computed") when `create`
        gives its settings. `wait`: a session still locked by a dying engine is waited for."""
        if name in self.sessions:
            self.sessions.move_to_end(name)
            return self.sessions[name], "reused", {}
        started = time.perf_counter()
        try:
            session = self._open(name, wait)
            how = "restored"
        except kvstore.errors.SessionNotFound:
            if create is None:
                raise
            session = self.store.new(name, self.model, **create)
            how = "computed"
        seconds = time.perf_counter() - started
        self._keep(name, session)
        restore = {"restore_seconds": seconds, "restore_bytes": session.n_cached * self.token_bytes} \
            if how == "restored" else {}
        return session, how, restore

    def _open(self, name: str, wait: bool):
        deadline = time.monotonic() + (self.busy_wait if wait else 0)
        while True:
            try:
                return self.store.open(name, self.model)
            except kvstore.errors.SessionBusy:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _keep(self, name: str, session) -> None:
        session.prefill_yields = True  # a long prompt's chunks interleave with other sessions' tokens
        self.sessions[name] = session
        in_use = set(self.busy.values()) | {name}
        for old in [n for n in self.sessions if n not in in_use][:max(0, len(self.sessions) - self.max_open)]:
            self.forget(old)

    def branch(self, session, at: int):
        """A session of the same name that holds `session`'s first `at` positions (a fork; a new
        empty session when `at` is 0); the old one stays in the store as NAME@N."""
        name = session.name
        keep_as = self._free_name(name)
        fresh = f"{keep_as}.new"
        settings = {"seed": session.seed, "chunk_size": session.chunk_size,
                    "checkpoint_every": session.checkpoint_every, **session.settings.to_dict()}
        if at:
            session.fork(fresh, at=at + 1).close()  # its KV: [0, at); token `at` pending, fed with the rest
        else:
            self.store.create(fresh, self.model, **settings)
        self.forget(name)
        self.store.supersede(name, fresh, keep_as)
        new, _, _ = self.writer(name)
        return new

    def _free_name(self, name: str) -> str:
        """The first of NAME@1, NAME@2, ... that no session has."""
        n = 1
        while True:
            try:
                self.store.check_new_name(f"{name}@{n}")
                return f"{name}@{n}"
            except kvstore.errors.SessionExists:
                n += 1

    def checkpoint(self, name: str) -> None:
        if name in self.sessions:
            self.sessions[name].checkpoint("serve")

    def evict(self, blocks: int) -> None:
        """Free at least `blocks` blocks of KV memory (or as many as can be): close the least recently
        used sessions no job runs on. They were checkpointed when their last job ended, so nothing is
        written; their next request restores them from the store."""
        in_use = set(self.busy.values())
        for name in [n for n in self.sessions if n not in in_use]:  # the least recently used first
            before = len(self.pool.free_ids)
            self.forget(name)
            self.evictions += 1
            blocks -= len(self.pool.free_ids) - before
            if blocks <= 0:
                return

    def forget(self, name: str) -> None:
        session = self.sessions.pop(name, None)
        if session is not None:
            session.close()

    def discard(self, name: str) -> None:
        """Drop the session from memory without a checkpoint (`Session.discard`): after a request
        that failed midway (a full disk), its next request restores it from its last checkpoint."""
        session = self.sessions.pop(name, None)
        if session is not None:
            session.discard()

    def delete(self, name: str) -> None:
        """Close the session if it is open here, then delete it from the store (SessionNotFound if
        there is none)."""
        self.forget(name)
        self.store.delete(name)

    def resident(self) -> dict[str, int]:
        if self.pool is not None:
            return {"resident_bytes": self.pool.used * self.pool.block_bytes}
        return {"resident_bytes": sum(s.n_cached for s in self.sessions.values()) * self.token_bytes}

    def close(self) -> None:
        while self.sessions:
            _, session = self.sessions.popitem()
            try:
                session.close()
            except Exception:  # noqa: BLE001 -- its last checkpoint stands; close the others
                pass


def main(conn, settings: dict[str, Any]) -> None:
    """The engine process's entry point (multiprocessing, spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    signal.signal(signal.SIGTERM, _exit)
    import torch

    # torch's OpenMP (libgomp) keeps its threads spinning a while after each parallel region, so the
    # next of a step's ~150 regions starts at once; that spinning is left as it is. Measured in a served
    # decode of 512-token sessions (Intel Xeon with AMX, 2 threads, alternated, 6 points each), against
    # the default: OMP_WAIT_POLICY=PASSIVE 0.44x the rate at 1 session and 0.68x at 8; GOMP_SPINCOUNT
    # 10000 0.92x and 0.98x; 1000 0.90x and 0.92x. Again with the layer stack in one region (AMD EPYC
    # Zen 4, medians of 3 points, two alternated rounds): PASSIVE 0.47-0.56x and 0.82-0.83x (its 8:1
    # ratio 4.1-4.3x only because its single session is so slow), GOMP_SPINCOUNT 10000 0.69-0.94x and
    # 0.92-0.95x.
    torch.set_num_threads(settings["threads"])
    store = kvstore.open_store(settings["home"], url=settings.get("index"))
    model = kvstore.load_model(settings["model"], dtype=settings.get("dtype"), weights=settings.get("weights"),
                               device=settings.get("device") or "cpu")
    engine = Engine(store, model, max_open=settings.get("max_open", 16), step_tokens=settings.get("step_tokens", 512),
                    kv_memory=settings.get("kv_memory"), max_slowdown=settings.get("max_slowdown", 2.0))
    engine.index = settings.get("engine", 0)
    warm_up(model, engine.pool)
    store.warm_up()  # the first request's open and checkpoint find the index statements compiled, the threads up
    working = WorkingSet(store.home, engine.index)
    held = working.load()  # read before any request changes what this engine holds
    conn.send({"event": "ready", "pid": os.getpid(), "model": settings["model_id"],
               "max_context": model.config.max_context, "eos_ids": sorted(model.tokenizer.eos_ids)})
    try:
        prewarm = Prewarm(engine, held, settings.get("workers", 1)) if settings.get("prewarm", True) else None
        Loop(conn, engine, working, prewarm).run()
    finally:
        engine.close()
        store.close()


def warm_up(model, pool=None, prompt_tokens: int = 64, steps: int = 2, cache_tokens: int = 4096) -> None:
    """Run a prefill and a few decode steps on a scratch cache before saying ready, so that the first
    request does not pay for first touches (the weights' pages, the kernels' setup), and write every
    page of a cache of `cache_tokens` once: freed, it is the memory the first restored session
    fills (`KVCache`'s pool) instead of fresh pages, a fault per 4 KiB. It changes no bit of any
    later run (the forward depends on its inputs only: tests/test_determinism_perf.py). The paged KV
    memory is written once too, for the same reason. The chat template is compiled and the modules
    a session needs imported: a first chat turn after a start took 28 ms more than the next ones
    without (an open of a 2,300-token session 7 ms more; SmolLM2, Intel Xeon with AMX, in-process)."""
    if pool is not None:
        for layer in pool.layers:
            layer.zero_()
    room = model.new_cache(capacity=min(cache_tokens, model.config.max_context))
    with room.filling(room.capacity) as rows:
        for layer in rows:
            layer.zero_()
    room.release()
    kvstore.Session  # noqa: B018 -- a session's modules imported now, not by the first request
    if model.tokenizer.chat_template:  # jinja2 imported and the template compiled now, likewise
        try:
            model.tokenizer.render_chat([{"role": "user", "content": "warm-up"}])
        except kvstore.errors.KvstoreError:
            pass  # a template that refuses this conversation tells a request that sends one
    prompt_tokens = max(1, min(prompt_tokens, model.config.max_context - steps - 1))
    ids = [i % model.config.vocab_size for i in range(1, prompt_tokens + 1)]
    seq = kvstore.Sequence(model, chunk_size=prompt_tokens)
    try:
        list(seq.extend(ids))
        for _ in seq.generate(kvstore.SamplerSettings(), seed=0, max_new_tokens=steps):
            pass
    finally:
        seq.close()


def _exit(*_) -> None:
    raise SystemExit(0)  # unwinds through main's `finally`: every session checkpointed and closed


class Loop:
    """Runs the jobs: each engine step advances every running job by one event, their model calls
    batched (`batching.Batcher`: one forward for every decode token and the prompt rows its pace allows)."""

    def __init__(self, conn, engine: Engine, working: WorkingSet | None = None, prewarm: Prewarm | None = None):
        self.conn, self.engine = conn, engine
        self.working, self.prewarm = working, prewarm  # what it holds open, noted; what it held, restored
        self.running: OrderedDict[str, Any] = OrderedDict()
        self.stopping = False
        self.batcher = engine.batcher
        # (sessions, decode rows, prompt rows, the model's seconds, the step's seconds) of each forward
        self.steps: list[tuple[int, int, int, float, float]] = []
        self.stats_sent = time.monotonic()

    def run(self) -> None:
        while not (self.stopping and not self.running):
            if self.steps and not self.running:  # idle: the last steps' sizes reach the metrics now
                self._send_stats()
            if not self.running and not self.prewarm and self.working is not None:
                self.working.save(list(self.engine.sessions))  # idle: what it holds open, noted for its next start
            self._receive(0 if self.running or self.prewarm else 0.5)
            if self.running:
                self._step()
            elif self.prewarm and not self.stopping:  # nothing to run: the next session it held before its start
                if (done := self.prewarm.step()) is not None:
                    self.prewarm = None
                    if done["sessions"] or done["skipped"]:
                        self._send(done)

    def _receive(self, timeout: float) -> None:
        try:
            while self.conn.poll(timeout):
                timeout = 0
                self._handle(self.conn.recv())
        except (EOFError, OSError):  # the API process is gone: checkpoint everything and leave
            self._close_all()
            self.stopping = True

    def _handle(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "run":
            self.running[msg["id"]] = jobs.run(self.engine, msg)
            self.engine.busy[msg["id"]] = msg.get("session")
        elif msg["op"] == "cancel":
            job = self.running.pop(msg["id"], None)
            if job is not None:
                self._close(msg["id"], job)
        elif msg["op"] == "stop":
            self.stopping = True

    def _step(self) -> None:
        started = time.perf_counter()
        done, step = self.batcher.run({job_id: (lambda job=job: next(job, _FINISHED))
                                       for job_id, job in self.running.items()})
        events, closing = [], []
        try:
            for job_id, event in done.items():
                if isinstance(event, BaseException):
                    raise event
                if event is _FINISHED:
                    del self.running[job_id]
                    self.engine.busy.pop(job_id, None)
                    continue
                if event["event"] == "prefill":
                    continue  # the job had its turn: one chunk of its prompt
                events.append({**event, "id": job_id})
                if event["event"] in ("end", "error") and job_id in self.running:
                    closing.append(job_id)
        finally:  # what the step made before a failure still goes out, as each event did on its own
            if events:
                self._send(events[0] if len(events) == 1 else {"event": "step", "events": events})
            for job_id in closing:  # after its last event went out: the client does not wait for the checkpoint
                if job_id in self.running:
                    self._close(job_id, self.running.pop(job_id))
            self._count(step, time.perf_counter() - started)

    def _count(self, step, seconds: float) -> None:
        """Each forward's size and seconds, and the whole step's (the jobs' own work around the forward:
        sampling, their events, their checkpoints), sent to the API process's metrics at most every
        STATS_EVERY seconds while jobs run, and as soon as the engine has nothing to run (`run`)."""
        if step.sessions:
            self.steps.append((step.sessions, step.decode_rows, step.prefill_rows, step.model_s, seconds))
        if self.steps and time.monotonic() - self.stats_sent >= STATS_EVERY:
            self._send_stats()

    def _send_stats(self) -> None:
        pool, engine = self.engine.pool, self.engine
        kv = {} if pool is None else {"kv_used": pool.used, "kv_blocks": pool.n_blocks}
        self._send({"event": "stats", "engine": engine.index, "steps": self.steps, "evictions": engine.evictions, **kv})
        self.steps, self.stats_sent, engine.evictions = [], time.monotonic(), 0

    def _close(self, job_id: str, job) -> None:
        self.batcher.abandon(job_id)  # a job waiting for the model stops there
        job.close()  # the session's generator checkpoints as it closes
        self.engine.busy.pop(job_id, None)

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            self._close_all()
            self.stopping = True

    def _close_all(self) -> None:
        for job_id, job in self.running.items():
            self._close(job_id, job)
        self.running.clear()


_FINISHED = object()  # a job's generator is exhausted
STATS_EVERY = 0.5  # seconds between two stats messages
