"""The vLLM tier's configuration (the tier's entry of ``secondary_tiers``) and the names its
blocks are stored under: a namespace that folds in the model's layout fingerprint, and one key
per (KV cache group, block hash)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from tierstore.hashing import check_namespace
from tierstore.integrations._support import TierStoreL3Config, _sanitize
from tierstore.settings import environment

FORMAT = 1  # bump when the stored value of a block changes meaning


@dataclass(frozen=True)
class VllmTierConfig:
    """How the tier reaches ``tierstore serve`` and how hard it works.

    ``url`` / ``auth_token`` (else ``TIERSTORE_AUTH_TOKEN``): the service and the bearer token
    whose principal (tenant) owns the stored blocks. ``namespace``: the first part of the
    blocks' namespace (the model and its layout fingerprint are appended). ``transport``:
    ``auto`` maps the service's shared segment when it runs on this host, else HTTP.
    ``load_threads`` / ``store_threads``: the tier's own I/O threads (loads never queue behind
    stores); each takes its share of the queued jobs as one request of up to ``max_batch``
    blocks. ``present_ttl_s`` / ``absent_ttl_s``: how long a presence verdict is trusted
    before ``lookup`` asks the service again (an absent block may be stored by another engine
    meanwhile). ``probe_batch``: keys per existence request.
    """

    url: str = "http://127.0.0.1:8080"
    auth_token: str | None = None
    namespace: str = "vllm"
    transport: Literal["auto", "shm", "http"] = "auto"
    load_threads: int = 4
    store_threads: int = 4
    present_ttl_s: float = 60.0
    absent_ttl_s: float = 1.0
    probe_batch: int = 1024
    max_batch: int = 256
    max_request_bytes: int = 16 << 20
    timeout_s: float = 30.0
    retries: int = 1
    retry_down_s: float = 1.0
    log_interval_s: float = 30.0
    locality: Literal["LOCAL", "REMOTE"] | None = None

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if len(self.namespace) > 48:
            raise ValueError(f"namespace must be at most 48 characters, got "
                             f"{len(self.namespace)}")
        if self.transport not in ("auto", "shm", "http"):
            raise ValueError(f"transport must be auto, shm or http, got {self.transport!r}")
        if self.locality not in (None, "LOCAL", "REMOTE"):
            raise ValueError(f"locality must be LOCAL or REMOTE, got {self.locality!r}")
        for name in ("load_threads", "store_threads", "probe_batch", "max_batch",
                     "max_request_bytes", "timeout_s", "present_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("absent_ttl_s", "retries", "retry_down_s", "log_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> VllmTierConfig:
        """The config from the tier's options; an unknown option is a ValueError naming it (a
        typo must not silently fall back to a default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown tierstore tier option(s) {unknown}; known: "
                             f"{sorted(known)}")
        given = dict(options)
        given.setdefault("auth_token", environment().auth_token)
        return cls(**given)

    def service_io_config(self) -> TierStoreL3Config:
        """The settings of the shared service I/O layer (``integrations/_io.py``)."""
        return TierStoreL3Config(
            url=self.url, auth_token=self.auth_token, namespace=self.namespace,
            timeout_s=self.timeout_s, retries=self.retries, retry_down_s=self.retry_down_s,
            max_batch=self.max_batch, max_request_bytes=self.max_request_bytes,
            skip_existing=False, log_interval_s=self.log_interval_s, transport=self.transport)


def layout_fingerprint(spec: Any, block_size_bytes: int) -> dict[str, Any]:
    """What fixes the bytes of one offloaded block of this deployment: model, KV dtype, the
    groups (tokens per block, window, layers), tokens per hash, blocks per chunk, bytes per
    block and row, parallel topology and layout flags. Never the worker's rank: the scheduler's
    primary row holds every worker's share of a block."""
    config = spec.config
    parallel = config.parallel
    groups = [{"group": g.group_id, "tokens_per_block": g.tokens_per_block,
               "window_chunks": g.sliding_window_size_in_chunks,
               "layers": hashlib.sha256("\0".join(g.layer_names).encode()).hexdigest()[:16]}
              for g in config.groups]
    topology = {"agnostic": True} if parallel.is_parallelism_agnostic else {
        "world": parallel.world_size, "tp": parallel.tp_size, "pp": parallel.pp_size,
        "pcp": parallel.pcp_size, "dcp": parallel.dcp_size}
    return {"format": FORMAT, "model": config.model.name, "dtype": config.model.dtype,
            "groups": groups, "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": config.cache.blocks_per_chunk,
            "worker_block_bytes": config.worker_kv_bytes_per_block,
            "row_bytes": block_size_bytes, "topology": topology,
            "replicated": bool(config.replicated_layout),
            "canonical": bool(config.canonical_layout),
            "kv_layout": config.kv_cache_layout}


def block_namespace(prefix: str, spec: Any, block_size_bytes: int) -> str:
    """``{prefix}/{model}.{fingerprint}``: deployments whose blocks differ in any byte of
    layout never read each other's blocks (the service adds the caller's tenant)."""
    digest = hashlib.sha256(json.dumps(layout_fingerprint(spec, block_size_bytes),
                                       sort_keys=True, default=str).encode()).hexdigest()[:16]
    room = 128 - len(prefix) - len(digest) - 2
    model = _sanitize(str(spec.config.model.name or "model"), max(8, min(60, room)))
    return check_namespace(f"{prefix}/{model}.{digest}")


def block_key(offload_key: bytes) -> str:
    """The storage key of a vLLM ``OffloadKey`` (block hash + 4-byte big-endian group index):
    ``g{group}.{hash hex}``, so each KV cache group (full, sliding window, Mamba state) is
    stored, found and missed on its own."""
    group = int.from_bytes(offload_key[-4:], "big")
    return f"g{group}.{offload_key[:-4].hex()}"
