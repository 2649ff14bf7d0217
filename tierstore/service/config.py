"""Frozen, validated configuration of the HTTP service."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServiceConfig:
    """Limits and behaviour of ``tierstore serve``.

    ``max_body_bytes`` replaces aiohttp's 1 MiB default (envelopes are MiBs each);
    ``max_tokens`` bounds one request's tokens and ``max_batch`` the pages / keys of one batch;
    a match that locks its prefix holds a lease for ``lease_ttl_s`` unless released sooner;
    ``kv_host_bytes`` bounds the key-addressed storage's host copy (Redis holds the rest),
    kept in a shared-memory segment that same-host clients map unless ``shm`` is off.

    Connection limits: a request's headers must arrive within ``header_timeout_s`` of its
    first byte and its body within ``body_timeout_s``; a connection idle for
    ``keepalive_timeout_s`` is closed; at ``max_connections`` the longest-idle connection is
    closed to admit a new one (a new one is refused when none is idle). Request bodies being
    read and handled hold at most ``max_inflight_body_bytes`` together (default twice
    ``max_body_bytes``); a body that would exceed it waits up to ``body_timeout_s``, then 503.

    With ``kv_disk_path``, the storage API's values are also kept on a disk tier there
    (``kv_disk_bytes`` of slots of ``kv_disk_chunk_bytes`` each, MAC'd with
    ``kv_disk_mac_key``, None: the deployment secret): host memory is its LRU cache.

    Principals: ``principals`` names a principals file (tokens -> tenants, see
    :mod:`.principals`); without one, ``auth_token`` (if any) is the one principal's token.
    Shared-memory reservations: an uncommitted one is reclaimed after ``reservation_ttl_s``;
    one principal holds at most ``reserved_bytes_per_principal`` (default a quarter of
    ``kv_host_bytes``) in ``reservations_per_principal`` reservations unless its tenant sets
    its own quota, and the service at most ``max_reservations`` in all.
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
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 15.0
    max_connections: int = 1024
    max_inflight_body_bytes: int | None = None
    principals: str | None = None
    reservation_ttl_s: float = 5.0
    reserved_bytes_per_principal: int | None = None
    reservations_per_principal: int = 64
    max_reservations: int = 4096
    kv_disk_path: str | None = None
    kv_disk_bytes: int = 0
    kv_disk_chunk_bytes: int = 256 << 10
    kv_disk_mac_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_tokens", "max_batch", "kv_host_bytes",
                     "max_connections", "header_timeout_s", "body_timeout_s",
                     "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_inflight_body_bytes is not None and \
                self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must be "
                             f">= max_body_bytes ({self.max_body_bytes})")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be positive, got {self.lease_ttl_s}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be blank")
        if self.auth_token is not None and self.principals is not None:
            raise ValueError("give either auth_token or a principals file, not both (put the "
                             "token's hash in the file as a tenant)")
        if self.kv_disk_path is not None and not (self.kv_disk_bytes > 0
                                                  and self.kv_disk_chunk_bytes > 0):
            raise ValueError(f"kv_disk_bytes and kv_disk_chunk_bytes must be positive, got "
                             f"{self.kv_disk_bytes} and {self.kv_disk_chunk_bytes}")
        if not self.reservation_ttl_s > 0:
            raise ValueError(f"reservation_ttl_s must be positive, got {self.reservation_ttl_s}")
        for name in ("reservations_per_principal", "max_reservations"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.reserved_bytes_per_principal is not None and \
                self.reserved_bytes_per_principal < 0:
            raise ValueError(f"reserved_bytes_per_principal must not be negative, got "
                             f"{self.reserved_bytes_per_principal}")

    @property
    def inflight_body_bytes(self) -> int:
        """Bytes of request bodies held at once (``max_inflight_body_bytes`` or its default)."""
        return self.max_inflight_body_bytes or 2 * self.max_body_bytes

    @property
    def reserved_bytes_cap(self) -> int:
        """Bytes one principal may hold reserved (``reserved_bytes_per_principal`` or its
        default, a quarter of ``kv_host_bytes``)."""
        if self.reserved_bytes_per_principal is not None:
            return self.reserved_bytes_per_principal
        return self.kv_host_bytes // 4
