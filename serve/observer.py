"""What the service notes about each HTTP request while it runs, and its one log line.

`Observer` (an ASGI middleware, `app.py`) opens a `Note` for every request in a context variable;
the parts that learn something write it there: the tenant (`tenants.py`), the error answered
(`app.py`'s handlers, `service.py` for a stream that failed after its first byte), the generating
run's own record (`service.py`). When the request is over the observer counts its error by status
(`kvstore:request_errors_total`) and writes its log line: the run's record when a run wrote one,
else a short one (a request refused before it ran: bad input, no key, a body too large).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvstore.serve")


@dataclass
class Note:
    method: str
    path: str
    session: str | None  # the X-Session-Id header, as sent (cut to 128 characters)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    arrived: float = field(default_factory=time.perf_counter)
    tenant: str | None = None  # the tenant's hashed id, once the key was checked
    status: int | None = None  # the error's status, when one was answered (or broke a stream)
    outcome: str | None = None  # the error's code
    record: dict[str, Any] | None = None  # a generating run's log record (service.py)


current: ContextVar[Note | None] = ContextVar("kvstore_request", default=None)


def note() -> Note | None:
    return current.get()


def failed(status: int, code: str | None) -> None:
    """Record the error this request is answered with (the first one: it is what the client saw)."""
    n = current.get()
    if n is not None and n.status is None:
        n.status, n.outcome = status, code


def write(record: dict[str, Any], log_format: str) -> None:
    """The log line: a JSON object, or key=value pairs (strings JSON-quoted, so a hostile name cannot
    forge a line or a field)."""
    if log_format == "json":
        log.info(json.dumps(record, ensure_ascii=False))
    else:
        log.info(" ".join(f"{k}={json.dumps(v, ensure_ascii=False) if isinstance(v, str) else v}"
                          for k, v in record.items()))


def refused(n: Note, status: int) -> dict[str, Any]:
    """The record of a request that ran nothing."""
    return {"request_id": n.id, "route": f"{n.method} {n.path}", "session": n.session, "tenant": n.tenant,
            "context": None, "tokens_restored": 0, "tokens_computed": 0, "tokens_generated": 0, "ttft_s": None,
            "restore_s": None, "duration_s": round(time.perf_counter() - n.arrived, 4), "status": status,
            "outcome": n.outcome or ("ok" if status < 400 else str(status))}


class Observer:
    """Notes every request (see the module's docstring); logs those under /v1 and counts their errors."""

    def __init__(self, app, metrics, log_format: str):
        self.app, self.metrics, self.log_format = app, metrics, log_format

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        session = headers.get(b"x-session-id")
        n = Note(scope.get("method", ""), scope.get("path", ""),
                 session.decode("latin-1")[:128] if session is not None else None)
        token = current.set(n)
        sent: list[int] = []

        async def watched(message):
            if message["type"] == "http.response.start":
                sent.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:  # the app's own handlers answer every error; this one broke a response
            if n.status is None:
                n.status = 500 if not sent or sent[0] < 400 else sent[0]
                n.outcome = n.outcome or "internal_error"
            raise
        finally:
            current.reset(token)
            status = n.status or (sent[0] if sent else 500)
            if n.path.startswith("/v1"):  # the API's requests (not /health's 503 while loading)
                if status >= 400:
                    self.metrics.errors.labels(str(status)).inc()
                write(n.record if n.record is not None else refused(n, status), self.log_format)
