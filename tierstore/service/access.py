"""Who is asking and what they may name: the principal of a request and its namespace checks.

With a principals file, a request's bearer token picks its tenant (401 without a known one);
else the service's single ``auth_token`` (if any) is checked and every request is of the open
tenant. A principal owns the leases and reservations it takes: the tenant with a file, the
token's digest with a single token, the client's address without one.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from aiohttp import web

from tierstore.hashing import check_namespace, tenant_namespace
from tierstore.service.codec import HTTPError, field
from tierstore.service.config import ServiceConfig
from tierstore.service.principals import OPEN, Principal, Principals

PRINCIPAL: Any = web.RequestKey("principal", Principal) if hasattr(web, "RequestKey") else \
    "tierstore.principal"
OPEN_PATHS = frozenset({"/healthz"})


class Authenticator:
    """Turns a request's ``Authorization`` header into its :class:`Principal`."""

    def __init__(self, config: ServiceConfig, principals: Principals | None) -> None:
        self.token = config.auth_token
        self.principals = principals
        self._token_id = None if self.token is None else \
            "token:" + hashlib.sha256(self.token.encode()).hexdigest()[:32]

    @property
    def required(self) -> bool:
        """Whether requests (but to ``OPEN_PATHS``) must carry a token."""
        return self.token is not None or self.principals is not None

    def identify(self, request: web.Request) -> Principal:
        """The request's principal; HTTPError 401 without a valid token where one is needed."""
        if request.path in OPEN_PATHS or not self.required:
            return Principal(f"peer:{request.remote or '?'}", OPEN)
        given = request.headers.get("Authorization", "")
        if request.path == "/dashboard" and "token" in request.query:
            given = f"Bearer {request.query['token']}"  # a browser opening the page
        # Headers arrive as latin-1/surrogate-escaped text: compare the bytes sent.
        sent = given.encode("utf-8", "surrogateescape")
        if self.principals is not None:
            tenant = self.principals.lookup(sent[7:]) if sent.startswith(b"Bearer ") else None
            if tenant is not None:
                return Principal(f"tenant:{tenant.name}", tenant)
        elif self.token is not None and hmac.compare_digest(sent, f"Bearer {self.token}".encode()):
            assert self._token_id is not None
            return Principal(self._token_id, OPEN)
        raise HTTPError(401, "unauthorized", "a valid 'Authorization: Bearer' token is required")


def principal(request: web.Request) -> Principal:
    """The principal the auth middleware found for ``request``."""
    found: Principal = request[PRINCIPAL]
    return found


def require_write(request: web.Request) -> Principal:
    """The request's principal; HTTPError 403 ``read_only`` when its tenant may not write."""
    who = principal(request)
    if who.tenant.read_only:
        raise HTTPError(403, "read_only", f"tenant {who.tenant.name!r} is read-only")
    return who


def namespace(request: web.Request, body: dict[str, Any]) -> tuple[Principal, str]:
    """The request's principal and the namespace its body names (``default`` when absent);
    400 when malformed, 403 ``forbidden_namespace`` when the tenant may not use it."""
    who = principal(request)
    name = check_namespace(field(body, "namespace", str, default="default"), scoped=False)
    if not who.tenant.may_use(name):
        raise HTTPError(403, "forbidden_namespace", f"tenant {who.tenant.name!r} may not use "
                                                    f"namespace {name!r}")
    return who, name


def store_namespace(request: web.Request, body: dict[str, Any]) -> str:
    """The namespace a prefix request's pages are keyed under: the body's namespace, scoped by
    the tenant (its salt folds the tenant in)."""
    who, name = namespace(request, body)
    return tenant_namespace(who.tenant.name, name)
