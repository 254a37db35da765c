"""The service's state and its one way of running a job: admission, the engine, metrics, the log line.

`Service.run(request)` is what every generating route calls: it waits for the session's turn
(`admission.py`), submits the job to the session's engine (`pool.py`) and yields the engine's
events while recording the metrics (time to first token by how the context was obtained, gaps
between tokens, tokens restored / computed / generated, restore and checkpoint times) and, at the
end, one log line for the request. A client that goes away cancels its job: the engine
checkpoints the session at the next token (a session the server made for that request alone is
then kept as a prefix-cache entry or deleted: `drop_soon`, not left behind for good).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar

from . import observer
from .admission import Admission
from .config import ServeConfig
from .failures import ApiError, for_tenant
from .metrics import Metrics
from .pool import Pool
from .tenants import Keys, Tenant

log = logging.getLogger("kvstore.serve")
T = TypeVar("T")


@dataclass
class Run:
    """One generating request: what the route asked, and what the service learned while it ran."""
    spec: dict[str, Any]  # the job (jobs.py)
    tenant: Tenant
    public: str  # the session's name as the tenant knows it
    route: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    arrived: float = field(default_factory=time.perf_counter)
    context: str = "computed"
    started: bool = False  # the job opened or made its session (its start event came)
    restore_s: float | None = None  # the seconds reopening the session from the store took, when it was
    first_token: float | None = None
    end: dict[str, Any] | None = None
    status: int = 200
    outcome: str = "ok"


class Service:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = Metrics()
        self.keys = Keys(config.api_keys)
        settings = {"home": str(config.home) if config.home else None, "index": config.index,
                    "model": config.model, "model_id": config.served_name(), "dtype": config.dtype,
                    "weights": config.weights, "device": config.device, "threads": config.engine_threads(), "max_open": config.max_open,
                    "kv_memory": config.engine_kv_memory(), "step_tokens": config.step_tokens,
                    "max_slowdown": config.max_slowdown, "workers": config.workers, "prewarm": config.prewarm}
        self.pool = Pool(settings, config.workers, self.metrics)
        self.admission = Admission(self.metrics, engines=config.workers, max_running=config.max_running,
                                   max_queue=config.max_queue)
        self.model_id = config.served_name()
        self.created = int(time.time())
        self._drops: set[asyncio.Task] = set()  # drop_soon's tasks

    # -- checks a route makes ------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} does not exist here; this server runs {self.model_id!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def max_tokens(self, asked: int | None) -> int:
        limit = self.config.max_tokens
        if asked is None:
            return limit
        if asked > limit:
            raise ApiError(400, f"max_tokens is {asked}, above this server's limit of {limit}", param="max_tokens",
                           code="invalid_value")
        return asked

    def new_session_settings(self, seed: int | None, sampling: dict[str, float]) -> dict[str, Any]:
        """How a session this request creates is made: OpenAI's defaults (temperature 1) unless asked."""
        create: dict[str, Any] = {**sampling, "seed": seed if seed is not None else uuid.uuid4().int % 2**62,
                                  "temperature": sampling.get("temperature", 1.0),
                                  "top_p": sampling.get("top_p", 1.0)}
        if self.config.chunk_size:
            create["chunk_size"] = self.config.chunk_size
        if self.config.checkpoint_every:
            create["checkpoint_every"] = self.config.checkpoint_every
        return create

    # -- running -------------------------------------------------------------------------------------
    async def run(self, run: Run) -> AsyncIterator[dict[str, Any]]:
        """The job's events (start, token..., end); an error event is raised as ApiError."""
        engine = self.pool.engine_for(run.spec["session"])
        job = None
        try:
            async with self.admission.slot(run.spec["session"], engine):
                job = await self.pool.submit(run.spec, engine)
                last = None
                while True:
                    event = await job.events.get()
                    kind = event["event"]
                    if kind == "error":
                        raise ApiError.from_event(event)
                    now = time.perf_counter()
                    if kind == "start":
                        self._started(run, event)
                    elif kind == "token":
                        if run.first_token is None:
                            run.first_token = now
                            self.metrics.ttft.labels(run.context).observe(now - run.arrived)
                        elif last is not None:
                            self.metrics.itl.observe(now - last)
                        last = now
                    yield event
                    if kind == "end":
                        self._ended(run, event)
                        return
        except ApiError as e:
            e = for_tenant(e, run.tenant, run.public, run.spec["session"])
            run.status, run.outcome = e.status, e.code or e.type
            observer.failed(e.status, run.outcome)  # counted once the request is over (observer.py)
            raise e from None
        except BaseException:
            run.outcome = "cancelled"  # the client went away (or the server is stopping)
            raise
        finally:
            if job is not None and not job.finished:
                self.pool.cancel(job)
            self._log(run)

    def _started(self, run: Run, event: dict[str, Any]) -> None:
        run.started, run.context = True, event["context"]
        if "prefix_queried" in event:
            self.metrics.prefix_queries.inc(event["prefix_queried"])
            self.metrics.prefix_hits.inc(event["prefix_hit"])
        if "restore_seconds" in event:
            run.restore_s = event["restore_seconds"]
            self.metrics.restore_seconds.observe(event["restore_seconds"])
            self.metrics.restore_bytes.inc(event["restore_bytes"])

    def _ended(self, run: Run, event: dict[str, Any]) -> None:
        run.end = event
        m = self.metrics
        computed = max(0, event["prompt_tokens"] - event["cached_tokens"])
        m.prompt_tokens.labels("computed").inc(computed)
        m.prompt_tokens.labels("restored").inc(event["cached_tokens"])
        m.generation_tokens.inc(event["completion_tokens"])
        m.checkpoint_seconds.observe(event["checkpoint_seconds"])
        m.resident.labels(str(self.pool.engine_for(run.spec["session"]))).set(event["resident_bytes"])
        m.requests.labels(event["finish_reason"]).inc()
        m.e2e.observe(time.perf_counter() - run.arrived)

    def _log(self, run: Run) -> None:
        """The request's log line (written when the request is over: observer.py)."""
        end = run.end or {}
        record = {
            "request_id": run.id, "route": run.route, "session": run.public, "tenant": run.tenant.id,
            "context": run.context, "tokens_restored": end.get("cached_tokens", 0),
            "tokens_computed": max(0, end.get("prompt_tokens", 0) - end.get("cached_tokens", 0)),
            "tokens_generated": end.get("completion_tokens", 0),
            "ttft_s": round(run.first_token - run.arrived, 4) if run.first_token else None,
            "restore_s": round(run.restore_s, 5) if run.restore_s is not None else None,
            "duration_s": round(time.perf_counter() - run.arrived, 4), "status": run.status, "outcome": run.outcome,
        }
        note = observer.note()
        if note is not None and note.record is None:
            note.record = record
        else:  # not inside a request (or its second run): log it now
            observer.write(record, self.config.log_format)

    async def drop_session(self, tenant_session: str, *, retain: bool = True, missing_ok: bool = False) -> None:
        """Once its reply is delivered, keep a session this server made for one request (the stateless
        ones) as a prefix-cache entry, or delete it when the cache is off (`--prefix-cache 0`) or
        `retain` is false (an entry keeps the session's name, so a `store: false` response, which must
        not be found by its id, is deleted). A request refused before any output (a prompt beyond the
        context, say) has its session deleted too, once its job started (`Run.started`; admission
        refusals made none): its name never reached the client, and kept it would stay in the store for
        good. It takes the session's turn (`Admission.turn`), after the requests on it before.
        `missing_ok`: no warning when there was no session to delete (the job failed first)."""
        engine = self.pool.engine_for(tenant_session)
        budget = self.config.prefix_cache if retain else 0
        spec = {"kind": "retain", "budget": budget} if budget else {"kind": "delete"}
        try:
            async with self.admission.turn(tenant_session):  # after a resumed stream that came first
                end = await outcome(await self.pool.submit({**spec, "session": tenant_session}, engine))
        except Exception as e:  # noqa: BLE001 -- a leftover session is listed, not lost
            if not (missing_ok and getattr(e, "code", None) == "session_not_found"):
                log.warning("could not %s the one-request session %s: %s", spec["kind"], tenant_session, e)
            return
        if budget:
            self.metrics.prefix_held(end)

    def drop_soon(self, tenant_session: str, *, retain: bool = True) -> asyncio.Task:
        """drop_session in a task of its own, which the request's cancellation does not stop: for a
        stream of a session this server made for the request, once it ended or its client left it
        (else that session would stay in the store for good; kept as an entry, `Last-Event-ID` can
        still finish it until the budget evicts it). Its turn on the session comes after the
        request's, whose end sends the engine its job's cancel first (`run`)."""
        task = asyncio.get_running_loop().create_task(
            self.drop_session(tenant_session, retain=retain, missing_ok=True))
        self._drops.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._drops.discard)
        return task

    async def drop_after(self, stream: AsyncIterator[T], tenant_session: str, *, retain: bool = True) -> AsyncIterator[T]:
        """`stream`'s items, then drop_soon for the session the server made for the request: awaited
        once the stream is delivered, before the response ends (shielded: the client may go now),
        and started without an await when its client left it or it failed (an await there would be
        stopped by the request's cancellation)."""
        over = False
        try:
            async for item in stream:
                yield item
            over = True
            await asyncio.shield(self.drop_soon(tenant_session, retain=retain))
        finally:
            if not over:
                self.drop_soon(tenant_session, retain=retain)

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait for drop_soon's tasks (at most `timeout` seconds): before the engines stop."""
        if self._drops:
            await asyncio.wait(set(self._drops), timeout=timeout)

    async def manage(self, spec: dict[str, Any], tenant: Tenant | None = None) -> dict[str, Any]:
        """A job that writes no reply (create, fork, delete, import; tokenize, detokenize) on the session's
        engine; its end event (ApiError on error, its message in the tenant's names)."""
        engine = self.pool.engine_for(spec["session"])
        async with self.admission.slot(spec["session"], engine):
            try:
                return await outcome(await self.pool.submit(spec, engine))
            except ApiError as error:
                raise (for_tenant(error, tenant) if tenant is not None else error) from None


async def outcome(job) -> dict[str, Any]:
    """A job's end event, once it comes; its error event raised as ApiError."""
    while True:
        event = await job.events.get()
        if event["event"] == "error":
            raise ApiError.from_event(event)
        if event["event"] == "end":
            return event
