"""Counters of the remote tier and the typed snapshot ``RedisTier.stats()`` returns."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from remote_tier.breaker import BreakerState

log = logging.getLogger(__name__)
LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class RemoteTierStats:
    """A point-in-time copy of the tier's counters.

    ``errors`` counts failed node calls and rejected values by kind: ``connection``,
    ``timeout``, ``circuit_open``, ``auth``, ``topology`` (server unreachable or refused),
    ``server`` (error replies), ``moved`` (stale cluster slot map), ``corrupt`` (a value
    failed a check), ``incomplete`` (a split value missing a part), ``size_mismatch`` (valid
    value, wrong size for the caller's buffer), ``old_format`` (a value in a wire format before
    the MAC: formats 1-4), ``wrongtype`` (a key of this tier holding a non-string Redis type,
    e.g. a LIST). ``num_mac_failures`` counts the values among ``corrupt`` whose MAC tag did
    not verify (damaged, forged, copied from another key, or written with another
    deployment's secret). Values count once however many parts they are split into:
    ``bytes_in``/``bytes_out`` count payload bytes of hits and acknowledged puts (headers
    excluded). ``breakers`` maps each node address to its breaker state.
    """

    num_hits: int
    num_misses: int
    num_puts: int
    num_put_failures: int
    num_corrupt_deleted: int
    num_deleted: int
    num_mac_failures: int
    bytes_in: int
    bytes_out: int
    errors: dict[str, int] = field(default_factory=dict)
    breakers: dict[str, BreakerState] = field(default_factory=dict)


class Counters:
    """Mutable counters, bumped once per batch at the tier's edge (never per byte)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logged: dict[tuple[str, str], float] = {}  # (kind, key class) -> last log time
        self.num_hits = 0
        self.num_misses = 0
        self.num_puts = 0
        self.num_put_failures = 0
        self.num_corrupt_deleted = 0
        self.num_deleted = 0
        self.num_mac_failures = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.errors: Counter[str] = Counter()

    def error(self, kind: str, count: int = 1) -> None:
        """Count ``count`` errors of ``kind``."""
        self.errors[kind] += count

    def anomaly(self, kind: str, key_class: str, detail: str, count: int = 1) -> None:
        """Count ``count`` errors of ``kind`` and log a warning at most once per
        ``LOG_INTERVAL_S`` per ``(kind, key_class)`` (``key_class``: the key's kind, e.g.
        ``kv`` or ``raw``), saying how many were seen since the last line."""
        self.errors[kind] += count
        now = self._clock()
        last = self._logged.get((kind, key_class))
        if last is None or now - last >= LOG_INTERVAL_S:
            self._logged[(kind, key_class)] = now
            log.warning(
                "redis %s value (%s keys, %d so far): %s; deleting it",
                kind, key_class, self.errors[kind], detail,
            )

    def snapshot(self, breakers: dict[str, BreakerState]) -> RemoteTierStats:
        """The counters as an immutable ``RemoteTierStats``."""
        return RemoteTierStats(
            num_hits=self.num_hits,
            num_misses=self.num_misses,
            num_puts=self.num_puts,
            num_put_failures=self.num_put_failures,
            num_corrupt_deleted=self.num_corrupt_deleted,
            num_deleted=self.num_deleted,
            num_mac_failures=self.num_mac_failures,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            errors=dict(self.errors),
            breakers=breakers,
        )
