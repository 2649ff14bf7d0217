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
tail is ``partial_page``. :class:`Attribution` keeps the store's totals (plain ints per
namespace, folded into tenants and labels only when read) and warns when the cache serves
~nothing although prompts share cached prefixes. :class:`NoAttribution` is the store's part
when attribution is switched off (``StoreConfig.attribution``): it does nothing, at no cost
per request.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from tierstore.ghost import DEFAULT_CAPACITY, Ghost, GhostIndex
from tierstore.held import Held
from tierstore.native import load

if TYPE_CHECKING:
    from tierstore.layout import ModelLayout
    from tierstore.radix import Node, Segment

log = logging.getLogger(__name__)

REASONS = ("cold", "evicted", "no_checkpoint", "swa_window", "partial_page", "l3_unavailable",
           "no_room")
HIT_TIERS = ("l1", "l2", "l3")
_TIERS = ("", "l1", "l2", "l3", "disk")  # by tier number (tierstore.radix.Tier)
# A promotion status of the store's match loop -> the reason of the pages it cost.
_STATUS_REASON = {"no_room": "no_room", "unavailable": "l3_unavailable", "partial": "evicted"}
_TENANT_MARK = "|"  # tierstore.hashing's {tenant}|{namespace} form of a tenant's namespace
# Slots of a namespace's counters: hits by tier number (0 unused), losses by reason, evicted
# tokens by the tier that dropped them last.
_LOST = {r: 5 + i for i, r in enumerate(REASONS)}
_EVICTED = {t: 5 + len(REASONS) + i for i, t in enumerate(_TIERS[1:])}
_SLOTS = 5 + len(REASONS) + 4
_COLD, _PARTIAL = _LOST["cold"], _LOST["partial_page"]

Counts = dict[str, int]
PlanList = Sequence[tuple[int, str]]


def _tally_loops(c: list[int], sources: dict[int, int], lost: Counts, evicted: Counts
                 ) -> None:
    """Add a match's pages by tier (slot = tier number), lost tokens by reason and evicted
    ones by tier into a namespace's slots (the compiled ``tally`` does it in one call)."""
    for tier, n in sources.items():
        c[tier] += n
    for r, n in lost.items():
        c[_LOST[r]] += n
    for t, n in evicted.items():
        c[_EVICTED[t]] += n


_c = load("tierstore._c_ghost")


def _tally_slots(lost_slots: dict[str, int], evicted_slots: dict[str, int], c: list[int],
                 sources: dict[int, int], lost: Counts, evicted: Counts) -> None:
    """The compiled ``tally``'s signature over :func:`_tally_loops` (the slot maps are
    this module's)."""
    _tally_loops(c, sources, lost, evicted)


# Called with the slot maps spelled out: a ``functools.partial`` of six arguments allocated
# its argument array per call (past CPython's small stack of five).
_tally: Callable[[dict[str, int], dict[str, int], list[int], dict[int, int], Counts, Counts],
                 None] = _c.tally if _c is not None else _tally_slots


def default_tenant(namespace: str) -> str:
    """The tenant of a store namespace: ``alpha`` for ``alpha|chat``, else ``default``."""
    tenant, mark, _ = namespace.partition(_TENANT_MARK)
    return tenant if mark else "default"


# Why a match lost what it lost past its all-tier usable prefix (filled before promotion, which
# may split or prune the nodes the walk saw): a plain list, built in one step per match (no
# object and no __init__ frame per request), read by index:
# [full: pages the hybrid rule allows with every tier counted,
#  found: consecutive pages whose KV some tier holds,
#  lost: tokens by reason, evicted_from: evicted tokens by tier,
#  next_checkpoint: pages, the nearest checkpoint past ``found`` on the path].
Explanation: TypeAlias = list[Any]
FULL, FOUND, LOST, EVICTED_FROM, NEXT_CHECKPOINT = range(5)


def explanation(full: int) -> Explanation:
    """An explanation with nothing lost yet: ``full`` pages usable, and found."""
    return [full, full, {}, {}, 0]


def _has_checkpoint(node: Node) -> bool:
    """Some tier holds the state checkpoint at the node's end."""
    ck = node.checkpoint
    return ck(1) >= 0 or ck(2) >= 0 or ck(3) >= 0 or ck(4) >= 0


def _add(counts: Counts, key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


class Attribution:
    """The store's attribution for one model ``layout``: explains and settles each match,
    keeps the ghost index (its :attr:`on_drop` hears of dropped pages), totals per (tenant,
    outcome, tier), and the near-zero-hit warning. ``tenant_of`` maps a store namespace to
    its tenant label."""

    enabled = True

    def __init__(self, layout: ModelLayout, *, ghost_capacity: int = DEFAULT_CAPACITY,
                 window: int = 256, warn_every_s: float = 300.0,
                 tenant_of: Callable[[str], str] = default_tenant) -> None:
        self.page = layout.page_size
        self.state = layout.state is not None
        self.swa = layout.swa is not None
        self.ghost: Ghost = GhostIndex(ghost_capacity)
        self.on_drop: Callable[[list[bytes], int], None] | None = self.ghost.add
        self.tenant_of = tenant_of
        self._counts: dict[str, list[int]] = {}  # namespace -> slots (see _SLOTS)
        # The usual match (L1 serves it whole) is counted in one call; it holds the warning
        # window's match and cached-KV counts, which settle adds to as well.
        self._w = Held(self.ghost, self._counts, self.page, (_SLOTS, 1, _COLD, _PARTIAL),
                       self._settle_spelled_out, self._window_full, window)
        # (settle_held: the store's call; an instance attribute, so no Python frame is made)
        self.settle_held: Callable[..., tuple[Counts, Counts]] = self._w.settle
        self.warn_every_s = warn_every_s
        self.warnings = 0
        self._last_warn = -float("inf")
        self._reset_window()

    @property
    def window(self) -> int:
        """Matches the near-zero-hit check looks back over."""
        return self._w.window

    @window.setter
    def window(self, matches: int) -> None:
        if matches < 1:
            raise ValueError(f"window must be >= 1 matches, got {matches}")
        self._w.window = matches

    # ------------------------------------------------------------------ per match
    def explain(self, path: Sequence[Segment], keys: Sequence[bytes], full: int
                ) -> Explanation:
        """Reasons for pages ``[full, len(keys))`` of a prompt whose index walk is ``path`` and
        whose deepest usable prefix, counting every tier, is ``full`` pages. Changes nothing."""
        n_full = len(keys)
        if full >= n_full:
            return [full, full, {}, {}, 0]
        last = path[-1] if path else None  # a walk's segments are contiguous from the root:
        walked = last.node.depth + last.pages if last is not None else 0  # it ends there
        if walked == full:  # the index names nothing past the usable prefix (the usual)
            if keys[walked] not in self.ghost:  # a new prompt's tail (see _unknown)
                return [full, full, {"cold": (n_full - walked) * self.page}, {}, 0]
            out: Explanation = [full, full, {}, {}, 0]
            self._unknown(out, keys, walked)
            return out
        out = [full, full, {}, {}, 0]
        if walked > full:  # the index knows pages past the usable prefix: why not usable
            self._beyond(out, path, walked)
        if walked < n_full:
            if keys[walked] in self.ghost:
                self._unknown(out, keys, walked)
            else:
                out[LOST]["cold"] = (n_full - walked) * self.page
        return out

    def _beyond(self, out: Explanation, path: Sequence[Segment], walked: int) -> None:
        """The reasons of pages ``[out[FULL], walked)``, which the index names."""
        full, page, lost = out[FULL], self.page, out[LOST]
        found = -1  # first page past ``full`` whose KV no tier holds (-1: not yet seen)
        last_ckpt = 0  # deepest checkpointed node end in (full, found]
        segs = []  # (node, first page of it in the prompt, matched pages) past ``full``
        start = 0
        for seg in path:
            if start + seg.pages > full:
                segs.append((seg.node, start, seg.pages))
            start += seg.pages
        for node, start, n in segs:
            # (Node.ids / Node.checkpoint of every tier, read without their calls)
            p1, p2, p3, p4 = node._pages  # the disk tier last
            kv1, first = p1["kv"], max(0, full - start)
            if first >= n or min(kv1[first:n]) < 0:  # (usually L1 holds all: one C-level min)
                kv2, kv3, kv4 = p2["kv"], p3["kv"], p4["kv"]
                for j in range(first, n):
                    if kv1[j] < 0 and kv2[j] < 0 and kv3[j] < 0 and kv4[j] < 0:
                        found = start + j
                        break
                else:
                    if self.state and n == len(node.keys) and max(node._state) >= 0:
                        last_ckpt = start + n
                    continue
                break
            if self.state and n == len(node.keys) and max(node._state) >= 0:
                last_ckpt = start + n
        if found < 0:
            found = walked
        out[FOUND] = found
        if found > full:
            # Any deeper checkpoint the KV reaches failed only the SWA window (the rule would
            # have taken it otherwise); past the deepest one there is no checkpoint at all.
            if self.state:
                if last_ckpt:
                    lost["swa_window"] = (last_ckpt - full) * page
                if found > max(last_ckpt, full):
                    lost["no_checkpoint"] = (found - max(last_ckpt, full)) * page
                    node, start, _ = segs[-1]
                    if start + len(node.keys) > found and _has_checkpoint(node):
                        out[NEXT_CHECKPOINT] = start + len(node.keys)
            elif self.swa:
                lost["swa_window"] = (found - full) * page
            else:  # the rule is KV-only: nothing can stop short of the KV
                raise AssertionError(f"KV reaches page {found} but the rule stopped at {full}")
        if found < walked:  # a page the index names that no tier holds: L3 lost it
            _add(lost, "evicted", (walked - found) * page)
            _add(out[EVICTED_FROM], "l3", (walked - found) * page)

    def _unknown(self, out: Explanation, keys: Sequence[bytes], walked: int) -> None:
        """The reasons of pages past the index's walk, some of which the ghost remembers:
        evicted (by the tier that dropped them last) or cold; the ghost counts them in one call.
        Remembered pages are a prefix of them: page keys are chained, so a page is cached only
        under its parent and dropped no later than it (nodes are pruned deepest first, a node's
        pages all at once), and the ghost forgets in the order it heard. So when the first
        missing page is not remembered (a new prompt's tail: the usual case), none is, and
        :meth:`explain` settles them with that one lookup instead of calling this."""
        page = self.page
        counts = self.ghost.counts(keys, walked)  # cold, dropped by l1, l2, l3, disk
        lost, evicted = out[LOST], out[EVICTED_FROM]
        if counts[0]:
            lost["cold"] = counts[0] * page
        for tier in (1, 2, 3, 4):
            if counts[tier]:
                _add(lost, "evicted", counts[tier] * page)
                _add(evicted, _TIERS[tier], counts[tier] * page)

    def _settle_spelled_out(self, namespace: str, n_tokens: int, keys: Sequence[bytes],
                            path: Sequence[Segment], pages: int, sources: dict[int, int]
                            ) -> tuple[Counts, Counts]:
        """:meth:`explain` and :meth:`settle` of a match whose index walk ``path`` L1 holds
        whole (:func:`tierstore.rule.held_in_l1`): its ``pages`` pages, the prefix the rule
        allows counting every tier too, served from L1 with nothing to promote. The store calls
        :attr:`settle_held` (:mod:`tierstore.held`), which counts the usual case itself (the
        ghost does not remember the page after the prefix: all past it is ``cold``) and hands
        this the rest."""
        return self.settle(namespace, n_tokens, len(keys), self.explain(path, keys, pages),
                           [(pages, "ok")], pages, sources)

    def settle(self, namespace: str, n_tokens: int, n_pages: int, why: Explanation,
               plans: PlanList, served: int, sources: dict[int, int]) -> tuple[Counts, Counts]:
        """Lost tokens by reason (and evicted ones by tier) of a match of ``n_tokens`` tokens
        (``n_pages`` full pages) that served ``served`` pages from ``sources`` (pages by tier
        number): ``why`` past the all-tier prefix, the promotion ``plans`` ((pages planned,
        status) per try, in order) between it and what was served, and the tail past the
        last full page. ``best_effort`` matches plan without L3 first: that gap is
        ``l3_unavailable``. Counted in the totals; takes ``why``'s dicts as the result."""
        full, found, lost, evicted, next_checkpoint = why
        if served != full or len(plans) > 1:  # a try fell short of the all-tier prefix
            self._short(lost, evicted, full, plans, served)
        tail = n_tokens - n_pages * self.page
        if tail:
            lost["partial_page"] = tail
        # The totals: plain ints per namespace (hits in pages; labels are built when read).
        c = self._counts.get(namespace)
        if c is None:
            c = self._counts[namespace] = [0] * _SLOTS
        _tally(_LOST, _EVICTED, c, sources, lost, evicted)
        # the KV some tier holds reaches at least as far as what was served
        w = self._w
        w.shared += found if found > served else served
        if "no_checkpoint" in lost:
            self._w_share.append(found * self.page)
            self._w_next.append(next_checkpoint * self.page)
        w.requests += 1
        if w.requests >= w.window:
            self._window_full()
        return lost, evicted

    def _short(self, lost: Counts, evicted: Counts, full: int, plans: PlanList,
               served: int) -> None:
        """The pages between the all-tier prefix (``full``) and what was served, by the
        status of the promotion try that gave them up."""
        page = self.page
        prev, reason = full, "l3_unavailable"
        for planned, status in plans:
            if planned < prev:
                self._lose(lost, evicted, reason, (prev - planned) * page)
                prev = planned
            reason = _STATUS_REASON.get(status, reason)
        if served < prev:  # every try was cut short (L3 kept losing pages): nothing was served
            self._lose(lost, evicted, reason, (prev - served) * page)

    @staticmethod
    def _lose(lost: Counts, evicted: Counts, reason: str, tokens: int) -> None:
        _add(lost, reason, tokens)
        if reason == "evicted":  # L3 no longer held entries the plan counted on
            _add(evicted, "l3", tokens)

    # ------------------------------------------------------------------ the warning
    def _sums(self) -> list[int]:
        """Every namespace's slots added up."""
        out = [0] * _SLOTS
        for c in self._counts.values():
            out = [a + b for a, b in zip(out, c, strict=True)]
        return out

    def _window_full(self) -> None:
        self._check_window()
        self._reset_window()

    def _reset_window(self) -> None:
        self._w.requests = self._w.shared = 0  # shared: pages of cached KV
        self._w_base = self._sums()  # the totals when the window began
        self._w_share: list[int] = []  # tokens of cached KV, per no_checkpoint request
        self._w_next: list[int] = []  # nearest checkpoint past it, per such request

    def _window(self) -> tuple[int, int, Counts]:
        """The current window's prompt tokens, hit tokens and lost tokens by reason."""
        now = [a - b for a, b in zip(self._sums(), self._w_base, strict=True)]
        hit = sum(now[1:5]) * self.page
        lost = {r: now[i] for r, i in _LOST.items() if now[i]}
        return hit + sum(lost.values()), hit, lost

    def _check_window(self) -> None:
        """Warn (at most every ``warn_every_s``) when under 2% of the window's tokens hit
        although at least 20% had their KV cached: prompts share prefixes the rule cannot use."""
        tokens, hit, _ = self._window()
        if not tokens or hit > 0.02 * tokens or self._w.shared * self.page < 0.2 * tokens:
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
        tokens, hit, by_reason = self._window()
        lost = sum(by_reason.values()) or 1
        parts = [f"{n / lost:.0%} of lost tokens: {reason}"
                 for reason, n in sorted(by_reason.items(), key=lambda kv: -kv[1])]
        if parts and parts[0].endswith("no_checkpoint") and self._w_share:
            share = statistics.median(self._w_share)
            nexts = [n for n in self._w_next if n]
            where = (f"the nearest checkpoint lies at {statistics.median(nexts):,.0f}"
                     if nexts else "no checkpoint lies on the shared prefixes")
            parts[0] += (f" — prompts share a median {share:,.0f} tokens of cached KV, "
                         f"{where}")
        return (f"prefix cache hit {hit / max(1, tokens):.1%} of {tokens:,} prompt "
                f"tokens over the last {self._w.requests} requests although "
                f"{self._w.shared * self.page / max(1, tokens):.0%} had their KV cached; "
                + "; ".join(parts))

    # ------------------------------------------------------------------ reading
    @property
    def totals(self) -> dict[tuple[str, str, str], int]:
        """Tokens per (tenant, outcome, tier): outcome ``hit`` by tier, a reason (tier ``""``)
        or ``evicted`` by the tier that dropped them last; zeros left out."""
        out: dict[tuple[str, str, str], int] = {}
        for namespace, c in self._counts.items():
            tenant = self.tenant_of(namespace)
            items = [((tenant, "hit", _TIERS[t]), c[t] * self.page) for t in range(1, 5)]
            items += [((tenant, r, ""), c[i]) for r, i in _LOST.items() if r != "evicted"]
            items += [((tenant, "evicted", t), c[i]) for t, i in _EVICTED.items()]
            for key, n in items:
                if n:
                    out[key] = out.get(key, 0) + n
        return out

    def snapshot(self) -> dict[str, object] | None:
        """Totals for stats: ``hit`` by tier, ``lost`` by reason, ``evicted_from`` by tier,
        the same per tenant, and the ghost index's size."""
        hit = dict.fromkeys(HIT_TIERS, 0)
        lost = dict.fromkeys(REASONS, 0)
        evicted = dict.fromkeys(HIT_TIERS, 0)
        tenants: dict[str, dict[str, dict[str, int]]] = {}
        for (tenant, outcome, tier), n in self.totals.items():
            t = tenants.setdefault(tenant, {"hit": {}, "lost": {}, "evicted_from": {}})
            if outcome == "hit":
                _add(hit, tier, n)
                _add(t["hit"], tier, n)
            else:
                lost[outcome] += n
                _add(t["lost"], outcome, n)
                if outcome == "evicted":
                    _add(evicted, tier, n)
                    _add(t["evicted_from"], tier, n)
        return {"hit": hit, "lost": lost, "evicted_from": evicted, "tenants": tenants,
                "ghost": {"entries": len(self.ghost), "capacity": self.ghost.capacity},
                "warnings": self.warnings}


class NoAttribution:
    """Attribution switched off: matches carry no ``lost`` split, stats no totals, and no
    ghost index hears of drops. Every call is a constant."""

    enabled = False
    on_drop = None
    warnings = 0
    _NONE = explanation(0)

    def explain(self, path: Sequence[Segment], keys: Sequence[bytes], full: int
                ) -> Explanation:
        return self._NONE

    def settle(self, namespace: str, n_tokens: int, n_pages: int, why: Explanation,
               plans: PlanList, served: int, sources: dict[int, int]) -> tuple[Counts, Counts]:
        return {}, {}

    def settle_held(self, namespace: str, n_tokens: int, keys: Sequence[bytes],
                    path: Sequence[Segment], pages: int, sources: dict[int, int]
                    ) -> tuple[Counts, Counts]:
        return {}, {}

    def snapshot(self) -> None:
        return None


def attribution_for(layout: ModelLayout, enabled: bool) -> Attribution | NoAttribution:
    """A store's attribution: the real one, or the null one when switched off."""
    return Attribution(layout) if enabled else NoAttribution()


def match_fields(lost: Counts, evicted_from: Counts) -> dict[str, Counts]:
    """The optional fields a match reply carries: ``lost`` tokens by reason and
    ``evicted_from`` by tier (with the reply's ``tiers``, they sum to the prompt length)."""
    return {"lost": dict(lost), "evicted_from": dict(evicted_from)}
