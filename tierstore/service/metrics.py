"""Prometheus metrics, gathered at the edge: a collector over a stats snapshot, plus request
latency histograms observed by the app's middleware."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tierstore.results import StoreStats

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class StoreCollector(Collector):
    """Turns the latest ``StoreStats`` snapshot (set by the /metrics handler) into metrics."""

    def __init__(self) -> None:
        self.snapshot: StoreStats | None = None
        self.extra: dict[str, Any] = {}
        self.kv_errors: dict[str, int] = {}  # the storage API's Redis tier (``tskv:`` keys)

    def collect(self) -> Iterator[Any]:
        s = self.snapshot
        if s is None:
            return
        tokens = CounterMetricFamily("tierstore_hit_tokens", "Prompt tokens served, by tier",
                                     labels=["tier"])
        for tier, n in s.hit_tokens.items():
            tokens.add_metric([tier], n)
        tokens.add_metric(["miss"], s.tokens_queried - s.tokens_hit)
        yield tokens
        requests = CounterMetricFamily("tierstore_hit_requests",
                                       "Match requests by the deepest tier that served them",
                                       labels=["tier"])
        for tier, n in s.hit_requests.items():
            requests.add_metric([tier], n)
        yield requests
        yield GaugeMetricFamily("tierstore_hit_rate", "Fraction of queried tokens served",
                                value=s.hit_rate)
        moved = CounterMetricFamily("tierstore_moved_bytes", "Bytes moved between tiers",
                                    labels=["direction"])
        for direction, n in s.moved_bytes.items():
            moved.add_metric([direction], n)
        yield moved
        yield _evictions(s)
        if s.attribution is not None:
            yield _prompt_tokens(s.attribution)
        if s.mrc is not None:
            yield _mrc(s.mrc)
        occupancy = GaugeMetricFamily("tierstore_arena_bytes", "Arena bytes by tier, pool, state",
                                      labels=["tier", "pool", "state"])
        edges = GaugeMetricFamily("tierstore_arena_band_edge_bytes", "Band edges (byte offsets)",
                                  labels=["tier", "pool", "edge"])
        moves = CounterMetricFamily("tierstore_compaction_moves", "Blocks moved by compaction",
                                    labels=["tier"])
        for tier, arena in (("l1", s.arena), ("l2", s.host)):
            if arena is None:
                continue
            moves.add_metric([tier], arena.moves)
            occupancy.add_metric([tier, "*", "gap"], arena.gap_bytes)
            for pool, p in arena.pools.items():
                for state, n in (("live", p.live_bytes), ("holes", p.hole_bytes),
                                 ("pending", p.pending_bytes)):
                    occupancy.add_metric([tier, pool, state], n)
                edges.add_metric([tier, pool, "start"], p.band_start)
                edges.add_metric([tier, pool, "end"], p.band_end)
        yield occupancy
        yield edges
        yield moves
        if s.remote is not None or self.kv_errors:
            errors = CounterMetricFamily("tierstore_redis_errors", "Redis errors by kind "
                                         "(prefix store and storage API together)",
                                         labels=["kind"])
            both = Counter(self.kv_errors)
            if s.remote is not None:
                both.update(dict(s.remote.get("errors", {})))  # type: ignore[call-overload]
            for kind, n in sorted(both.items()):
                errors.add_metric([kind], n)
            yield errors
        if s.remote is not None:
            circuit = GaugeMetricFamily("tierstore_redis_circuit_open",
                                        "1 while a node's circuit breaker is not closed",
                                        labels=["node"])
            for node, state in dict(s.remote.get("breakers", {})).items():  # type: ignore[call-overload]
                circuit.add_metric([node], 0.0 if "closed" in str(state).lower() else 1.0)
            yield circuit
        if s.disk is not None:
            yield from _disk(s.disk)
        for name, value in self.extra.items():
            yield GaugeMetricFamily(f"tierstore_{name}", name.replace("_", " "), value=value)


def _disk(d: dict[str, object]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The local disk tier: its bytes, slots per kind, I/O and verification misses."""
    size = GaugeMetricFamily("tierstore_disk_bytes", "Disk tier bytes (slab files; used: "
                             "slots holding envelopes)", labels=["state"])
    size.add_metric(["capacity"], float(d["capacity_bytes"]))  # type: ignore[arg-type]
    size.add_metric(["used"], float(d["used_bytes"]))  # type: ignore[arg-type]
    yield size
    slots = GaugeMetricFamily("tierstore_disk_slots", "Disk tier slots by kind and state",
                              labels=["kind", "state"])
    used: dict[str, int] = d["used"]  # type: ignore[assignment]
    for kind, n in dict(d["slots"]).items():  # type: ignore[call-overload]
        slots.add_metric([kind, "total"], n)
        slots.add_metric([kind, "used"], used.get(kind, 0))
    yield slots
    io = CounterMetricFamily("tierstore_disk_io_bytes", "Disk tier envelope bytes by op",
                             labels=["op"])
    io.add_metric(["read"], float(d["bytes_read"]))  # type: ignore[arg-type]
    io.add_metric(["write"], float(d["bytes_written"]))  # type: ignore[arg-type]
    yield io
    yield CounterMetricFamily("tierstore_disk_misses", "Disk slots that failed verification "
                              "(torn, stale, forged): read as misses",
                              value=float(d["misses"]))  # type: ignore[arg-type]
    yield GaugeMetricFamily("tierstore_disk_recovered", "Slots found at start, left by a "
                            "previous run", value=float(d["recovered"]))  # type: ignore[arg-type]


def _evictions(s: StoreStats) -> CounterMetricFamily:
    family = CounterMetricFamily("tierstore_evictions", "Leaves evicted (demoted) from L1",
                                 labels=["rule"])
    family.add_metric([s.rule], s.evictions)
    return family


def _prompt_tokens(attribution: Mapping[str, Any]) -> CounterMetricFamily:
    """Every matched prompt token once: ``outcome`` hit (``tier`` served it) or a lost reason
    (``tier`` dropped it, for evicted ones; empty otherwise), per ``tenant``."""
    family = CounterMetricFamily("tierstore_prompt_tokens", "Prompt tokens of matches by "
                                 "outcome: hit (by tier) or lost (by reason)",
                                 labels=["outcome", "tier", "tenant"])
    for tenant, t in sorted(attribution["tenants"].items()):
        for tier, n in t["hit"].items():
            family.add_metric(["hit", tier, tenant], n)
        for reason, n in t["lost"].items():
            if reason != "evicted":
                family.add_metric([reason, "", tenant], n)
        for tier, n in t["evicted_from"].items():
            family.add_metric(["evicted", tier, tenant], n)
    return family


def _mrc(mrc: Mapping[str, Any]) -> GaugeMetricFamily:
    """The estimated share of prompt tokens each tier would serve at a multiple of its size."""
    family = GaugeMetricFamily("tierstore_mrc_hit_rate", "Estimated share of prompt tokens a "
                               "tier would serve at a multiple of its size (miss-ratio curve)",
                               labels=["tier", "multiple"])
    for tier, curve in mrc["tiers"].items():
        for m, rate in zip(mrc["multiples"], curve["hit_rate"], strict=True):
            family.add_metric([tier, f"{m:g}"], rate)
    return family


class Metrics:
    """The service's registry: store metrics plus per-endpoint latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.store = StoreCollector()
        self.registry.register(self.store)
        self.latency = Histogram("tierstore_request_seconds", "Request latency by endpoint",
                                 ["endpoint", "status"], buckets=_BUCKETS,
                                 registry=self.registry)
