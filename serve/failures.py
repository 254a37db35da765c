"""Errors as OpenAI's API shapes them: `{"error": {"message", "type", "param", "code"}}`.

`ApiError` is what a route raises; `from_library` maps each of kvstore's errors to a status and a
type in one table (torch-free, so the API process and the engine share it). Nothing here ever
answers with a traceback.
"""

from __future__ import annotations

import re
from typing import Any

from kvstore import errors

CONTEXT = "exceed the model's context"  # kvstore.engine's ModelError for a sequence longer than the context
# library error -> (HTTP status, OpenAI error type, code)
STATUS = [
    (errors.SessionNotFound, 404, "not_found_error", "session_not_found"),
    (errors.SessionBusy, 409, "conflict_error", "session_busy"),
    (errors.SessionExists, 409, "conflict_error", "session_exists"),
    (errors.ModelMismatch, 409, "conflict_error", "model_mismatch"),
    (errors.InvalidName, 400, "invalid_request_error", "invalid_name"),
    (errors.InvalidArgument, 400, "invalid_request_error", "invalid_value"),
    (errors.UnsupportedFormat, 400, "invalid_request_error", "unsupported_format"),
    (errors.CorruptData, 422, "invalid_request_error", "corrupt_data"),
    (errors.StoreFull, 507, "server_error", "store_full"),
    (errors.PoolTooSmall, 400, "invalid_request_error", "kv_memory_exceeded"),
    (errors.PoolFull, 503, "server_error", "kv_memory_full"),
    (errors.IndexBusy, 503, "server_error", "index_busy"),
    (errors.ModelError, 400, "invalid_request_error", "model_error"),
]


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_event(self) -> dict[str, Any]:
        return {"event": "error", "status": self.status, "message": self.message, "type": self.type,
                "param": self.param, "code": self.code}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> "ApiError":
        return cls(event["status"], event["message"], type=event["type"], param=event.get("param"),
                   code=event.get("code"))


def from_library(e: BaseException) -> ApiError:
    """The ApiError for one of kvstore's errors (or a ValueError of bad input; an ApiError is itself);
    a server_error for anything else, with its one-line message and no traceback."""
    if isinstance(e, ApiError):  # an engine's job answering with one of its own
        return e
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, errors.ModelError) and CONTEXT in text:  # OpenAI's code for a prompt that does not fit
        return ApiError(400, text, code="context_length_exceeded")
    for kind, status, type_, code in STATUS:
        if isinstance(e, kind):
            return ApiError(status, text, type=type_, code=code)
    if isinstance(e, ValueError):
        return ApiError(400, text, code="invalid_value")
    if isinstance(e, OSError) and getattr(e, "errno", None) == 28:
        return ApiError(507, f"the store's disk is full: {text}", type="server_error", code="store_full")
    return ApiError(500, f"internal error: {type(e).__name__}: {text}", type="server_error", code="internal_error")


# the library's advice to the store's operator (commands of the `kvstore` CLI), which an API client cannot follow
OPERATOR_HINT = re.compile(r"[.;] (?:[Rr]un `kvstore [^`]*`[^.;]*|Free some space \(kvstore [^)]*\)[^.;]*)"
                           r"|\s*\(`kvstore [^`]*`[^)]*\)")
# what a client can do instead, by code
CLIENT_ADVICE = {
    "corrupt_data": "; this session's stored data is damaged and cannot be continued: delete it "
                    "(DELETE /v1/sessions/{name}) to start it again, or continue from a fork of it made earlier. "
                    "The server's operator can check the store with `kvstore verify`",
    "store_full": ". Try again later, once the server's operator has freed space",
}


def for_tenant(e: ApiError, tenant, public: str | None = None, stored: str | None = None) -> ApiError:
    """The error as the tenant may read it: its sessions by its own names (the store's prefix taken
    out), no path of the server's (a missing session is just not found), and for a damaged
    session or a full disk what the client can do (`CLIENT_ADVICE`) in place of the operator's
    commands."""
    message = e.message
    if e.code == "session_not_found":
        if public is not None:
            return not_found("session", public)
        message = message.split(";")[0]
    if e.code in CLIENT_ADVICE:
        message = OPERATOR_HINT.sub("", message) + CLIENT_ADVICE[e.code].format(name=public or "NAME")
    if stored and public is not None:
        message = message.replace(repr(stored), repr(public))
    if tenant.prefix:
        message = message.replace(tenant.prefix, "")
    if message == e.message:
        return e
    return ApiError(e.status, message, type=e.type, param=e.param, code=e.code, headers=e.headers)


def not_found(what: str, name: str) -> ApiError:
    return ApiError(404, f"no {what} {name!r}", type="not_found_error", code=f"{what.replace(' ', '_')}_not_found")
