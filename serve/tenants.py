"""Who asks: API keys, each key a tenant, and the session names a tenant sees.

Without keys the server has one tenant, the store's owner: every session of the store is visible,
by its own name. With keys (`--api-key-file`, one per line, or $KVSTORE_API_KEYS, comma-separated),
every /v1 call needs `Authorization: Bearer KEY`, and a tenant's sessions are stored under a prefix
derived from its key (`t<hash>:`): names are per tenant, and another tenant's sessions do not exist
for it (404, not 403). The hash, not the key, is what logs and the index hold.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvstore import errors

from . import observer
from .failures import ApiError, not_found

NAME_LIMIT = 128  # the store's limit on a session's name
NAME = re.compile(r"[^\W_][\w.:@+-]*")  # the store's rule (letters, digits, . _ : @ + -), checked here first


@dataclass(frozen=True)
class Tenant:
    id: str  # "owner" without keys, else "t" + 10 hex digits of the key's hash
    prefix: str  # "" or "t<hash>:"

    def stored(self, name: str) -> str:
        """The store's name of this tenant's session `name` (InvalidName for a bad one)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            shown = repr(name) if len(repr(name)) < 60 else repr(name)[:57] + "..."
            raise errors.InvalidName(f"invalid session name {shown}: use letters, digits and . _ : @ + -, "
                                     "starting with a letter or digit")
        full = self.prefix + name
        if len(full) > NAME_LIMIT:
            raise errors.InvalidName(f"session name too long: at most {NAME_LIMIT - len(self.prefix)} characters")
        return full

    def public(self, stored: str) -> str | None:
        """The tenant's name for a stored session, None when it is not this tenant's."""
        if not stored.startswith(self.prefix):
            return None
        return stored[len(self.prefix):]  # the owner (no prefix) sees every session of the store

    def info(self, store, name: str, what: str = "session"):
        """The SessionInfo of this tenant's session `name`; 404 (`what` not found) for any other."""
        try:
            return store.info(self.stored(name))
        except (errors.SessionNotFound, errors.InvalidName):
            raise not_found(what, name) from None


OWNER = Tenant("owner", "")


def tenant_of(key: str) -> Tenant:
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Tenant(f"t{digest}", f"t{digest}:")


def read_keys(path: str | os.PathLike | None, env: str | None) -> list[str]:
    """The API keys from a file (one per line; blank lines and # comments skipped) and/or the
    environment's comma-separated list."""
    keys: list[str] = []
    if path is not None:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if env:
        keys.extend(k.strip() for k in env.split(",") if k.strip())
    for k in keys:
        if len(k) < 8 or any(c.isspace() for c in k):
            raise ValueError("each API key must be at least 8 characters, without spaces")
    return keys


class Keys:
    def __init__(self, keys: list[str]):
        self.tenants = {k: tenant_of(k) for k in keys}

    @property
    def required(self) -> bool:
        return bool(self.tenants)

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an `Authorization` header; 401 in OpenAI's shape when it is missing or wrong."""
        tenant = self._check(authorization)
        note = observer.note()
        if note is not None:
            note.tenant = tenant.id
        return tenant

    def _check(self, authorization: str | None) -> Tenant:
        if not self.tenants:
            return OWNER
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer YOUR_KEY'",
                           code="invalid_api_key")
        for known, tenant in self.tenants.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return tenant
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
