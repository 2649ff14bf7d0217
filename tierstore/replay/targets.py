"""What a replay drives: the :class:`ReplayTarget` contract, the library target (a
:class:`~tierstore.store.TierStore` in this process) and the configurations compared.

Service mode (``--url``, a running ``tierstore serve``) is a second implementation of
:class:`ReplayTarget` that is not written yet: it would look prompts up and put envelopes
over HTTP and verify the bytes the service returns, with the driver unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from remote_tier import RemoteTierConfig
from tierstore.config import StoreConfig
from tierstore.errors import InternalError
from tierstore.eviction import StopRule
from tierstore.layout import ModelLayout
from tierstore.replay.l3 import BoundedRedis
from tierstore.replay.scaled import payload, same_bytes
from tierstore.results import Lease
from tierstore.store import TierStore

NAMESPACE = "replay"


class ReplayIntegrityError(InternalError):
    """A cache returned bytes that are not the page's envelope (never a mere miss)."""


@dataclass(frozen=True)
class Lookup:
    """A prompt's lookup on arrival: cached prefix length and what to release on completion."""

    tokens: int
    pages: int
    lease: object | None


class ReplayTarget(Protocol):
    """A cache under replay. ``lookup`` finds (and locks) the cached prefix of a prompt when
    the request arrives; ``complete`` caches the prompt's full pages when it finishes and
    unlocks the prefix. ``figures`` reports counters (scaled bytes), ``check`` raises if the
    cache's own invariants are broken, ``close`` frees it."""

    name: str

    def lookup(self, tokens: np.ndarray, keys: list[bytes],
               envelopes: Mapping[str, torch.Tensor]) -> Lookup: ...

    def complete(self, lookup: Lookup, tokens: np.ndarray,
                 envelopes: Mapping[str, torch.Tensor]) -> None: ...

    def figures(self) -> dict[str, object]: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


class LibraryTarget:
    """A TierStore in this process. With ``verify``, every hit's envelopes are read back from
    the arena and compared with the payloads written for those pages."""

    def __init__(self, name: str, store: TierStore, *, verify: bool = True,
                 redis: BoundedRedis | None = None) -> None:
        self.name = name
        self.store = store
        self.verify = verify
        self.redis = redis
        self.verified = 0  # envelopes checked
        self.not_stored = 0  # inserts that found no room (everything else locked)

    def lookup(self, tokens: np.ndarray, keys: list[bytes],
               envelopes: Mapping[str, torch.Tensor]) -> Lookup:
        m = self.store.match(tokens[: max(0, len(tokens) - 1)], NAMESPACE)
        if self.verify and m.pages:
            self._check(m.pages, m.kv, m.swa, m.state, keys, envelopes)
        return Lookup(m.tokens, m.pages, m.lease)

    def _check(self, pages: int, kv: torch.Tensor, swa: torch.Tensor, state: int | None,
               keys: list[bytes], envelopes: Mapping[str, torch.Tensor]) -> None:
        arena = self.store.arena
        checks = [("kv", kv, envelopes["kv"][:pages])]
        if "swa" in envelopes:
            held = swa >= 0
            checks.append(("swa", swa[held], envelopes["swa"][:pages][held]))
        if state is not None:
            unit = arena.spec("state").unit_bytes
            checks.append(("state", torch.tensor([state]),
                           payload(keys[pages - 1: pages], "state", unit)))
        for kind, ids, want in checks:
            got = arena.read(kind, ids).cpu()
            if not same_bytes(got, want):
                bad = int((got != want).any(dim=1).sum())
                raise ReplayIntegrityError(
                    f"{self.name}: {bad} of {len(ids)} {kind} envelopes of a {pages}-page hit "
                    f"hold the wrong bytes")
            self.verified += len(ids)

    def complete(self, lookup: Lookup, tokens: np.ndarray,
                 envelopes: Mapping[str, torch.Tensor]) -> None:
        pages = len(envelopes["kv"])
        if pages:
            result = self.store.insert(
                tokens[: pages * self.store.layout.page_size], NAMESPACE, kv=envelopes["kv"],
                swa=envelopes.get("swa"), state=envelopes.get("state"))
            self.not_stored += not result.stored
        if isinstance(lookup.lease, Lease):
            self.store.release(lookup.lease)

    def figures(self) -> dict[str, object]:
        s = self.store.stats()
        out: dict[str, object] = {
            "requests": s.requests, "requests_hit": s.requests_hit,
            "hit_tokens": dict(s.hit_tokens), "hit_requests": dict(s.hit_requests),
            "moved_bytes": dict(s.moved_bytes), "evictions": s.evictions,
            "evicted_blocks": dict(s.evicted_blocks), "not_stored": self.not_stored,
            "verified_envelopes": self.verified, "index_pages": s.pages,
        }
        if s.remote is not None:
            out["l3"] = {k: s.remote[k] for k in ("num_hits", "num_misses", "num_puts",
                                                  "num_put_failures", "bridge_failures")}
        if self.redis is not None:
            out["redis"] = self.redis.figures()
        return out

    def check(self) -> None:
        self.store.check_integrity()

    def close(self) -> None:
        self.store.close()
        if self.redis is not None:
            self.redis.close()


# ====================================================================== configurations
@dataclass(frozen=True)
class Baseline:
    """One configuration of the comparison (issue 8, item 3)."""

    key: str
    name: str
    description: str
    stop_rule: StopRule = "unified"
    fixed_split: bool = False
    host: bool = False
    remote: bool = False
    infinite: bool = False


BASELINES: dict[str, Baseline] = {b.key: b for b in (
    Baseline("a", "gpu_lru", "GPU-only LRU radix cache, no tiers (unified arena)"),
    Baseline("b", "fixed_split", "GPU-only, the same bytes in fixed per-kind pools",
             fixed_split=True),
    Baseline("c", "per_kind", "GPU-only, per_kind stopping rule", stop_rule="per_kind"),
    Baseline("d", "tier_l2", "tierstore: GPU + host (L2)", host=True),
    Baseline("e", "tier_l2_l3", "tierstore: GPU + host (L2) + Redis (L3)", host=True,
             remote=True),
    Baseline("f", "infinite", "infinite cache: the GPU holds the whole working set",
             infinite=True),
)}


@dataclass(frozen=True)
class Capacities:
    """Scaled byte sizes: L1, L2, L3 (None: unbounded), the infinite L1, and the fixed split's
    shares; ``mix`` is each kind's share of the working set's bytes (sizes the L3 limit)."""

    l1: int
    l2: int
    l3: int | None
    infinite: int
    split: Mapping[str, float]
    mix: Mapping[str, float]


def open_target(baseline: Baseline, layout: ModelLayout, caps: Capacities, *,
                verify: bool = True, max_value_bytes: int = 256 << 20) -> LibraryTarget:
    """Build the store (and, for L3, a private bounded Redis) of one configuration."""
    l1 = caps.infinite if baseline.infinite else caps.l1
    redis = BoundedRedis(caps.l3) if baseline.remote else None
    store: TierStore | None = None
    try:
        remote = None
        if redis is not None:
            remote = RemoteTierConfig(url=redis.url, key_prefix=f"replay-{baseline.key}",
                                      op_timeout_s=10.0, max_value_bytes=max_value_bytes)
        shares = tuple(caps.split.items()) if baseline.fixed_split else None
        config = StoreConfig(capacity_bytes=l1, stop_rule=baseline.stop_rule,
                             host_capacity_bytes=caps.l2 if baseline.host else 0, remote=remote,
                             pool_shares=shares)
        store = TierStore(layout, config)
        if redis is not None:
            redis.limit(store, caps.mix)
    except BaseException:
        if store is not None:
            store.close()
        if redis is not None:
            redis.close()
        raise
    return LibraryTarget(baseline.name, store, verify=verify, redis=redis)
