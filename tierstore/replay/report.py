"""Figures of a replay: per configuration, prompt-token hit rate split by tier, requests with
any hit, bytes moved per tier pair, evictions, and prefill seconds saved under a cost model.

Cost model (:class:`CostModel`): recomputing a prompt token costs ``1 / prefill_tok_s``
seconds; a token served from the GPU (L1) costs nothing; one served from host memory (L2) or
Redis (L3) costs the time to bring its bytes to the GPU at that tier's GB/s. Saved seconds per
tier = hit tokens / prefill_tok_s - promoted bytes / GB/s (real bytes, all envelope kinds the
hits needed). Defaults and where they come from:

- ``prefill_tok_s = 10,000``: an *assumption* (no prefill measurement exists in this repo),
  the same default as ``bench retention``, so their figures compare;
- ``host_gbps = 6.4``: ``docs/benchmarks.md``, ``bench tiers``, host store at 4 MiB envelopes
  (the largest measured; CPU->CPU on the 2-core VM, no pinned PCIe copy measured yet);
- ``redis_gbps = 2.5``: ``tierstore bench redis --sizes 1M,4M --total-mb 256 --rounds 3``,
  ``tier_get`` at 4 MiB values, loopback redis-server on the same 2-core VM (2,473 MB/s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tierstore.replay.driver import Series
from tierstore.scaling import ScaledLayout

TIERS = ("l1", "l2", "l3")
GB = 1e9


@dataclass(frozen=True)
class CostModel:
    """Recompute throughput and per-tier fetch bandwidth (see the module docstring)."""

    prefill_tok_s: float = 10_000.0
    host_gbps: float = 6.4
    redis_gbps: float = 2.5

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"cost model: {name} must be > 0, got {value}")

    def saved_s(self, hit_tokens: Mapping[str, int], promoted_real_bytes: Mapping[str, float]
                ) -> dict[str, float]:
        """Prefill seconds saved per tier (and ``total``)."""
        fetch = {"l1": 0.0, "l2": promoted_real_bytes.get("l2", 0.0) / (self.host_gbps * GB),
                 "l3": promoted_real_bytes.get("l3", 0.0) / (self.redis_gbps * GB)}
        out = {t: hit_tokens.get(t, 0) / self.prefill_tok_s - fetch[t] for t in TIERS}
        out["total"] = sum(out.values())
        return out


def summarize(name: str, figures: Mapping[str, object], series: Series,
              scaled: ScaledLayout, cost: CostModel) -> dict[str, object]:
    """One configuration's row: counters turned into rates, real bytes and seconds."""
    prompt = int(sum(series.prompt_tokens))
    hits = np.asarray(series.hit_tokens[name], dtype=np.int64)
    by_tier = {t: int(v) for t, v in figures["hit_tokens"].items()}  # type: ignore[attr-defined]
    assert sum(by_tier.values()) == int(hits.sum()), f"{name}: tier split != hit tokens"
    moved = {k: scaled.real_bytes(v)
             for k, v in figures["moved_bytes"].items()}  # type: ignore[attr-defined]
    promoted = {"l2": moved.get("l2_to_l1", 0.0),
                "l3": moved.get("l3_to_l1", 0.0) + moved.get("l3_to_l2", 0.0)}
    saved = cost.saved_s(by_tier, promoted)
    full_prefill = prompt / cost.prefill_tok_s
    row: dict[str, object] = {
        "config": name,
        "hit_rate": float(hits.sum() / prompt) if prompt else 0.0,
        **{f"hit_{t}": (by_tier.get(t, 0) / prompt if prompt else 0.0) for t in TIERS},
        "requests": len(hits), "requests_hit": int((hits > 0).sum()),
        "requests_hit_rate": float((hits > 0).mean()) if len(hits) else 0.0,
        "moved_gb": {k: v / GB for k, v in moved.items() if v},
        "evictions": figures["evictions"], "evicted_blocks": figures["evicted_blocks"],
        "not_stored": figures["not_stored"], "verified_envelopes": figures["verified_envelopes"],
        "prefill_s_saved": saved, "prefill_s_without_cache": full_prefill,
        "prefill_saved_fraction": saved["total"] / full_prefill if full_prefill else 0.0,
        "wall_s": series.wall_s[name],
    }
    for extra in ("l3", "redis", "latency_ms", "mrc"):
        if extra in figures:
            row[extra] = figures[extra]
    if "attribution" in figures:
        row["tokens"] = _tokens(name, figures["attribution"], by_tier, prompt,  # type: ignore[arg-type]
                                len(hits))
    return row


def _tokens(name: str, attribution: Mapping[str, Any], by_tier: Mapping[str, int],
            prompt: int, requests: int) -> dict[str, Any]:
    """Prompt tokens by outcome: ``hit`` by tier and ``lost`` by reason (``evicted_from`` by
    tier), summing to the prompt tokens. A lookup covers ``prompt[:-1]`` (an engine computes
    the last token whatever is cached): that token is counted with the tail, ``partial_page``."""
    hit = {t: int(n) for t, n in attribution["hit"].items()}
    lost = {r: int(n) for r, n in attribution["lost"].items()}
    lost["partial_page"] = lost.get("partial_page", 0) + requests
    assert hit == {t: by_tier.get(t, 0) for t in hit}, f"{name}: attribution hits != ledger"
    assert sum(hit.values()) + sum(lost.values()) == prompt, \
        f"{name}: {sum(hit.values())} hit + {sum(lost.values())} lost != {prompt} prompt tokens"
    return {"prompt": prompt, "hit": hit, "lost": lost,
            "evicted_from": dict(attribution["evicted_from"])}


def outcome_shares(tokens: Mapping[str, Any]) -> dict[str, float]:
    """A row's ``tokens`` as shares of the prompt: ``hit l1``.., then each lost reason."""
    prompt = tokens["prompt"] or 1
    out = {f"hit {t}": n / prompt for t, n in tokens["hit"].items()}
    out.update({r: n / prompt for r, n in tokens["lost"].items()})
    return out


def windowed(series: Series, name: str, window_s: float) -> list[tuple[float, float]]:
    """Hit rate of prompt tokens per window of trace time: (window midpoint s, rate) for each
    window with requests."""
    t = np.asarray(series.arrival_s, dtype=np.float64)
    prompt = np.asarray(series.prompt_tokens, dtype=np.float64)
    hits = np.asarray(series.hit_tokens[name], dtype=np.float64)
    if not len(t):
        return []
    bucket = np.floor(t / window_s).astype(np.int64)
    n = int(bucket.max()) + 1
    p = np.bincount(bucket, prompt, n)
    h = np.bincount(bucket, hits, n)
    return [((i + 0.5) * window_s, float(h[i] / p[i])) for i in range(n) if p[i] > 0]


def cumulative(series: Series, name: str, points: int = 400) -> list[tuple[float, float]]:
    """Cumulative hit rate of prompt tokens at up to ``points`` request arrivals."""
    t = np.asarray(series.arrival_s, dtype=np.float64)
    if not len(t):
        return []
    p = np.cumsum(np.asarray(series.prompt_tokens, dtype=np.float64))
    h = np.cumsum(np.asarray(series.hit_tokens[name], dtype=np.float64))
    idx = np.unique(np.linspace(0, len(t) - 1, min(points, len(t))).astype(np.int64))
    return [(float(t[i]), float(h[i] / p[i])) for i in idx]

