"""Miss-ratio curves per tier: what 0.5x-4x of each tier's bytes would hit.

A SHARDS-sampled shadow (Waldspurger et al., FAST '15) of the store's eviction order: page keys
(uniform hash outputs) whose first 32 bits fall under a threshold (rate ``R``) are kept in a
byte-weighted LRU stack; a reference's stack distance is the bytes of sampled pages used since,
divided by ``R``. No curve reads past its last size (4x every tier, by default), so a page
deeper than that counts as untracked (a miss at every size) and is dropped (``mrc_stack.trim``;
at 2k cached pages ~1.5k tracked instead of 16k pages and 16k ends). When still more than
``max_tracked`` pages are sampled the threshold halves and the pages above it leave
(fixed-size SHARDS), so memory and per-request work stay bounded; every sample is weighted by
``1/R`` of its moment, which keeps the estimate unbiased across rate changes.

The hybrid rule in the shadow: a prompt is served up to a *candidate end* (a page end where a
checkpoint was inserted, for models with recurrent state; every page end otherwise), and a
prefix is resident when its deepest page is: a match or an insert uses a whole path, deepest
page first, so its distance bounds its ancestors'. Hit tokens at size ``C`` are then
``sum over candidates c of (c - previous candidate) * page * [distance(c) <= C]`` — additive,
so sampling candidates by their page key estimates it. Page objects weigh their KV (and SWA)
bytes, a candidate end adds the checkpoint (and, under SWA window retention, the window).

L1 holds the most recent ``C1`` bytes: its curve is ``H(m * C1)``. L2 keeps a copy of what it
promotes into L1, so an L2 of ``m*C2`` bytes serves what lies within ``C1 + m*C2 - D_m``,
``D_m`` the bytes of L1's pages it holds copies of at that size, measured per multiple
(:mod:`tierstore.mrc_stack`). L3 is read as the next ``C3`` bytes past ``C1 + C2``. KV, SWA
and state entries are counted apart too (the share of the sampled entries referenced, first
references included, that a size would hold).
The per-event loops are compiled (``tierstore/_c_mrc.c``), with the same results.

Events are queued and played :data:`BATCH` at a time (and before curves are read): in one pass
the shadow's tables stay in cache; between the store's own work each request's few probes
missed it (``bench ops``, qwen3-next at 2k pages: the shadow's ~44 us a request -> ~36).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

from tierstore import mrc_curves, mrc_loops, mrc_stack
from tierstore.mrc_loops import SPACE as _SPACE
from tierstore.mrc_loops import end_sampled as _end_sampled
from tierstore.mrc_stack import Slots as _Slots
from tierstore.native import load

if TYPE_CHECKING:
    from tierstore.config import StoreConfig
    from tierstore.layout import ModelLayout

# The per-event loops compiled (scan, a match's reads, a touch without an L2 overlap); None:
# the pure-Python loops (:mod:`tierstore.mrc_loops`), the same curves to the bit (tested).
_C = load("tierstore._c_mrc")
_mark_end = _C.mark_end if _C is not None else mrc_loops.mark_end  # (mrc_loops.END_BITS)
# The whole shadow in C (tierstore/_c_play.c): its tables and its event loop, for a shadow with
# no L1/L2 overlap to keep; None: the Python event loop above. The same curves to the bit
# (tests/tierstore/test_mrc_play.py).
_P = load("tierstore._c_play")
_KINDS = ("kv", "swa", "state")

MULTIPLES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
# A page is sampled when its key sorts below the threshold's 4 bytes (``mrc_loops.SPACE``),
# one C-level bytes comparison per page and no hashing pass.
_ALL = b"\xff" * 64  # sorts above every key: rate 1
DEFAULT_MAX_TRACKED = 16_384
# Pages start sampled at 1/16 (candidate ends at 1): on the shipped trace that is within
# 0.9 points of the unsampled curve, at a sixteenth of the per-page work.
DEFAULT_RATE = 1 / 16
BATCH = 64  # events (matches and inserts) queued before the shadow plays them


def _limit(threshold: int) -> bytes:
    """The bytes a sampled key sorts below: ``key < _limit(t)`` iff its first 4 bytes, read
    big-endian, are under ``t``."""
    return _ALL if threshold >= _SPACE else threshold.to_bytes(4, "big")


# A match's touch, left to the next event (a plain tuple: building it is one C call):
# (pages, last key, keys, candidate end positions or None (no state: every page is one),
# positions to touch, positions under the page threshold, the page threshold's bytes, the
# distances of the tracked positions before the match, None when it read none).
_Pending = tuple[int, bytes, Sequence[bytes], "list[int] | None", list[int], list[int], bytes,
                 "dict[int, float] | None"]


class Shadow:
    """The sampled shadow of one store. ``capacities`` are the tiers' bytes (``l1``, ``l2``,
    ``l3``; None: unbounded or absent); ``units`` the envelope bytes per kind."""

    # Slots: past 30 attributes CPython 3.11 stops sharing an instance dict's
    # keys, and every ``self.x`` on the event path became a dict lookup (~70 ns each). A
    # ``__dict__`` stays, for what a caller adds (``bench ops`` wraps the hooks to time them).
    __slots__ = ("__dict__", "_bits", "_c", "_c1", "_c2", "_carry", "_clock", "_core", "_d",
                 "_end_bits", "_end_kinds", "_end_set", "_fl", "_hist", "_kind_hist", "_kind_refs",
                 "_l1_reach", "_l1_total", "_l2_hit", "_l2_kind", "_lo", "_num_ends", "_one",
                 "_overlap", "_page_kinds", "_page_limit", "_pages", "_pending", "_queue",
                 "_reach", "_rotated", "_slots", "_tree", "_trim_at", "_w_end", "_w_page", "_wb",
                 "_win", "_young", "capacities", "edges", "end_bytes", "end_threshold", "kinds",
                 "max_tracked", "multiples", "page_bytes", "page_size", "requests", "state",
                 "threshold", "tokens", "unbounded_below", "write_through")

    def __init__(self, capacities: Mapping[str, int | None], units: Mapping[str, int],
                 page_size: int, *, swa_window_pages: int = 0, swa_window_only: bool = False,
                 rate: float = DEFAULT_RATE, max_tracked: int = DEFAULT_MAX_TRACKED,
                 multiples: Sequence[float] = MULTIPLES, unbounded_below: bool = False,
                 write_through: bool = False, whole_in_c: bool = True) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
        if max_tracked < 16:
            raise ValueError(f"max_tracked must be >= 16, got {max_tracked}")
        if not 0 < len(multiples) <= 12 or min(multiples) <= 0:
            raise ValueError(f"multiples must be 1 to 12 sizes > 0, got {list(multiples)}")
        self.page_size = page_size
        self.state = "state" in units
        self.multiples = tuple(multiples)
        self.capacities = {t: c for t, c in capacities.items() if c}
        # An unbounded last tier (an L3 of unknown size) serves whatever the others miss: the
        # whole cache's hit rate is then the unbounded one whatever a tier's size.
        self.unbounded_below = unbounded_below
        # Write-through: an insert copies its whole path down to L2 (``Mover.backup``).
        self.write_through = write_through
        # Two thresholds: ordinary pages, and candidate ends (pages a checkpoint follows).
        # Ends are few and carry each prefix's hit tokens, so they are sampled apart (all of
        # them until there are ``max_tracked``): sampling them with the pages would let a few
        # heavily shared prefixes swing the estimate by whole points.
        self.threshold = int(rate * _SPACE)
        self._page_limit = _limit(self.threshold)
        self.end_threshold = _SPACE
        self.max_tracked = max_tracked
        window = swa_window_pages if swa_window_only else 0
        self.page_bytes = units["kv"] + (units.get("swa", 0) if not window else 0)
        self.end_bytes = units.get("state", 0) + window * units.get("swa", 0)
        self.kinds = [k for k in ("kv", "swa", "state") if k in units]
        # Tracked pages: key -> slot << 1 | is_end (a plain int: no object per page for the
        # garbage collector to walk; slot -1 while it moves). Slot order is recency (higher:
        # more recent). The slots hold bytes / rate: distances come out unscaled.
        self._pages: dict[bytes, int] = {}
        self._num_ends = 0
        self._slots = 4 * max_tracked + 64
        self._tree = _Slots([0.0] * self._slots)
        self._clock = 0
        # Candidate ends (keys of pages a checkpoint follows), two generations in one dict (its
        # last ``_young`` keys are the young one), and their prefilter (mrc_loops.END_BITS).
        self._end_set: dict[bytes, None] = {}
        self._young, self._rotated = 0, False  # (rotated: ends were forgotten; see _insert)
        self._end_bits = bytearray(mrc_loops.END_BITS // 8) if self.state else None
        self._w_page = self._w_end = 0.0
        self._wb = (0.0, 0.0)  # a slot's weighted bytes: a page's, an end's
        self._set_weights()
        self._pending: _Pending | None = None
        # Queued events: (a match?, keys, its tokens or the insert's checkpoint flag)
        self._queue: list[tuple[bool, Sequence[bytes], Any]] = []
        # The curves read no distance past the last edge: a page deeper in the stack counts as
        # untracked, and is dropped (mrc_stack.trim; tracked: at 2k cached pages ~1.5k entries
        # instead of 16k pages + 16k ends). Not so above an unbounded tier: its total hit rate
        # is every distance's (the last edge, infinite, keeps all).
        self.edges = self._edges()
        if unbounded_below or not self.edges:
            self.edges.append(math.inf)
        self._trim_at = mrc_stack.TRIM_MIN
        self._hist = [0.0] * (len(self.edges) + 1)  # hit tokens by distance bin, weighted
        self._kind_hist = {k: [0.0] * (len(self.edges) + 1) for k in self.kinds}
        self._kind_refs = dict.fromkeys(self.kinds, 0.0)
        # The kinds a sampled page adds to (KV and SWA entries) and a candidate end (+ state).
        self._page_kinds: list[tuple[list[float], str]] = [
            (self._kind_hist[k], k) for k in ("kv", "swa") if k in self.kinds]
        self._end_kinds = [(self._kind_hist[k], k) for k in self.kinds]
        self.tokens = 0  # prompt tokens referenced (exact, not sampled)
        self.requests = 0
        self._c = _C  # (None in a test: this shadow's pure path beside a compiled one)
        # The L1/L2 overlap (module docstring): slots [_lo, clock) are L1's top C1 bytes
        # (``_win`` of them); ``_fl[slot]`` the multiples whose L2 holds a copy of that slot's
        # page, ``_d[j]`` those bytes per multiple; L2's hits are counted per multiple as they
        # come (``_l2_hit``, ``_l2_kind``), since its window moves with ``_d``.
        c1, c2 = self.capacities.get("l1"), self.capacities.get("l2")
        self._overlap = c1 is not None and c2 is not None
        self._c1 = float(c1 or 0)
        self._c2 = float(c2 or 0)
        self._lo = 0
        self._win = 0.0
        self._fl = [0] * self._slots
        n = len(self.multiples)
        self._d = [0.0] * n
        self._bits = [tuple(j for j in range(n) if f >> j & 1) for f in range(1 << n)] \
            if self._overlap else []
        self._l2_hit = [0.0] * n
        self._l2_kind = {k: [0.0] * n for k in self.kinds}
        self._l1_total = [0.0] * n  # without an unbounded tier below: L1 at m*C1 plus L2
        self._reach = [self._c1 + m * self._c2 for m in self.multiples]
        self._one = min(range(n), key=lambda j: abs(self.multiples[j] - 1))
        below = self._c2 + self.capacities.get("l3", 0)
        self._l1_reach = [(m * self._c1 + below, min(m, 1.0)) for m in self.multiples]
        # a page that becomes a checkpoint end is tracked anew: the copy bits it had
        self._carry: dict[bytes, int] = {}
        # Without the overlap the whole state and event loop can live in C: no Python object
        # per event or per tracked page (in bench ops' loop the Python one cost ~10 points of
        # a request, mostly the objects it made and the memory it walked).
        # (whole_in_c False: the Python event loop, as with an overlap; tests compare the two)
        self._core: Any = None if _P is None or self._overlap or not whole_in_c else _P.Core(
            self.state, page_size, self.page_bytes, self.end_bytes, self.threshold,
            self.end_threshold, max_tracked, self._slots, self.edges,
            tuple(k in units for k in _KINDS), BATCH)
        if self._core is not None:  # the store calls the core's own queue: no frame an event
            self._core.on_refuse = self._refused
            self.__dict__.update(reference=self._core.match, insert=self._core.insert)

    # ------------------------------------------------------------------ events
    @property
    def rate(self) -> float:
        """The sampling rate of ordinary pages."""
        return (self.threshold if self._core is None else self._core.tallies()[5]) / _SPACE

    @property
    def end_rate(self) -> float:
        """The sampling rate of candidate ends."""
        return (self.end_threshold if self._core is None else self._core.tallies()[6]) / _SPACE

    def _weight(self, is_end: bool) -> float:
        return _SPACE / (self.end_threshold if is_end else self.threshold)

    def _set_weights(self) -> None:
        """Cache ``1/R`` of pages and ends (they change only with a rate)."""
        self._w_page, self._w_end = self._weight(False), self._weight(True)
        self._wb = (self.page_bytes * self._w_page,
                    (self.page_bytes + self.end_bytes) * self._w_end)

    def insert(self, keys: Sequence[bytes], checkpoint: bool) -> None:
        """An insert of a prompt's full pages (``keys``), with a checkpoint at its end: queued
        (see :meth:`reference`)."""
        queue = self._queue
        queue.append((False, keys, checkpoint))
        if len(queue) >= BATCH:
            self.drain()

    def reference(self, keys: Sequence[bytes], n_tokens: int) -> None:
        """A match of ``n_tokens`` tokens whose full pages are ``keys``: queued, and played
        with the events before it every :data:`BATCH` events (one pass keeps the shadow's
        tables in cache, instead of a few probes per request between the store's own work;
        the curves read the same). The store must not change ``keys`` afterwards."""
        queue = self._queue
        queue.append((True, keys, n_tokens))
        if len(queue) >= BATCH:
            self.drain()

    def drain(self) -> None:
        """Play the queued events, in order."""
        queue, self._queue = self._queue, []
        if self._core is not None:
            self._core.drain()
            return
        match, insert = self._reference, self._insert  # (no bound method made per event)
        for is_match, keys, arg in queue:
            if is_match:
                match(keys, arg)
            else:
                insert(keys, arg)
        if len(self._pages) > self._trim_at:
            mrc_stack.trim(self)

    def _refused(self, is_match: bool, keys: Sequence[bytes], arg: Any) -> None:
        """An event the compiled core does not take (keys not a list of bytes of 8 to 32): the
        shadow plays on in Python, from the core's state."""
        self._take_back()
        if is_match:
            self.reference(keys, arg)
        else:
            self.insert(keys, arg)

    def _take_back(self) -> None:
        """Play in Python from here on: the compiled core's state becomes this shadow's."""
        core, self._core = self._core, None
        core.drain()
        core.on_refuse = None
        for hook in ("reference", "insert"):  # (the class's methods again)
            self.__dict__.pop(hook, None)
        state = core.export()
        self._pages = state["pages"]
        self._tree = _Slots.__new__(_Slots)
        self._tree.values, self._tree.sums = state["values"], state["sums"]
        self._clock, self._num_ends = state["clock"], state["num_ends"]
        self._end_set = dict.fromkeys(state["old"] + state["young"])
        self._young, self._rotated = state["young_n"], bool(state["rotated"])
        if self.state:
            self._end_bits = mrc_loops.end_bits(self._end_set, _mark_end)
        self.threshold, self.end_threshold = state["threshold"], state["end_threshold"]
        self._page_limit = _limit(self.threshold)
        self._set_weights()
        self._trim_at = state["trim_at"]
        self._tallies(state["hist"], state["kind_hist"], state["refs"], state["tokens"],
                      state["requests"])
        pending = state["pending"]
        if pending is not None:  # (its touch reads only the touched positions of its keys)
            n, last, ends, low, threshold, touched, at = pending
            keys: list[bytes] = [b""] * n
            for i, key in zip(at, touched, strict=True):
                keys[i] = key
            self._pending = (n, last, keys, ends, at, low, _limit(threshold), None)

    def _tallies(self, hist: list[float], kind_hist: list[list[float] | None],
                 refs: list[float], tokens: int, requests: int) -> None:
        """Take the compiled core's tallies (in place: the kinds' pairs hold the lists)."""
        self._hist[:] = hist
        for kind, h, r in zip(_KINDS, kind_hist, refs, strict=True):
            if kind in self._kind_refs:
                assert h is not None
                self._kind_hist[kind][:] = h
                self._kind_refs[kind] = r
        self.tokens, self.requests = tokens, requests

    def tracked(self) -> tuple[int, int]:
        """The pages and the candidate ends tracked now."""
        if self._core is not None:
            _, _, _, _, _, _, _, pages, ends = self._core.tallies()
            return pages, ends
        return len(self._pages) - self._num_ends, self._num_ends

    def _insert(self, keys: Sequence[bytes], checkpoint: bool) -> None:
        if not keys:
            return
        pending, self._pending = self._pending, None
        n = len(keys)
        # The engine inserts the prompt it just matched (or a longer one): keys are chained,
        # so an equal key at the match's last page means the same pages up to it. Its scan is
        # reused, and the match's touch is skipped: this insert's touch moves the same pages
        # (sampled and tracked, up to its last end) to the top again, deepest first, leaving
        # the stack as both touches would.
        known = pending if pending is not None and n >= pending[0] \
            and keys[pending[0] - 1] == pending[1] else None
        if known is None and pending is not None:
            self._flush(pending)
        if checkpoint and self.state:
            last = keys[-1]
            end_set = self._end_set
            marked = _mark_end(self._end_bits, last)  # type: ignore[arg-type]  # (a bytearray)
            if not marked or last not in end_set:  # (its bit was clear: new, with no lookup)
                end_set[last] = None
                self._young += 1
                if self._young >= 4 * self.max_tracked:  # the older generation is forgotten
                    self._end_set = dict.fromkeys(  # (once per generation: amortized O(1))
                        islice(end_set, len(end_set) - self._young, None))
                    self._young = 0
                    self._rotated = True
                    self._end_bits = mrc_loops.end_bits(self._end_set, _mark_end)
                    if known is not None:  # forgotten ends may not be sampled now: as matched
                        self._flush(known)
                        known = None
                elif known is not None and n == known[0]:  # its last page became an end
                    ends = known[3]
                    assert ends is not None
                    ends.append(n - 1)
                # (a tracked page sorts below the page limit; a tracked end is in the end set
                # until ends are first forgotten: else it is not tracked, and not looked up)
                if last < self._page_limit or self._rotated:
                    code = self._pages.pop(last, None)
                    if code is not None:  # a tracked page becomes an end: tracked anew below
                        mrc_stack.untrack(self, code, last)
        c = self._c
        if c is not None and not self._overlap and type(keys) is list:  # _scan and _touch's
            limit = self._page_limit  # compiled paths, one frame fewer each
            if known is not None and known[6] == limit:
                if known[3] is None and n == known[0]:  # no state, the match's very pages:
                    ends, sampled = None, known[5]  # its sample as it is (what scan returns)
                    if not sampled:
                        return
                else:
                    ends, sampled, _ = c.scan(keys, limit, self._end_set, self.end_threshold,
                                              _SPACE, known[0], known[3], known[5],
                                              self._end_bits)
            else:
                ends, sampled, _ = c.scan(keys, limit, self._end_set if self.state else None,
                                          self.end_threshold, _SPACE, -1, None, None,
                                          self._end_bits)
            pages = self._pages
            done = c.touch(pages, self._tree.values, self._tree.sums, self._wb[0], self._wb[1],
                           keys, sampled, ends, True, self._clock)
            if done is not None:
                self._clock, added = done
                self._num_ends += added
                if len(pages) - self._num_ends > self.max_tracked \
                        or self._num_ends > self.max_tracked:
                    self._lower_rate()
                return
        else:
            ends, sampled, _ = self._scan(keys, known)
        self._touch(keys, ends, sampled, create=True, seen=known[7] if known else None,
                    start=known[0] if known else 0)
        if self._carry:
            self._carry.clear()

    def _scan(self, keys: Sequence[bytes], known: _Pending | None = None
              ) -> tuple[list[int] | None, list[int], list[int]]:
        """The positions of the pages a checkpoint follows (None: every page is a candidate,
        the model has no state), the positions the sample covers (as pages, or as candidate
        ends) in order, and those under the page threshold. C-level maps only: no Python step
        per page. ``known``: the same for the first ``known[0]`` pages."""
        limit = self._page_limit
        c = self._c
        if c is not None and type(keys) is list:
            if known is not None and known[6] == limit:
                return c.scan(keys, limit, self._end_set, self.end_threshold, _SPACE,
                              known[0], known[3], known[5], self._end_bits)
            return c.scan(keys, limit, self._end_set if self.state else None,
                          self.end_threshold, _SPACE, -1, None, None, self._end_bits)
        return mrc_loops.scan(self, keys, known)

    def _reference(self, keys: Sequence[bytes], n_tokens: int) -> None:
        """A match: record where each candidate end's distance puts it, then use the path an
        unbounded cache would serve."""
        self.tokens += n_tokens
        self.requests += 1
        pending = self._pending
        if pending is not None:  # the previous match was not followed by its insert
            self._pending = None
            self._flush(pending)
        if not keys:
            return
        c = self._c if type(keys) is list else None  # the compiled loops take lists
        if c is not None:  # _scan's compiled path, one frame fewer
            ends, sampled, low = c.scan(keys, self._page_limit,
                                        self._end_set if self.state else None,
                                        self.end_threshold, _SPACE, -1, None, None,
                                        self._end_bits)
        else:
            ends, sampled, low = self._scan(keys)
        touched: list[int] = []
        # the touch is done by the next event (skipped if it is this prompt's insert, which
        # reuses the scan too)
        if not sampled or (ends is not None and not ends):  # nothing to read: the touch will
            self._pending = (len(keys), keys[-1], keys, ends, touched, low, self._page_limit,
                             None)
            return
        seen: dict[int, float] = {}  # distances before this request, for the touch's L2 bits
        self._pending = (len(keys), keys[-1], keys, ends, touched, low, self._page_limit, seen)
        last = ends[-1] if ends is not None else len(keys) - 1
        tree = self._tree
        if c is not None and not self._overlap:  # the usual case: one call, no locals to set up
            c.reference(self._pages, tree.values, tree.sums, keys, sampled, ends, last,
                        self._clock, self.edges, self._hist, self.page_size, self._w_page,
                        self._w_end, self._page_kinds, self._end_kinds, self._kind_refs,
                        touched, seen)
            return
        thr = self._thresholds() if self._overlap else []  # an L2 of m*C2 holds what
        top = max(thr, default=0.0)  # lies within C1 + m*C2 - D_m
        l1_thr = None if self.unbounded_below or not self._overlap else self._l1_thresholds()
        if c is not None:  # (with the overlap: its two extra tallies)
            c.reference(self._pages, tree.values, tree.sums, keys, sampled, ends, last,
                        self._clock, self.edges, self._hist, self.page_size, self._w_page,
                        self._w_end, self._page_kinds, self._end_kinds, self._kind_refs,
                        touched, seen, thr, top, self._c1, self._l2_hit, self._l2_kind, l1_thr,
                        self._l1_total)
            return
        mrc_loops.reference(self, keys, sampled, ends, last, touched, seen, thr, top, l1_thr)

    def _thresholds(self) -> list[float]:
        """Per multiple ``m``: the deepest distance an L2 of ``m*C2`` bytes serves."""
        return [r - d for r, d in zip(self._reach, self._d, strict=True)]

    def _l1_thresholds(self) -> list[float]:
        """Per multiple ``m`` of L1: the deepest distance L1 + L2 serve with L1 at ``m*C1``,
        plus a bounded L3. The overlap is measured at L1's own size only (the multiple nearest
        1): a smaller L1 is taken to hold copies in proportion, a larger one as many."""
        d = self._d[self._one]
        return [r - s * d for r, s in self._l1_reach]

    def _flush(self, pending: _Pending) -> None:
        """The touch a match left to the next event."""
        if pending[4]:
            self._touch(pending[2], pending[3], pending[4], create=False, seen=pending[7],
                        start=pending[0])

    def _touch(self, keys: Sequence[bytes], ends: list[int] | None, sampled: list[int], *,
               create: bool, seen: dict[int, float] | None = None, start: int = 0) -> None:
        """Move the tracked pages at the ``sampled`` positions of ``keys`` to the top, deepest
        first (so it is the least recent of them); with ``create``, those not yet tracked
        join (as candidate ends where ``ends`` says so). ``seen``: distances before the
        request, by position, of every tracked one before ``start`` (the L2 copy bits of
        pages coming into L1)."""
        if self._overlap:
            mrc_stack.touch(self, keys, ends, sampled, create, seen, start)
            return
        pages = self._pages
        if self._c is not None and type(keys) is list:
            done = self._c.touch(pages, self._tree.values, self._tree.sums, self._wb[0],
                                 self._wb[1], keys, sampled, ends, create, self._clock)
            if done is not None:  # (None: the slots run out on the way; compacted below)
                self._clock, added = done
                self._num_ends += added
                if len(pages) - self._num_ends > self.max_tracked \
                        or self._num_ends > self.max_tracked:
                    self._lower_rate()
                return
        mrc_loops.touch(self, keys, ends, sampled, create)

    def _compact(self) -> None:
        """Renumber the live slots 0..n-1 in recency order (slots ran out)."""
        mrc_stack.compact(self)

    def _lower_rate(self) -> None:
        """Halve a rate until at most ``max_tracked`` pages (and ends) are tracked
        (fixed-size SHARDS); the survivors weigh twice as much from now on."""
        mrc_stack.trim(self)  # (pages past the curves' depth go first: often enough)
        while len(self._pages) - self._num_ends > self.max_tracked and self.threshold > 1:
            self.threshold //= 2
            limit = self._page_limit = _limit(self.threshold)
            self._drop([key for key, code in self._pages.items()
                        if not code & 1 and not key < limit])
        while self._num_ends > self.max_tracked and self.end_threshold > 1:
            self.end_threshold //= 2
            ethr = self.end_threshold
            self._drop([key for key, code in self._pages.items()
                        if code & 1 and not _end_sampled(key, ethr)])
        mrc_stack.reweigh(self)

    def _drop(self, gone: list[bytes]) -> None:
        for key in gone:
            self._num_ends -= self._pages.pop(key) & 1

    # ------------------------------------------------------------------ curves
    def _edges(self) -> list[float]:
        return mrc_curves.edges(self.capacities, self.multiples)

    def curves(self) -> dict[str, object]:
        """Per tier: its bytes, the multiples, the estimated share of prompt tokens it would
        serve at each (``hit_rate``), the whole cache's hit rate then (``total_hit_rate``,
        the tiers below kept as they are), and per kind the share of referenced entries it
        would hold. Plus the sampling state."""
        self.drain()
        if self._core is not None:  # (read's rates and tracked counts ask the core)
            self._tallies(*self._core.tallies()[:5])
        return mrc_curves.read(self)


class NoShadow:
    """The shadow switched off (``StoreConfig.mrc``): hears every event, keeps nothing, and
    has no curves. Every call is a constant."""

    def reference(self, keys: Sequence[bytes], n_tokens: int) -> None:
        return None

    def insert(self, keys: Sequence[bytes], checkpoint: bool) -> None:
        return None

    def curves(self) -> None:
        return None


def shadow_for(config: StoreConfig, layout: ModelLayout, *, swa_window_only: bool,
               l3_bytes: int | None = None, **kwargs: object) -> Shadow | NoShadow:
    """A shadow of a store's tiers (its ``config`` and ``layout``): L1 and L2 at their
    configured bytes, L3 at ``l3_bytes`` (None: no L3 curve, and an L3 counts as unbounded; the
    store cannot know Redis's memory limit). :class:`NoShadow` when ``config.mrc`` is off."""
    if not config.mrc:
        return NoShadow()
    units = {k: e.nbytes for k, e in layout.envelopes().items()}
    capacities = {"l1": config.capacity_bytes, "l2": config.host_capacity_bytes or None,
                  "l3": l3_bytes if config.remote is not None else None}
    return Shadow(capacities, units, layout.page_size,
                  swa_window_pages=layout.swa_window_pages(),
                  swa_window_only=swa_window_only,
                  unbounded_below=config.remote is not None and l3_bytes is None,
                  write_through=config.write_policy == "write_through",
                  **kwargs)  # type: ignore[arg-type]
