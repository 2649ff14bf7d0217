"""Which puts and deletes a storage read may have raced: per-key change numbers.

A read that fetches a key from disk or Redis awaits; a put or delete of the same key may run
meanwhile (on the loop) or be in flight when the read starts (its disk or Redis write not yet
landed). Such a read holds bytes that may be older than the key's value now: it must not
publish them into host memory (that would undo the put, or bring a deleted key back), so it
counts as a miss. :class:`Changes` tells the read which of its keys that applies to.

Runs on the service's event loop; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReadMark:
    """A read's start: its keys, the change number then, and the keys a change held then."""

    keys: tuple[str, ...]
    start: int
    busy: frozenset[str]


class Changes:
    """Change numbers of the keys reads are fetching, and the keys whose change is in flight.

    A change opens with :meth:`changing` (its values are in host memory, or gone, from then
    on) and stays in flight until each of its :meth:`changing` / :meth:`opened` calls is
    matched by :meth:`settled` (its disk and Redis writes or deletes have landed)."""

    def __init__(self) -> None:
        self._count = 0
        self._reading: dict[str, int] = {}  # key -> reads fetching it
        self._changed_at: dict[str, int] = {}  # key being read -> last change's number
        self._in_flight: dict[str, int] = {}  # key -> changes not yet landed

    def changing(self, keys: Iterable[str]) -> None:
        """A put or delete of ``keys`` begins (in flight until :meth:`settled`)."""
        self._count += 1
        for key in keys:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            if key in self._reading:
                self._changed_at[key] = self._count

    def opened(self, keys: Iterable[str]) -> None:
        """A write that continues a change of ``keys`` (e.g. in the background) begins."""
        for key in keys:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def settled(self, keys: Iterable[str]) -> None:
        """One :meth:`changing` or :meth:`opened` of ``keys`` has landed."""
        for key in keys:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]

    def begin_read(self, keys: Sequence[str]) -> ReadMark:
        """A disk or Redis read of ``keys`` begins; pass the mark to :meth:`end_read`."""
        for key in keys:
            self._reading[key] = self._reading.get(key, 0) + 1
        return ReadMark(tuple(keys), self._count,
                        frozenset(k for k in keys if k in self._in_flight))

    def watch(self, keys: Sequence[str]) -> ReadMark:
        """Watch ``keys`` for changes from now on (a change in flight now does not count);
        ask :meth:`changed_since`, and stop with :meth:`end_read`."""
        for key in keys:
            self._reading[key] = self._reading.get(key, 0) + 1
        return ReadMark(tuple(keys), self._count, frozenset())

    def changed_since(self, mark: ReadMark) -> set[str]:
        """The keys of ``mark`` a change began for since it was taken."""
        return {k for k in mark.keys if self._changed_at.get(k, -1) > mark.start}

    def end_read(self, mark: ReadMark) -> set[str]:
        """The read of ``mark`` has its bytes: the keys it must not publish (changed while it
        read, or a change of them was in flight when it began)."""
        stale = self.changed_since(mark) | mark.busy
        for key in mark.keys:
            left = self._reading.pop(key) - 1
            if left:
                self._reading[key] = left
            else:
                self._changed_at.pop(key, None)
        return stale

    def __len__(self) -> int:
        """Keys with a change in flight (0 when every write has landed)."""
        return len(self._in_flight)

    def check_integrity(self) -> None:
        """AssertionError unless every noted change number is of a key being read."""
        assert set(self._changed_at) <= set(self._reading), "a change noted for no read"
        assert all(n > 0 for n in self._reading.values())
        assert all(n > 0 for n in self._in_flight.values())
