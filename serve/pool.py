"""The engine processes as the API process sees them: started, fed jobs, watched, restarted.

Each engine (`engine.main`) is a spawned process joined by a duplex pipe; a thread per engine reads
its events and hands them to the event loop. A session is pinned to one engine (a hash of its
name), so one process writes it (C7 holds across engines; the flock makes sure). When an engine
dies (`kill -9`, an OOM kill), the pool counts the restart, starts a new one, and resubmits every
job that was running there as a resumed one: from the session's last checkpoint, after the last
token this process received, so the reply goes on byte-identically and nothing is sent twice.
An engine that dies before it is ready, three times running, is not restarted again: the pool
reports it as failed (health 503, requests 503).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import uuid
from typing import Any

from . import engine as engine_main
from .config import engine_of
from .failures import ApiError
from .metrics import Metrics

log = logging.getLogger("kvstore.serve")
FAILED_STARTS = 3


class Job:
    """One request's job as this process tracks it."""

    def __init__(self, spec: dict[str, Any], engine: int):
        self.id = uuid.uuid4().hex
        self.spec, self.engine = spec, engine
        self.events: asyncio.Queue = asyncio.Queue()
        self.reply_start: int | None = spec.get("reply_start")  # a resumed stream: where its reply began
        self.last_position = spec["after"] if spec.get("after") is not None else -1
        self.started = self.finished = False
        # for a run again after its engine died (`jobs.resume`): the session's length when the request
        # began (its first start event's `base`), and whether the echoed prompt came
        self.base: int | None = spec.get("base")
        self.prompt_sent = bool(spec.get("prompt_sent"))


class Worker:
    def __init__(self, index: int, settings: dict[str, Any]):
        ctx = multiprocessing.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=engine_main.main, args=(child, settings), name=f"kvstore-engine-{index}",
                                   daemon=True)
        self.process.start()
        child.close()
        self.ready = asyncio.Event()
        self.info: dict[str, Any] = {}
        self.lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> bool:
        try:
            with self.lock:
                self.conn.send(msg)
            return True
        except (BrokenPipeError, OSError, EOFError):
            return False  # it died: the reader thread notices and the pool restarts it


class Pool:
    def __init__(self, settings: dict[str, Any], engines: int, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.workers: list[Worker | None] = [None] * engines
        self.jobs: dict[str, Job] = {}
        self.failed_starts = [0] * engines
        self.failed: str | None = None
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- life --------------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for i in range(len(self.workers)):
            self._spawn(i)

    def _spawn(self, index: int) -> None:
        worker = self.workers[index] = Worker(index, {**self.settings, "engine": index})
        threading.Thread(target=self._read, args=(worker,), daemon=True, name=f"engine-{index}-reader").start()

    @property
    def ready(self) -> bool:
        return all(w is not None and w.ready.is_set() for w in self.workers)

    @property
    def info(self) -> dict[str, Any]:
        return next((w.info for w in self.workers if w is not None and w.info), {})

    def pids(self) -> list[int | None]:
        return [w.process.pid if w is not None else None for w in self.workers]

    async def stop(self, grace: float = 10.0) -> None:
        """Cancel what still runs (each session checkpoints), stop every engine, wait for them."""
        self.stopping = True
        for job in list(self.jobs.values()):
            self.cancel(job)
        for w in self.workers:
            if w is not None:
                w.send({"op": "stop"})
        for w in self.workers:
            if w is not None:
                await asyncio.to_thread(w.process.join, grace)
                if w.process.is_alive():
                    w.process.terminate()
                    await asyncio.to_thread(w.process.join, 5)

    # -- jobs --------------------------------------------------------------------------------------
    def engine_for(self, session: str) -> int:
        return engine_of(session, len(self.workers))

    async def submit(self, spec: dict[str, Any], engine: int, wait: float = 300.0) -> Job:
        job = Job(spec, engine)
        await self._wait_ready(engine, wait)
        self.jobs[job.id] = job
        if not self.workers[engine].send({"op": "run", "id": job.id, **spec}):
            pass  # the engine died just now: _on_death resubmits it
        return job

    async def _wait_ready(self, engine: int, wait: float) -> None:
        if self.failed:
            raise ApiError(503, self.failed, type="server_error", code="engine_failed")
        try:
            await asyncio.wait_for(self.workers[engine].ready.wait(), wait)
        except TimeoutError:
            raise ApiError(503, "the model is still loading; retry shortly", type="server_error",
                           code="loading", headers={"Retry-After": "5"}) from None

    def cancel(self, job: Job) -> None:
        if not job.finished:
            job.finished = True
            w = self.workers[job.engine]
            if w is not None:
                w.send({"op": "cancel", "id": job.id})
        self.jobs.pop(job.id, None)

    # -- events (reader threads -> the event loop) -----------------------------------------------
    def _read(self, worker: Worker) -> None:
        while True:
            try:
                msg = worker.conn.recv()
            except (EOFError, OSError):
                break
            self.loop.call_soon_threadsafe(self._on_message, worker, msg)
        worker.process.join(5)
        self.loop.call_soon_threadsafe(self._on_death, worker)

    def _on_message(self, worker: Worker, msg: dict[str, Any]) -> None:
        kind = msg["event"]
        if kind == "step":  # an engine step's events, in order (engine.py)
            for event in msg["events"]:
                self._on_message(worker, event)
            return
        if kind == "ready":
            worker.info = msg
            self.failed_starts[worker.index] = 0
            worker.ready.set()
            log.info("engine %d ready (pid %d)", worker.index, msg["pid"])
            return
        if kind == "stats":
            self.metrics.engine_steps(msg)
            return
        if kind == "prewarmed":
            self.metrics.prewarmed.inc(msg["sessions"])
            log.info("engine %d restored %d of the sessions it held before it started (%d tokens) in %.2f s%s",
                     worker.index, msg["sessions"], msg["tokens"], msg["seconds"],
                     f"; {msg['skipped']} left out" if msg["skipped"] else "")
            return
        job = self.jobs.get(msg.get("id", ""))
        if job is None or job.finished:
            return
        if kind == "start":
            if job.base is None:
                job.base = msg.pop("base", None)
            if job.started:
                return  # a resumed job's second start: the client saw the first
            job.started = True
        elif kind == "prompt":
            job.prompt_sent = True
        elif kind == "token":
            if msg["position"] <= job.last_position:
                return
            if job.reply_start is None:
                job.reply_start = msg["position"]
            job.last_position = msg["position"]
        elif kind in ("end", "error"):
            job.finished = True
            self.jobs.pop(job.id, None)
        job.events.put_nowait(msg)

    def _on_death(self, worker: Worker) -> None:
        if self.stopping or self.workers[worker.index] is not worker:
            return
        i = worker.index
        code = worker.process.exitcode
        if not worker.ready.is_set():
            self.failed_starts[i] += 1
            if self.failed_starts[i] >= FAILED_STARTS:
                self.failed = (f"engine {i} died {FAILED_STARTS} times while loading the model (exit code {code}); "
                               "see the server's log")
                log.error(self.failed)
                for job in [j for j in self.jobs.values() if j.engine == i]:
                    self._fail(job)
                return
        self.metrics.restarts.inc()
        log.warning("engine %d died (exit code %s); restarting it, its sessions continue from their checkpoints",
                    i, code)
        self._spawn(i)
        for job in [j for j in self.jobs.values() if j.engine == i and not j.finished]:
            asyncio.ensure_future(self._resubmit(job))

    async def _resubmit(self, job: Job) -> None:
        try:
            await self._wait_ready(job.engine, 300.0)
        except ApiError:
            self._fail(job)
            return
        if job.finished:
            return
        spec = {**job.spec, "after": job.last_position, "reply_start": job.reply_start, "base": job.base,
                "prompt_sent": job.prompt_sent}
        self.workers[job.engine].send({"op": "run", "id": job.id, **spec})

    def _fail(self, job: Job) -> None:
        job.finished = True
        self.jobs.pop(job.id, None)
        job.events.put_nowait(ApiError(503, self.failed or "the engine is gone", type="server_error",
                                       code="engine_failed").to_event())
