"""The SGLang-independent half of the HiCache backend: its configuration, the deployment
namespace digest, counters, a rate-limited logger, request splitting and SGLang's metrics
record. (``tierstore.integrations.sglang`` holds the HiCacheStorage class itself.)"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tierstore.hashing import check_namespace
from tierstore.settings import environment

log = logging.getLogger("tierstore.integrations.sglang")

@dataclass(frozen=True)
class TierStoreL3Config:
    """How the backend reaches the service; read from SGLang's ``extra_config`` (same names).

    ``retry_down_s``: after a connection failure every call answers a miss at once for this
    long before the service is tried again. ``max_batch`` keys and ``max_request_bytes`` bound
    one request (fewer keys where the service's ``--max-batch`` is lower: it is learned; the
    body limit, ``--max-body``, must allow them); bodies far past 16 MiB are fresh allocations
    whose page faults halve throughput. With ``skip_existing`` a write first asks how many
    leading pages are stored and sends the rest.
    ``transport``: ``auto`` maps the service's shared segment when it runs on this host (else
    HTTP), ``shm`` insists (warning while it cannot), ``http`` never tries.
    """

    url: str = "http://127.0.0.1:8080"
    auth_token: str | None = None
    namespace: str = "sglang"
    timeout_s: float = 30.0
    retries: int = 1
    retry_down_s: float = 2.0
    max_batch: int = 512
    max_request_bytes: int = 16 << 20
    skip_existing: bool = True
    log_interval_s: float = 30.0
    transport: Literal["auto", "shm", "http"] = "auto"

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.transport not in ("auto", "shm", "http"):
            raise ValueError(f"transport must be auto, shm or http, got {self.transport!r}")
        if len(self.namespace) > 64:
            raise ValueError(f"namespace must be at most 64 characters, got "
                             f"{len(self.namespace)}")
        for name in ("timeout_s", "max_batch", "max_request_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("retries", "retry_down_s", "log_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_mapping(cls, extra: Mapping[str, Any]) -> TierStoreL3Config:
        """The config from ``extra_config`` (unknown keys are SGLang's own and ignored); the
        token falls back to ``TIERSTORE_AUTH_TOKEN``."""
        given = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        given.setdefault("auth_token", environment().auth_token)
        return cls(**given)


class _LogLimiter:
    """At most one warning per interval, counting the ones it swallowed."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, msg: str, *args: object, exc_info: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        log.warning(msg, *args, exc_info=exc_info)


@dataclass
class _Counters:
    """Cumulative figures plus SGLang's per-batch metric lists (drained by ``get_stats``)."""

    keep_lists: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("get_pages", "get_hits", "get_bytes", "get_s", "set_pages", "set_stored",
         "set_bytes", "set_s", "failures"), 0))
    lists: dict[str, list[float]] = field(default_factory=lambda: {
        "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []})

    def fail(self) -> None:
        with self.lock:
            self.totals["failures"] += 1

    def record(self, op: str, pages: int, done: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            t = self.totals
            t[f"{op}_pages"] += pages
            t["get_hits" if op == "get" else "set_stored"] += done
            t[f"{op}_bytes"] += nbytes
            t[f"{op}_s"] += seconds
            if self.keep_lists and pages:
                kind = "prefetch" if op == "get" else "backup"
                self.lists[f"{kind}_pgs"].append(pages)
                self.lists[f"{kind}_bandwidth"].append(nbytes / 1e9 / max(seconds, 1e-9))


@dataclass
class _PoolInfo:
    """A registered SGLang host pool and what its flat data pages look like."""

    pool: Any
    page_size: int
    page_bytes: int
    dtype: torch.dtype
    digest: str

    @classmethod
    def of(cls, pool: Any) -> _PoolInfo:
        flat = pool.get_dummy_flat_data_page()
        geometry = _pool_geometry(pool)
        geometry.update(page_bytes=flat.numel() * flat.element_size(), page_dtype=str(flat.dtype))
        return cls(pool, int(getattr(pool, "page_size", 1) or 1), geometry["page_bytes"],
                   flat.dtype, _digest(geometry)[:8])


def _pool_geometry(pool: Any) -> dict[str, Any]:
    """What fixes a host pool's page bytes (never its capacity, which deployments may vary)."""
    found: dict[str, Any] = {"class": type(pool).__name__}
    for name in ("layout", "page_size", "dtype", "size_per_token", "layer_num", "head_num",
                 "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "start_layer",
                 "end_layer", "storage_format_tag", "dcp_size", "dcp_rank"):
        value = getattr(pool, name, None)
        if isinstance(value, (bool, int, float, str, torch.dtype)):
            found[name] = str(value)
    return found


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _sanitize(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "model"


def _as_buffer(value: Any) -> memoryview:
    """The bytes of a tensor (or bytes-like) without a copy when it is contiguous on CPU."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return flat.cpu().numpy().data
    return memoryview(value).cast("B")


def _chunks(sizes: Sequence[int], max_items: int, max_bytes: int) -> Iterator[slice]:
    """Consecutive slices of at most ``max_items`` items and (beyond one item) ``max_bytes``."""
    start, nbytes = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= max_items or nbytes + size > max_bytes):
            yield slice(start, i)
            start, nbytes = i, 0
        nbytes += size
    if start < len(sizes):
        yield slice(start, len(sizes))


@dataclass
class _StandInMetrics:
    """SGLang's StorageMetrics fields, where its metrics module cannot be imported."""

    prefetch_pgs: list[float]
    backup_pgs: list[float]
    prefetch_bandwidth: list[float]
    backup_bandwidth: list[float]


def _storage_metrics(lists: dict[str, list[float]]) -> Any:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:  # only the serving stack pulls in what that module imports
        return _StandInMetrics(**lists)
    return StorageMetrics(**lists)
