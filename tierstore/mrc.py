"""Miss-ratio curves per tier: what 0.5x-4x of each tier's bytes would hit.

A SHARDS-sampled shadow (Waldspurger et al., FAST '15) of the store's eviction order: page keys
whose hash falls under a threshold (rate ``R``) are kept in a byte-weighted LRU stack; a
reference's stack distance is the bytes of sampled pages used since, divided by ``R``. When
more than ``max_tracked`` pages are sampled the threshold halves and the pages above it leave
(fixed-size SHARDS), so memory and per-request work stay bounded; every sample is weighted by
``1/R`` of its moment, which keeps the estimate unbiased across rate changes.

The hybrid rule in the shadow: a prompt is served up to a *candidate end* (a page end where a
checkpoint was inserted, for models with recurrent state; every page end otherwise), and a
prefix is resident when its deepest page is: a match or an insert uses a whole path, deepest
page first, so its distance bounds its ancestors'. Hit tokens at size ``C`` are then
``sum over candidates c of (c - previous candidate) * page * [distance(c) <= C]`` — additive,
so sampling candidates by their page's hash estimates it. Page objects weigh their KV (and SWA)
bytes, a candidate end adds the checkpoint (and, under SWA window retention, the window).

Tiers are read as one LRU hierarchy: L1 holds the most recent ``C1`` bytes, L2 the next
``C2``, L3 the next ``C3``. A tier's curve at ``m`` times its size is ``H(above + m*C) -
H(above)``, ``above`` being the bytes of the tiers over it. KV, SWA and state entries are
counted separately as well (the share of referenced entries of each kind a size would hold).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierstore.config import StoreConfig
    from tierstore.layout import ModelLayout

MULTIPLES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
_SPACE = 1 << 32  # sampling is on the low 32 bits of the key's hash
DEFAULT_MAX_TRACKED = 16_384
# Pages start sampled at 1/16 (candidate ends at 1): on the shipped trace that is within
# 0.9 points of the unsampled curve, at a sixteenth of the per-page work.
DEFAULT_RATE = 1 / 16


class _Fenwick:
    """Prefix sums of (weighted) byte sizes over time slots."""

    __slots__ = ("n", "tree")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0.0] * (n + 1)

    def add(self, i: int, delta: float) -> None:
        i += 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> float:
        """Sum of slots ``[0, i)``."""
        tree = self.tree
        total = 0.0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


class Shadow:
    """The sampled shadow of one store. ``capacities`` are the tiers' bytes (``l1``, ``l2``,
    ``l3``; None: unbounded or absent); ``units`` the envelope bytes per kind."""

    def __init__(self, capacities: Mapping[str, int | None], units: Mapping[str, int],
                 page_size: int, *, swa_window_pages: int = 0, swa_window_only: bool = False,
                 rate: float = DEFAULT_RATE, max_tracked: int = DEFAULT_MAX_TRACKED,
                 multiples: Sequence[float] = MULTIPLES, unbounded_below: bool = False
                 ) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
        if max_tracked < 16:
            raise ValueError(f"max_tracked must be >= 16, got {max_tracked}")
        self.page_size = page_size
        self.state = "state" in units
        self.multiples = tuple(multiples)
        self.capacities = {t: c for t, c in capacities.items() if c}
        # An unbounded last tier (an L3 of unknown size) serves whatever the others miss: the
        # whole cache's hit rate is then the unbounded one whatever a tier's size.
        self.unbounded_below = unbounded_below
        # Two thresholds: ordinary pages, and candidate ends (pages a checkpoint follows).
        # Ends are few and carry each prefix's hit tokens, so they are sampled apart (all of
        # them until there are ``max_tracked``): sampling them with the pages would let a few
        # heavily shared prefixes swing the estimate by whole points.
        self.threshold = int(rate * _SPACE)
        self.end_threshold = _SPACE
        self.max_tracked = max_tracked
        window = swa_window_pages if swa_window_only else 0
        self.page_bytes = units["kv"] + (units.get("swa", 0) if not window else 0)
        self.end_bytes = units.get("state", 0) + window * units.get("swa", 0)
        self.kinds = [k for k in ("kv", "swa", "state") if k in units]
        # Tracked pages: hash -> [slot, bytes, is_end]; slot order is recency (higher: more
        # recent). The tree holds bytes / rate per slot: distances come out unscaled.
        self._pages: dict[int, list[int]] = {}
        self._num_ends = 0
        self._slots = 4 * max_tracked + 64
        self._tree = _Fenwick(self._slots)
        self._clock = 0
        self._ends: dict[int, None] = {}  # candidate ends: hashes of pages a checkpoint follows
        self._old_ends: dict[int, None] = {}
        self.edges = self._edges()
        self._hist = [0.0] * (len(self.edges) + 1)  # hit tokens by distance bin, weighted
        self._kind_hist = {k: [0.0] * (len(self.edges) + 1) for k in self.kinds}
        self._kind_refs = dict.fromkeys(self.kinds, 0.0)
        self.tokens = 0  # prompt tokens referenced (exact, not sampled)
        self.requests = 0

    # ------------------------------------------------------------------ events
    @property
    def rate(self) -> float:
        """The sampling rate of ordinary pages."""
        return self.threshold / _SPACE

    @property
    def end_rate(self) -> float:
        """The sampling rate of candidate ends."""
        return self.end_threshold / _SPACE

    def _weight(self, is_end: bool) -> float:
        return _SPACE / (self.end_threshold if is_end else self.threshold)

    def _sampled(self, h: int, is_end: bool) -> bool:
        if is_end:
            return ((h >> 32) & 0xFFFFFFFF) < self.end_threshold
        return (h & 0xFFFFFFFF) < self.threshold

    def _is_end(self, h: int) -> bool:
        return self.state and (h in self._ends or h in self._old_ends)

    def insert(self, keys: Sequence[bytes], checkpoint: bool) -> None:
        """An insert of a prompt's full pages (``keys``), with a checkpoint at its end."""
        if not keys:
            return
        if checkpoint and self.state:
            h = hash(keys[-1])
            if not self._is_end(h):
                self._ends[h] = None
                if len(self._ends) >= 4 * self.max_tracked:  # two generations, as the ghost
                    self._old_ends, self._ends = self._ends, {}
                obj = self._pages.pop(h, None)
                if obj is not None:  # a tracked page becomes an end: tracked anew below
                    self._untrack(obj)
        hs = [hash(k) for k in keys]
        self._touch(hs, self._flags(hs), create=True)

    def _flags(self, hs: list[int]) -> list[bool]:
        """Which of the hashed pages a checkpoint follows (every page without state)."""
        if not self.state:
            return [True] * len(hs)
        ends, old = self._ends, self._old_ends
        return [h in ends or h in old for h in hs]

    def _sampled_at(self, hs: list[int], flags: list[bool]) -> list[int]:
        """Positions of the pages the sample covers (as pages, or as candidate ends)."""
        thr, ethr = self.threshold, self.end_threshold
        if not self.state:
            return [i for i, h in enumerate(hs) if (h & 0xFFFFFFFF) < thr]
        return [i for i, h in enumerate(hs)
                if (((h >> 32) & 0xFFFFFFFF) < ethr if flags[i] else (h & 0xFFFFFFFF) < thr)]

    def reference(self, keys: Sequence[bytes], n_tokens: int) -> None:
        """A match of ``n_tokens`` tokens whose full pages are ``keys``: record where each
        candidate end's distance puts it, then use the path an unbounded cache would serve."""
        self.tokens += n_tokens
        self.requests += 1
        if not keys:
            return
        hs = [hash(k) for k in keys]
        flags = self._flags(hs)
        ends = [i for i, f in enumerate(flags) if f]
        if not ends:
            return
        pages, page, state = self._pages, self.page_size, self.state
        tree = self._tree
        top = tree.prefix(self._slots)
        edges, hist = self.edges, self._hist
        kinds, refs = self._kind_hist, self._kind_refs
        for i in self._sampled_at(hs, flags):
            obj = pages.get(hs[i])
            if obj is None:
                continue
            is_end = flags[i] if state else False
            dist = top - tree.prefix(obj[0])  # its bytes and all more recent
            weight = self._weight(is_end)
            b = bisect.bisect_left(edges, dist)
            if flags[i]:  # a candidate: the tokens since the previous one hit at this size
                k = bisect.bisect_left(ends, i)
                prev = ends[k - 1] + 1 if k else 0
                hist[b] += (i + 1 - prev) * page * weight
            for kind in ("kv", "swa", "state") if is_end else ("kv", "swa"):
                if kind in kinds:
                    kinds[kind][b] += weight
                    refs[kind] += weight
        self._touch(hs[: ends[-1] + 1], flags, create=False)

    def _touch(self, hs: list[int], flags: list[bool], *, create: bool) -> None:
        """Move the tracked pages among ``hs`` to the top, deepest first (so it is the least
        recent of them); with ``create``, sampled pages not yet tracked join."""
        pages, tree = self._pages, self._tree
        for i in reversed(self._sampled_at(hs, flags)):
            h = hs[i]
            obj = pages.get(h)
            if obj is None:
                if not create:
                    continue
                is_end = self.state and flags[i]
                obj = pages[h] = [-1, self.page_bytes + (self.end_bytes if is_end else 0),
                                  int(is_end)]
                self._num_ends += is_end
            weighted = obj[1] * self._weight(bool(obj[2]))
            if obj[0] >= 0:
                tree.add(obj[0], -weighted)
            if self._clock >= self._slots:
                self._compact()
                tree = self._tree
            obj[0] = self._clock
            tree.add(self._clock, weighted)
            self._clock += 1
        if len(pages) - self._num_ends > self.max_tracked or self._num_ends > self.max_tracked:
            self._lower_rate()

    def _untrack(self, obj: list[int]) -> None:
        if obj[0] >= 0:
            self._tree.add(obj[0], -obj[1] * self._weight(bool(obj[2])))
        self._num_ends -= obj[2]

    def _compact(self) -> None:
        """Renumber the live slots 0..n-1 in recency order, at the current weights (slots ran
        out, or a rate changed)."""
        live = sorted((obj[0], h) for h, obj in self._pages.items() if obj[0] >= 0)
        self._tree = _Fenwick(self._slots)
        for slot, (_, h) in enumerate(live):
            obj = self._pages[h]
            obj[0] = slot
            self._tree.add(slot, obj[1] * self._weight(bool(obj[2])))
        self._clock = len(live)

    def _lower_rate(self) -> None:
        """Halve a rate until at most ``max_tracked`` pages (and ends) are tracked
        (fixed-size SHARDS); the survivors weigh twice as much from now on."""
        while len(self._pages) - self._num_ends > self.max_tracked and self.threshold > 1:
            self.threshold //= 2
            self._drop(lambda h, obj: not obj[2] and not self._sampled(h, False))
        while self._num_ends > self.max_tracked and self.end_threshold > 1:
            self.end_threshold //= 2
            self._drop(lambda h, obj: bool(obj[2]) and not self._sampled(h, True))
        self._compact()

    def _drop(self, gone: Callable[[int, list[int]], bool]) -> None:
        for h in [h for h, obj in self._pages.items() if gone(h, obj)]:
            self._num_ends -= self._pages.pop(h)[2]

    # ------------------------------------------------------------------ curves
    def _edges(self) -> list[float]:
        """The byte sizes the curves are read at: every tier's ``above + m * C``."""
        edges: set[float] = set()
        above = 0
        caps = [self.capacities[t] for t in ("l1", "l2", "l3") if t in self.capacities]
        everything = sum(caps)
        for cap in caps:
            edges.update(above + m * cap for m in self.multiples)
            edges.update(everything + (m - 1) * cap for m in self.multiples)  # totals
            edges.add(above)
            above += cap
        return sorted(edges)

    def _cum(self, hist: list[float], size: float) -> float:
        """Weighted mass at distances <= ``size`` (``size`` is one of the edges)."""
        return sum(hist[: bisect.bisect_left(self.edges, size) + 1])

    def curves(self) -> dict[str, object]:
        """Per tier: its bytes, the multiples, the estimated share of prompt tokens it would
        serve at each (``hit_rate``), the whole cache's hit rate then (``total_hit_rate``,
        the tiers below kept as they are), and per kind the share of referenced entries it
        would hold. Plus the sampling state."""
        tokens = self.tokens or 1
        out: dict[str, object] = {}
        above = 0
        caps = [(t, self.capacities[t]) for t in ("l1", "l2", "l3") if t in self.capacities]
        all_bytes = sum(c for _, c in caps)
        for tier, cap in caps:
            base = self._cum(self._hist, above)
            hit, total, kinds = [], [], {}
            for m in self.multiples:
                size = above + m * cap
                hit.append((self._cum(self._hist, size) - base) / tokens)
                total.append((sum(self._hist) if self.unbounded_below else
                              self._cum(self._hist, all_bytes + (m - 1) * cap)) / tokens)
            for kind in self.kinds:
                refs = self._kind_refs[kind] or 1.0
                h = self._kind_hist[kind]
                b = self._cum(h, above)
                kinds[kind] = [(self._cum(h, above + m * cap) - b) / refs
                               for m in self.multiples]
            out[tier] = {"capacity_bytes": cap, "hit_rate": hit, "total_hit_rate": total,
                         "entries": kinds}
            above += cap
        return {"multiples": list(self.multiples), "tiers": out,
                "sampling": {"rate": self.rate, "end_rate": self.end_rate,
                             "tracked_pages": len(self._pages) - self._num_ends,
                             "tracked_ends": self._num_ends, "max_tracked": self.max_tracked,
                             "requests": self.requests, "tokens": self.tokens}}


def shadow_for(config: StoreConfig, layout: ModelLayout, *, swa_window_only: bool,
               l3_bytes: int | None = None, **kwargs: object) -> Shadow:
    """A shadow of a store's tiers (its ``config`` and ``layout``): L1 and L2 at their
    configured bytes, L3 at ``l3_bytes`` (None: no L3 curve, and an L3 counts as unbounded; the
    store cannot know Redis's memory limit)."""
    units = {k: e.nbytes for k, e in layout.envelopes().items()}
    capacities = {"l1": config.capacity_bytes, "l2": config.host_capacity_bytes or None,
                  "l3": l3_bytes if config.remote is not None else None}
    return Shadow(capacities, units, layout.page_size,
                  swa_window_pages=layout.swa_window_pages(),
                  swa_window_only=swa_window_only,
                  unbounded_below=config.remote is not None and l3_bytes is None,
                  **kwargs)  # type: ignore[arg-type]
