"""The tier's figures, fed to vLLM's offloading metrics (``get_stats``) and defined for its
Prometheus registry (``build_metric_definitions``). vLLM's tiering manager already counts each
tier's bytes, transfer time, lookups and failed jobs; these add what only the tier knows."""

from __future__ import annotations

import threading
from typing import Any

from tierstore.integrations.vllm import _vllm

BLOCKS = "vllm:kv_offload_tierstore_blocks"
LOOKUPS = "vllm:kv_offload_tierstore_lookups"
PROBED = "vllm:kv_offload_tierstore_probed_keys"
PROBE_FAILURES = "vllm:kv_offload_tierstore_probe_failures"
SHM = "vllm:kv_offload_tierstore_shared_memory"


def metric_definitions() -> dict[str, Any]:
    """Name -> vLLM metric metadata of every figure :class:`TierMetrics` reports."""
    if not _vllm.AVAILABLE:
        return {}
    counter, gauge = _vllm.OffloadingCounterMetadata, _vllm.OffloadingGaugeMetadata
    return {
        BLOCKS: counter(documentation="Blocks the tierstore tier moved (op=store|load) or "
                        "failed to move (result=ok|failed).", labelnames=("op", "result")),
        LOOKUPS: counter(documentation="tierstore tier lookups by the presence verdict that "
                         "answered them (present=HIT, absent=MISS, unknown=RETRY and a "
                         "queued probe).", labelnames=("verdict",)),
        PROBED: counter(documentation="Keys the tierstore tier asked the service about "
                        "(batched existence requests)."),
        PROBE_FAILURES: counter(documentation="tierstore existence requests that failed "
                                "(their keys count as misses for absent_ttl_s)."),
        SHM: gauge(documentation="1 while the tierstore tier moves blocks through the "
                   "service's shared memory, 0 over HTTP."),
    }


class TierMetrics:
    """Counters since the last ``take`` (the scheduler reads them each logging interval)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[tuple[str, str], int] = {}
        self._lookups: dict[str, int] = {}
        self._probed = 0
        self._probe_failures = 0

    def lookup(self, verdict: str) -> None:
        self._lookups[verdict] = self._lookups.get(verdict, 0) + 1  # scheduler thread only

    def job(self, op: str, ok: int, failed: int) -> None:
        with self._lock:
            for result, n in (("ok", ok), ("failed", failed)):
                if n:
                    self._blocks[(op, result)] = self._blocks.get((op, result), 0) + n

    def take(self, stats_cls: Any, transport: str, presence: Any) -> Any:
        """A stats payload of the counts since the last call, or None when there are none."""
        with self._lock:
            blocks, self._blocks = self._blocks, {}
        lookups, self._lookups = self._lookups, {}
        probed, failures = presence.num_probed, presence.num_probe_failures
        new_probed, new_failures = probed - self._probed, failures - self._probe_failures
        self._probed, self._probe_failures = probed, failures
        if not (blocks or lookups or new_probed or new_failures):
            return None
        stats = stats_cls()
        for (op, result), n in blocks.items():
            stats.increase_counter(BLOCKS, n, (op, result))
        for verdict, n in lookups.items():
            stats.increase_counter(LOOKUPS, n, (verdict,))
        if new_probed:
            stats.increase_counter(PROBED, new_probed)
        if new_failures:
            stats.increase_counter(PROBE_FAILURES, new_failures)
        stats.set_gauge(SHM, 1 if transport == "shm" else 0)
        return stats
