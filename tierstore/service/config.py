"""Frozen, validated configuration of the HTTP service."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceConfig:
    """Limits and behaviour of ``tierstore serve``.

    ``max_body_bytes`` replaces aiohttp's 1 MiB default (envelopes are MiBs each);
    ``max_tokens`` bounds one request's tokens and ``max_batch`` the pages / keys of one batch;
    a match that locks its prefix holds a lease for ``lease_ttl_s`` unless released sooner;
    ``kv_host_bytes`` bounds the key-addressed storage's host copy (Redis holds the rest),
    kept in a shared-memory segment that same-host clients map unless ``shm`` is off.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    auth_token: str | None = None
    max_body_bytes: int = 1 << 30
    max_tokens: int = 1 << 20
    max_batch: int = 4096
    lease_ttl_s: float = 30.0
    kv_host_bytes: int = 1 << 30
    kv_namespace: str = "kv"
    shm: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_tokens", "max_batch", "kv_host_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be positive, got {self.lease_ttl_s}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be blank")
