"""Leases held by remote clients, with a time-to-live (a client may die holding one).

A lease id is an unguessable ``secrets.token_urlsafe`` string, and a lease can be released
only by the principal that took it (the service passes who is asking); to anyone else it
does not exist."""

from __future__ import annotations

import secrets
import time

from tierstore.results import Lease

LEASE_ID_BYTES = 16  # 128 random bits


class LeaseTable:
    """Maps lease ids handed to clients to the store's leases and their principal, each until
    ``ttl_s`` passes."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._leases: dict[str, tuple[Lease, str, float]] = {}

    def add(self, lease: Lease, principal: str) -> str:
        """Hold ``lease`` for ``principal``; the new lease id."""
        lease_id = secrets.token_urlsafe(LEASE_ID_BYTES)
        while lease_id in self._leases:  # never in practice: 128 random bits
            lease_id = secrets.token_urlsafe(LEASE_ID_BYTES)
        self._leases[lease_id] = (lease, principal, time.monotonic() + self.ttl_s)
        return lease_id

    def pop(self, lease_id: str, principal: str) -> Lease | None:
        """Remove and return the lease ``principal`` holds under ``lease_id``; ``None`` (and
        nothing changes) when there is none, or another principal holds it."""
        entry = self._leases.get(lease_id)
        if entry is None or not secrets.compare_digest(entry[1], principal):
            return None
        del self._leases[lease_id]
        return entry[0]

    def expired(self) -> list[Lease]:
        """Remove and return the leases past their time."""
        now = time.monotonic()
        gone = [i for i, (_, _, until) in self._leases.items() if until <= now]
        return [self._leases.pop(i)[0] for i in gone]

    def __len__(self) -> int:
        return len(self._leases)
