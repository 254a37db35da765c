"""The stored sessions, natively: /v1/sessions — list, create, info, messages, fork, delete, export
(the archive, streamed) and import.

Reads go to the store at rest in this process (no model, no torch); writes that need the session's
writer lock or the model (create, fork, delete, import) go to the engine the session is pinned to.
Names are the tenant's own (`tenants.py`): another tenant's sessions are not found.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.background import BackgroundTask


from ..deps import service, tenant
from ..failures import ApiError, from_library
from ..protocol import ForkRequest, SessionCreate
from ..tenants import Tenant

router = APIRouter(prefix="/v1/sessions")


def store(request: Request):
    return request.app.state.store


def described(info, who: Tenant) -> dict[str, Any]:
    d = info.to_dict()
    d["name"] = who.public(info.name)
    d["object"] = "session"
    d["parent"] = who.public(info.parent) if info.parent else None
    d["forks"] = [n for n in (who.public(f) for f in info.forks) if n is not None]
    del d["id"], d["model_source"]
    return d


def info_of(request: Request, who: Tenant, name: str):
    return who.info(store(request), name)


@router.get("")
def list_sessions(request: Request, who: Tenant = Depends(tenant), limit: int = Query(100, ge=1, le=1000),
                  after: str | None = None):
    start = who.stored(after) if after else (who.prefix or None)
    page = store(request).page(limit=limit, after=start)
    mine = [s for s in page.sessions if s.name.startswith(who.prefix)]
    more = page.next is not None and len(mine) == len(page.sessions)
    return {"object": "list", "data": [described(s, who) for s in mine],
            "has_more": more, "last_id": who.public(mine[-1].name) if mine else None}


@router.post("")
async def create_session(body: SessionCreate, request: Request, who: Tenant = Depends(tenant)):
    svc = service(request)
    settings = {"seed": body.seed, "temperature": body.temperature, "top_p": body.top_p, "system": body.system}
    if svc.config.chunk_size:
        settings["chunk_size"] = svc.config.chunk_size
    await svc.manage({"kind": "create", "session": who.stored(body.name), "settings": settings}, who)
    return JSONResponse(described(store(request).info(who.stored(body.name)), who), status_code=201)


@router.get("/{name}")
def session_info(name: str, request: Request, who: Tenant = Depends(tenant)):
    return described(info_of(request, who, name), who)


@router.get("/{name}/messages")
def session_messages(name: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(request, who, name)
    rows = store(request).history(who.stored(name))
    return {"object": "list", "data": [{"role": m["role"], "content": m["text"], "token_start": m["token_start"],
                                        "token_end": m["token_end"]} for m in rows]}


@router.post("/{name}/fork")
async def fork_session(name: str, body: ForkRequest, request: Request, who: Tenant = Depends(tenant)):
    info_of(request, who, name)
    await service(request).manage({"kind": "fork", "session": who.stored(name), "new_name": who.stored(body.name),
                                   "at": body.at}, who)
    return JSONResponse(described(store(request).info(who.stored(body.name)), who), status_code=201)


@router.delete("/{name}")
async def delete_session(name: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(request, who, name)
    await service(request).manage({"kind": "delete", "session": who.stored(name)}, who)
    return {"id": name, "object": "session.deleted", "deleted": True}


@router.get("/{name}/export")
def export_session(name: str, request: Request, who: Tenant = Depends(tenant)):
    info_of(request, who, name)
    fd, path = tempfile.mkstemp(prefix="kvstore-export-", suffix=".kvs")
    os.close(fd)
    try:
        store(request).export(who.stored(name), path)
    except Exception as e:  # noqa: BLE001
        os.unlink(path)
        raise from_library(e) from None
    return FileResponse(path, media_type="application/octet-stream", filename=f"{name}.kvs",
                        background=BackgroundTask(os.unlink, path))


@router.post("/import")
async def import_session(request: Request, who: Tenant = Depends(tenant), name: str | None = None):
    svc = service(request)
    if who.prefix and not name:
        raise ApiError(400, "name the imported session: POST /v1/sessions/import?name=NAME", param="name",
                       code="missing_name")
    fd, path = tempfile.mkstemp(prefix="kvstore-import-", suffix=".kvs")
    try:
        size = 0
        with os.fdopen(fd, "wb") as f:
            async for piece in request.stream():
                size += len(piece)
                if size > svc.config.max_import:
                    raise ApiError(413, f"the archive is larger than this server's limit ({svc.config.max_import} "
                                        "bytes)", code="too_large")
                f.write(piece)
        if not size:
            raise ApiError(400, "send the archive (from GET /v1/sessions/NAME/export) as the request body",
                           code="empty_body")
        stored = who.stored(name) if name else None
        end = await svc.manage({"kind": "import", "session": stored or f"import-{os.path.basename(path)}",
                                "path": path, "new_name": stored}, who)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return JSONResponse(described(store(request).info(end["session"]), who), status_code=201)
