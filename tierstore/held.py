"""A match that L1 serves whole, counted in one call: the attribution's usual case.

The store's usual match walks the index to the prompt's usable prefix, all of it in L1, and
the page after it is a new prompt's tail: everything past the prefix is ``cold``, and the tail
past the last full page ``partial_page``. :class:`~tierstore.attribution.Attribution` counts
that case here, in one step, instead of :meth:`~tierstore.attribution.Attribution.explain`
and :meth:`~tierstore.attribution.Attribution.settle` (a list, two calls and ~25 lines of
Python a match). When the ghost remembers the page after the prefix, the ``fallback`` (the
general path) says how much of the rest it remembers, and by which tier.

:data:`Held` is the compiled one (``tierstore/_c_held.c``) where it is built;
:class:`PyHeld` is the pure-Python path and its twin (``tests/tierstore/test_held.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tierstore.native import load

Counts = dict[str, int]
Settled = tuple[Counts, Counts]


class HeldCount(Protocol):
    """What attribution asks of either path."""

    requests: int  # matches in the warning window so far
    shared: int  # pages of cached KV in the window so far
    window: int  # matches a window holds

    def __init__(self, ghost: Any, counts: dict[str, list[int]], page: int,
                 slots: tuple[int, int, int, int], fallback: Callable[..., Settled],
                 on_full: Callable[[], object], window: int) -> None: ...
    def settle(self, namespace: str, n_tokens: int, keys: Sequence[bytes], path: Any,
               pages: int, sources: dict[int, int]) -> Settled: ...


class PyHeld:
    """``settle`` counts a match whose index walk ``path`` L1 holds whole: ``pages`` pages of
    ``keys``, served with nothing to promote. ``counts`` maps a namespace to its counters
    (``slots``: how many, and the indices of L1 hits, ``cold`` and ``partial_page`` tokens);
    ``on_full`` is called when ``requests`` reaches ``window``."""

    __slots__ = ("cold", "counts", "fallback", "ghost", "l1", "nslots", "on_full", "page",
                 "partial", "requests", "shared", "window")

    def __init__(self, ghost: Any, counts: dict[str, list[int]], page: int,
                 slots: tuple[int, int, int, int], fallback: Callable[..., Settled],
                 on_full: Callable[[], object], window: int) -> None:
        nslots, l1, cold, partial = slots
        if page < 1 or window < 1:
            raise ValueError(f"page and window must be >= 1, got {page} and {window}")
        if not all(0 <= s < nslots for s in (l1, cold, partial)):
            raise ValueError(f"slots ({l1}, {cold}, {partial}) out of range [0, {nslots})")
        self.ghost, self.counts, self.page = ghost, counts, page
        self.nslots, self.l1, self.cold, self.partial = nslots, l1, cold, partial
        self.fallback, self.on_full, self.window = fallback, on_full, window
        self.requests = self.shared = 0

    def settle(self, namespace: str, n_tokens: int, keys: Sequence[bytes], path: Any,
               pages: int, sources: dict[int, int]) -> Settled:
        """Lost tokens by reason and evicted ones by tier, counted in the totals."""
        if type(keys) is not list:  # (the store's keys are a list)
            return self.fallback(namespace, n_tokens, keys, path, pages, sources)
        n_full, page = len(keys), self.page
        if not 0 <= pages <= n_full:
            raise ValueError(f"pages {pages} out of range [0, {n_full}]")
        if pages < n_full and keys[pages] in self.ghost:
            return self.fallback(namespace, n_tokens, keys, path, pages, sources)
        c = self.counts.get(namespace)
        if c is None:
            c = self.counts[namespace] = [0] * self.nslots
        c[self.l1] += pages
        lost: Counts = {}
        if pages < n_full:
            lost["cold"] = cold = (n_full - pages) * page
            c[self.cold] += cold
        tail = n_tokens - n_full * page
        if tail:
            lost["partial_page"] = tail
            c[self.partial] += tail
        self.shared += pages
        self.requests += 1
        if self.requests >= self.window:
            self.on_full()
        return lost, {}


_c = load("tierstore._c_held")
Held: type[HeldCount] = _c.Held if _c is not None else PyHeld
