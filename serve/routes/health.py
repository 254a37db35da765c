"""GET /health (503 while the engines load the model, 200 when ready), GET /v1/models, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..deps import service, tenant
from ..failures import not_found

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    svc = service(request)
    if svc.pool.failed:
        return JSONResponse({"status": "failed", "detail": svc.pool.failed}, status_code=503)
    if not svc.pool.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    return {"status": "ok", "model": svc.model_id, "engines": svc.pool.pids()}


def model_card(svc) -> dict:
    info = svc.pool.info
    return {"id": svc.model_id, "object": "model", "created": svc.created, "owned_by": "kvstore",
            "max_model_len": info.get("max_context")}


@router.get("/v1/models", dependencies=[Depends(tenant)])
async def models(request: Request):
    return {"object": "list", "data": [model_card(service(request))]}


@router.get("/v1/models/{model}", dependencies=[Depends(tenant)])
async def model(model: str, request: Request):
    svc = service(request)
    if model != svc.model_id:
        raise not_found("model", model)
    return model_card(svc)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(service(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
