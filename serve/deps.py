"""What routes share: the service of the app, the tenant of the request (a FastAPI dependency)."""

from __future__ import annotations

from fastapi import Header, Request

from .service import Service
from .tenants import Tenant


def service(request: Request) -> Service:
    return request.app.state.service


def tenant(request: Request, authorization: str | None = Header(None)) -> Tenant:
    return service(request).keys.tenant(authorization)
