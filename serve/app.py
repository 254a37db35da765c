"""The FastAPI app: routers, error handlers (OpenAI's error shape for every failure), the body-size
limit, and the lifespan that starts the engines and, at shutdown, drains them.

`create_app(config)` builds it; `command.py` serves it with uvicorn. At shutdown (SIGTERM, Ctrl-C)
uvicorn stops accepting and waits up to the grace period for requests in flight; then the
lifespan refuses new work, cancels what is left (each session checkpoints at its next token) and
stops the engines.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import kvstore

from .config import ServeConfig
from . import observer
from .failures import ApiError, from_library
from .routes import chat, completions, health, responses, sessions, tokens
from .service import Service

log = logging.getLogger("kvstore.serve")
UNLIMITED_BODY = {"/v1/sessions/import"}  # its own limit: ServeConfig.max_import


def create_app(config: ServeConfig) -> FastAPI:
    service = Service(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store = kvstore.open_store(config.home, url=config.index)
        service.pool.start()
        try:
            yield
        finally:
            service.admission.closed = True
            await service.settle()  # the one-request sessions of streams cut by the stop, kept or deleted
            await service.pool.stop()
            app.state.store.close()

    app = FastAPI(title="kvstore", version=kvstore.__version__, lifespan=lifespan,
                  description="Persistent LLM sessions over an OpenAI-compatible API: conversations held as "
                              "stored KV, streams that survive a restart.")
    app.state.service = service
    for module in (health, chat, completions, responses, sessions, tokens):
        app.include_router(module.router)
    install_errors(app)
    app.add_middleware(BodyLimit, limit=config.max_body)
    app.add_middleware(observer.Observer, metrics=service.metrics, log_format=config.log_format)
    if config.allowed_origins:  # outermost: preflights answered before anything, every answer readable
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=CORS_METHODS,
                           allow_headers=CORS_HEADERS, expose_headers=["Retry-After"], max_age=600)
    return app


# what a page of an allowed origin may send: the API's methods, and any header (the preflight's are
# named back: the key, X-Session-Id, Last-Event-ID, the openai package's own)
CORS_METHODS = ["GET", "POST", "DELETE"]
CORS_HEADERS = ["*"]


def install_errors(app: FastAPI) -> None:
    def answer(e: ApiError) -> JSONResponse:
        observer.failed(e.status, e.code or e.type)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return answer(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return answer(from_validation(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not read the body as JSON
            return answer(unreadable(e.__cause__))
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return answer(ApiError(e.status_code, str(e.detail), type=kind, code=str(e.status_code),
                               headers=getattr(e, "headers", None)))

    @app.exception_handler(kvstore.errors.KvstoreError)
    async def library_error(request: Request, e: kvstore.errors.KvstoreError):
        return answer(from_library(e))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return answer(from_library(e))


def from_validation(e: RequestValidationError) -> ApiError:
    """A pydantic or JSON error as OpenAI says it: the first problem, the field it is about."""
    problems = e.errors()
    first = problems[0] if problems else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    message = str(first.get("msg", "invalid request"))
    if "unsupported:" in message:
        name, _, reason = message.split("unsupported:", 1)[1].partition(":")
        return ApiError(400, f"{reason}: '{name}' (kvstore does not implement it)", param=name,
                        code="unsupported_parameter")
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "the body is not valid JSON (UTF-8): " + str(first.get("ctx", {}).get("error", message)),
                        code="invalid_json")
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown field '{'.'.join(loc)}'", param=".".join(loc), code="unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"missing required field '{'.'.join(loc)}'", param=".".join(loc),
                        code="missing_required_parameter")
    return ApiError(400, f"invalid '{'.'.join(loc) or 'body'}': {message}", param=".".join(loc) or None,
                    code="invalid_value")


def unreadable(cause: BaseException) -> ApiError:
    """The 400 for a body that is not JSON text: bytes that are not UTF-8, nesting too deep to parse."""
    if isinstance(cause, UnicodeDecodeError):
        why = f"it is not valid UTF-8 (byte {cause.start})"
    elif isinstance(cause, RecursionError):
        why = "it is nested too deeply"
    else:
        why = " ".join(str(cause).split())[:200] or type(cause).__name__
    return ApiError(400, f"the body is not valid JSON: {why}", code="invalid_json")


class BodyLimit:
    """Reads the body whole before the app sees it, refusing one over `limit` bytes with 413 (by its
    Content-Length, or as it arrives), then hands it on in one piece. Reading it first is what makes
    the answer a 413: a limit hit while FastAPI reads the body would be reported as unparsable."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLIMITED_BODY:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self.too_large(scope, receive, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before it finished sending
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await self.too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send):
        e = ApiError(413, f"the request body is larger than this server's limit of {self.limit} bytes",
                     code="request_too_large")
        observer.failed(e.status, e.code)
        await JSONResponse(e.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
