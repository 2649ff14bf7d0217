"""Counters of the remote tier and the typed snapshot ``RedisTier.stats()`` returns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from remote_tier.breaker import BreakerState


@dataclass(frozen=True)
class RemoteTierStats:
    """A point-in-time copy of the tier's counters.

    ``errors`` counts failed node calls and rejected values by kind: ``connection``,
    ``timeout``, ``circuit_open``, ``auth``, ``topology`` (server unreachable or refused),
    ``server`` (error replies), ``moved`` (stale cluster slot map), ``corrupt`` (a value
    failed a check), ``incomplete`` (a split value missing a part), ``size_mismatch`` (valid
    value, wrong size for the caller's buffer). Values count once however many parts they
    are split into: ``bytes_in``/``bytes_out`` count payload bytes of hits and acknowledged
    puts (headers excluded). ``breakers`` maps each node address to its breaker state.
    """

    num_hits: int
    num_misses: int
    num_puts: int
    num_put_failures: int
    num_corrupt_deleted: int
    num_deleted: int
    bytes_in: int
    bytes_out: int
    errors: dict[str, int] = field(default_factory=dict)
    breakers: dict[str, BreakerState] = field(default_factory=dict)


class Counters:
    """Mutable counters, bumped once per batch at the tier's edge (never per byte)."""

    def __init__(self) -> None:
        self.num_hits = 0
        self.num_misses = 0
        self.num_puts = 0
        self.num_put_failures = 0
        self.num_corrupt_deleted = 0
        self.num_deleted = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.errors: Counter[str] = Counter()

    def error(self, kind: str, count: int = 1) -> None:
        """Count ``count`` errors of ``kind``."""
        self.errors[kind] += count

    def snapshot(self, breakers: dict[str, BreakerState]) -> RemoteTierStats:
        """The counters as an immutable ``RemoteTierStats``."""
        return RemoteTierStats(
            num_hits=self.num_hits,
            num_misses=self.num_misses,
            num_puts=self.num_puts,
            num_put_failures=self.num_put_failures,
            num_corrupt_deleted=self.num_corrupt_deleted,
            num_deleted=self.num_deleted,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            errors=dict(self.errors),
            breakers=breakers,
        )
