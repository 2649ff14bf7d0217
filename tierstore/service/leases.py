"""Leases held by remote clients, with a time-to-live (a client may die holding one)."""

from __future__ import annotations

import itertools
import time

from tierstore.results import Lease


class LeaseTable:
    """Maps lease ids handed to clients to the store's leases, each until ``ttl_s`` passes."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[Lease, float]] = {}

    def add(self, lease: Lease) -> int:
        lease_id = next(self._ids)
        self._leases[lease_id] = (lease, time.monotonic() + self.ttl_s)
        return lease_id

    def pop(self, lease_id: int) -> Lease | None:
        entry = self._leases.pop(lease_id, None)
        return entry[0] if entry else None

    def expired(self) -> list[Lease]:
        """Remove and return the leases past their time."""
        now = time.monotonic()
        gone = [i for i, (_, until) in self._leases.items() if until <= now]
        return [self._leases.pop(i)[0] for i in gone]

    def __len__(self) -> int:
        return len(self._leases)
