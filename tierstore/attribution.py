"""Miss attribution: every prompt token of a match is a hit from one tier, or lost for exactly
one reason.

Reasons (:data:`REASONS`), decided per page past the served prefix:

- ``partial_page``: the tail after the last full page (a prefix cache stores whole pages);
- ``no_room`` / ``l3_unavailable``: the rule allowed more, but promotion could not fit it in L1,
  or L3 was down, timed out, or (``best_effort`` prefetch) not waited for;
- ``swa_window``: the KV is cached and a checkpoint sits at a deeper node end, but the SWA
  window before it is incomplete (for SWA-only models: every page the window check cut);
- ``no_checkpoint``: the KV is cached but no state checkpoint sits at a node end inside it;
- ``evicted``: the page was cached once and no tier holds it now; ``evicted_from`` says which
  tier dropped it last (the :class:`~tierstore.ghost.GhostIndex` remembers dropped pages;
  pages the index still names but no tier holds were lost by L3);
- ``cold``: never cached (or dropped too long ago for the ghost index to remember).

``namespace`` (the same tokens cached under another namespace of the tenant) is left out: page
keys are chained hashes salted with the namespace, so finding the same tokens under another
namespace means hashing the prompt again per namespace — the second pass the issue rules out.

The parts sum to the prompt length by construction: each full page gets one reason, and the
tail is ``partial_page``. :class:`Attribution` keeps the store's totals per tenant and warns
when the cache serves ~nothing although prompts share cached prefixes.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import not_
from typing import TYPE_CHECKING

from tierstore.ghost import DEFAULT_CAPACITY, GhostIndex

if TYPE_CHECKING:
    from tierstore.radix import Segment

log = logging.getLogger(__name__)

REASONS = ("cold", "evicted", "no_checkpoint", "swa_window", "partial_page", "l3_unavailable",
           "no_room")
HIT_TIERS = ("l1", "l2", "l3")
# A promotion status of the store's match loop -> the reason of the pages it cost.
_STATUS_REASON = {"no_room": "no_room", "unavailable": "l3_unavailable", "partial": "evicted"}
_TENANT_MARK = "|"  # tierstore.hashing's {tenant}|{namespace} form of a tenant's namespace

Counts = dict[str, int]


def default_tenant(namespace: str) -> str:
    """The tenant of a store namespace: ``alpha`` for ``alpha|chat``, else ``default``."""
    tenant, mark, _ = namespace.partition(_TENANT_MARK)
    return tenant if mark else "default"


class Explanation:
    """Why a match lost what it lost past its all-tier usable prefix (filled before promotion,
    which may split or prune the nodes the walk saw)."""

    __slots__ = ("evicted_from", "found", "full", "lost", "next_checkpoint")

    def __init__(self, full: int) -> None:
        self.full = full  # pages the hybrid rule allows with every tier counted
        self.found = full  # consecutive pages whose KV some tier holds
        self.lost: Counts = {}
        self.evicted_from: Counts = {}
        self.next_checkpoint = 0  # pages: the nearest checkpoint past ``found`` on the path


def explain(path: Sequence[Segment], keys: Sequence[bytes], full: int, page: int, *,
            state: bool, swa: bool, ghost: GhostIndex) -> Explanation:
    """Reasons for pages ``[full, len(keys))`` of a prompt whose index walk is ``path`` and
    whose deepest usable prefix, counting every tier, is ``full`` pages. Changes nothing."""
    out = Explanation(full)
    lost, evicted = out.lost, out.evicted_from
    n_full = len(keys)
    if full >= n_full:
        return out
    walked = 0
    found = -1  # first page past ``full`` whose KV no tier holds (-1: not yet seen)
    last_ckpt = 0  # deepest checkpointed node end in (full, found]
    segs = []  # (node, first page of it in the prompt, matched pages) past ``full``
    for seg in path:
        start = walked
        walked += seg.pages
        if walked > full:
            segs.append((seg.node, start, seg.pages))
    for node, start, n in segs:
        if found >= 0:
            break
        kv1, kv2, kv3 = node.ids(1, "kv"), node.ids(2, "kv"), node.ids(3, "kv")
        kv4 = node.ids(4, "kv")  # the disk tier
        for j in range(max(0, full - start), n):
            if kv1[j] < 0 and kv2[j] < 0 and kv3[j] < 0 and kv4[j] < 0:
                found = start + j
                break
        else:
            end = start + n
            if state and n == len(node.keys) and end > full and (
                    node.checkpoint(1) >= 0 or node.checkpoint(2) >= 0
                    or node.checkpoint(3) >= 0 or node.checkpoint(4) >= 0):
                last_ckpt = end
    if found < 0:
        found = walked
    out.found = found
    if found > full:
        # Any deeper checkpoint the KV reaches failed only the SWA window (the rule would
        # have taken it otherwise); past the deepest one there is no checkpoint at all.
        if state:
            if last_ckpt:
                lost["swa_window"] = (last_ckpt - full) * page
            if found > max(last_ckpt, full):
                lost["no_checkpoint"] = (found - max(last_ckpt, full)) * page
                tail = segs[-1] if segs else None
                if tail is not None and tail[1] + len(tail[0].keys) > found and (
                        tail[0].checkpoint(1) >= 0 or tail[0].checkpoint(2) >= 0
                        or tail[0].checkpoint(3) >= 0 or tail[0].checkpoint(4) >= 0):
                    out.next_checkpoint = tail[1] + len(tail[0].keys)
        elif swa:
            lost["swa_window"] = (found - full) * page
        else:  # the rule is KV-only: nothing can stop short of the KV
            raise AssertionError(f"KV reaches page {found} but the rule stopped at {full}")
    if found < walked:  # a page the index names that no tier holds: L3 lost it
        _add(lost, "evicted", (walked - found) * page)
        _add(evicted, "l3", (walked - found) * page)
    if walked < n_full:
        # C-level maps over the missing pages (no Python step per page): the young
        # generation first, the old one for what it does not hold.
        young, old = ghost._young, ghost._old
        hs = list(map(hash, keys[walked:]))
        tiers = list(map(young.get, hs, repeat(0)))
        counts = [tiers.count(t) for t in range(5)]  # cold, dropped by l1, l2, l3, disk
        if counts[0] and old:
            older = list(map(old.get, compress(hs, map(not_, tiers)), repeat(0)))
            counts = [older.count(0)] + [c + older.count(t) for t, c in enumerate(counts) if t]
        if counts[0]:
            lost["cold"] = counts[0] * page
        for tier in (1, 2, 3, 4):
            if counts[tier]:
                _add(lost, "evicted", counts[tier] * page)
                _add(evicted, "disk" if tier == 4 else f"l{tier}", counts[tier] * page)
    return out


def settle(why: Explanation, plans: Sequence[tuple[int, str]], served: int, page: int,
           tail: int) -> tuple[Counts, Counts]:
    """Lost tokens by reason (and evicted ones by tier) of a match that served ``served``
    pages: ``why`` past the all-tier prefix, the promotion ``plans`` ((pages planned, status)
    per try, in order) between it and what was served, and ``tail`` tokens past the last full
    page. ``best_effort`` matches plan without L3 first: that gap is ``l3_unavailable``."""
    lost = dict(why.lost)
    evicted = dict(why.evicted_from)
    prev, reason = why.full, "l3_unavailable"
    for planned, status in plans:
        if planned < prev:
            _lose(lost, evicted, reason, (prev - planned) * page)
            prev = planned
        reason = _STATUS_REASON.get(status, reason)
    if served < prev:  # every try was cut short (L3 kept losing pages): nothing was served
        _lose(lost, evicted, reason, (prev - served) * page)
    if tail:
        lost["partial_page"] = tail
    return lost, evicted


def _lose(lost: Counts, evicted: Counts, reason: str, tokens: int) -> None:
    _add(lost, reason, tokens)
    if reason == "evicted":  # L3 no longer held entries the plan counted on
        _add(evicted, "l3", tokens)


def _add(counts: Counts, key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


class Attribution:
    """The store's attribution: the ghost index, totals per (tenant, outcome, tier), and the
    near-zero-hit warning. ``tenant_of`` maps a store namespace to its tenant label."""

    def __init__(self, *, ghost_capacity: int = DEFAULT_CAPACITY, window: int = 256,
                 warn_every_s: float = 300.0,
                 tenant_of: Callable[[str], str] = default_tenant) -> None:
        self.ghost = GhostIndex(ghost_capacity)
        self.tenant_of = tenant_of
        self.totals: dict[tuple[str, str, str], int] = {}
        self.window = window
        self.warn_every_s = warn_every_s
        self.warnings = 0
        self._last_warn = -float("inf")
        self._reset_window()

    def _reset_window(self) -> None:
        self._w_requests = self._w_tokens = self._w_hit = self._w_shared = 0
        self._w_lost: Counts = {}
        self._w_share: list[int] = []  # tokens of cached KV, per no_checkpoint request
        self._w_next: list[int] = []  # nearest checkpoint past it, per such request

    def record(self, namespace: str, tokens: int, hits: Counts, lost: Counts,
               evicted: Counts, why: Explanation, page: int) -> None:
        """Add one match to the totals (``hits`` by tier, ``lost`` by reason, ``evicted``
        by tier) and to the warning window."""
        tenant = self.tenant_of(namespace)
        totals = self.totals
        for tier, n in hits.items():
            if n:
                key = (tenant, "hit", tier)
                totals[key] = totals.get(key, 0) + n
        for reason, n in lost.items():
            if reason != "evicted":
                key = (tenant, reason, "")
                totals[key] = totals.get(key, 0) + n
        for tier, n in evicted.items():
            key = (tenant, "evicted", tier)
            totals[key] = totals.get(key, 0) + n
        self._w_requests += 1
        self._w_tokens += tokens
        hit = sum(hits.values())
        self._w_hit += hit
        self._w_shared += max(hit, why.found * page)
        for reason, n in lost.items():
            self._w_lost[reason] = self._w_lost.get(reason, 0) + n
        if lost.get("no_checkpoint"):
            self._w_share.append(why.found * page)
            self._w_next.append(why.next_checkpoint * page)
        if self._w_requests >= self.window:
            self._check_window()
            self._reset_window()

    def _check_window(self) -> None:
        """Warn (at most every ``warn_every_s``) when under 2% of the window's tokens hit
        although at least 20% had their KV cached: prompts share prefixes the rule cannot use."""
        tokens = self._w_tokens
        if not tokens or self._w_hit > 0.02 * tokens or self._w_shared < 0.2 * tokens:
            return
        now = time.monotonic()
        if now - self._last_warn < self.warn_every_s:
            return
        self._last_warn = now
        self.warnings += 1
        log.warning("%s", self.warning_text())

    def warning_text(self) -> str:
        """The near-zero-hit warning for the current window: the lost-reason histogram and,
        for ``no_checkpoint``, how far the shared KV reaches against the nearest checkpoint."""
        tokens = max(1, self._w_tokens)
        lost = sum(self._w_lost.values()) or 1
        parts = [f"{n / lost:.0%} of lost tokens: {reason}"
                 for reason, n in sorted(self._w_lost.items(), key=lambda kv: -kv[1]) if n]
        if parts and parts[0].endswith("no_checkpoint") and self._w_share:
            share = statistics.median(self._w_share)
            nexts = [n for n in self._w_next if n]
            where = (f"the nearest checkpoint lies at {statistics.median(nexts):,.0f}"
                     if nexts else "no checkpoint lies on the shared prefixes")
            parts[0] += (f" — prompts share a median {share:,.0f} tokens of cached KV, "
                         f"{where}")
        return (f"prefix cache hit {self._w_hit / tokens:.1%} of {self._w_tokens:,} prompt "
                f"tokens over the last {self._w_requests} requests although "
                f"{self._w_shared / tokens:.0%} had their KV cached; " + "; ".join(parts))

    def snapshot(self) -> dict[str, object]:
        """Totals for stats: ``hit`` by tier, ``lost`` by reason, ``evicted_from`` by tier,
        the same per tenant, and the ghost index's size."""
        hit = dict.fromkeys(HIT_TIERS, 0)
        lost = dict.fromkeys(REASONS, 0)
        evicted = dict.fromkeys(HIT_TIERS, 0)
        tenants: dict[str, dict[str, dict[str, int]]] = {}
        for (tenant, outcome, tier), n in self.totals.items():
            t = tenants.setdefault(tenant, {"hit": {}, "lost": {}, "evicted_from": {}})
            if outcome == "hit":
                hit[tier] = hit.get(tier, 0) + n
                _add(t["hit"], tier, n)
            else:
                lost[outcome] += n
                _add(t["lost"], outcome, n)
                if outcome == "evicted":
                    evicted[tier] = evicted.get(tier, 0) + n
                    _add(t["evicted_from"], tier, n)
        return {"hit": hit, "lost": lost, "evicted_from": evicted, "tenants": tenants,
                "ghost": {"entries": len(self.ghost), "capacity": self.ghost.capacity},
                "warnings": self.warnings}


def match_fields(lost: Counts, evicted_from: Counts) -> dict[str, Counts]:
    """The optional fields a match reply carries: ``lost`` tokens by reason and
    ``evicted_from`` by tier (with the reply's ``tiers``, they sum to the prompt length)."""
    return {"lost": dict(lost), "evicted_from": dict(evicted_from)}
