"""Commits of shared-memory reservations, remembered so that a retried commit is idempotent.

A client whose ``shm_commit`` answer was lost (a reset connection, a timeout) sends it again;
the reservation is gone by then. For ``ttl_s`` after it (and for at most ``max_keys`` keys
in all, oldest forgotten first) a commit is remembered with its principal, its keys and its
answer, and the same principal's retry gets that answer again, waiting for it if the first
commit is still running. While any of its keys is put or deleted by anyone since (their
change numbers, :mod:`.kv_changes`), the answer no longer holds: :class:`CommitSuperseded`.
An LRU eviction since is no change: the answer is what the client would have had first.

Runs on the service's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierstore.errors import UsageError
from tierstore.service.kv_changes import Changes, ReadMark

MAX_KEYS = 1 << 16  # keys of remembered commits, all together


class CommitSuperseded(UsageError):
    """A retried commit whose values were replaced or deleted since it first ran."""


@dataclass
class Committed:
    """One commit: whose, its answer (once known) and the mark its keys are watched from."""

    principal: str
    until: float
    answer: asyncio.Future[list[bool] | None] = field(repr=False)
    mark: ReadMark | None = None


class CommitLog:
    """The commits of the last ``ttl_s`` seconds (and ``max_keys`` keys), by reservation id."""

    def __init__(self, changes: Changes, ttl_s: float, *, max_keys: int = MAX_KEYS) -> None:
        self.changes = changes
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._held: OrderedDict[str, Committed] = OrderedDict()
        self._keys = 0

    def begin(self, res_id: str, principal: str) -> None:
        """A commit of reservation ``res_id`` of ``principal`` starts (its answer pending)."""
        self._expire()
        future: asyncio.Future[list[bool] | None] = asyncio.get_running_loop().create_future()
        self._held[res_id] = Committed(principal, time.monotonic() + self.ttl_s, future)

    def watch(self, res_id: str, keys: Sequence[str]) -> None:
        """The commit publishes ``keys`` now: a put or delete of one from here on supersedes
        its answer."""
        held = self._held.get(res_id)
        if held is not None and held.mark is None:
            held.mark = self.changes.watch(keys)
            self._keys += len(keys)

    def end(self, res_id: str, answer: list[bool] | None) -> None:
        """The commit answered ``answer`` (None: it failed; a retry is then unknown)."""
        held = self._held.get(res_id)
        if held is None:
            return
        held.answer.set_result(answer)
        if answer is None:
            self._forget(res_id)
        else:
            self._expire()

    async def replay(self, res_id: str, principal: str) -> list[bool] | None:
        """The answer of a remembered commit of ``principal`` (waiting while it runs); None
        when none is remembered (or it failed, or is another principal's); CommitSuperseded
        when one of its keys was put or deleted since."""
        self._expire()
        held = self._held.get(res_id)
        if held is None or not secrets.compare_digest(held.principal, principal):
            return None
        answer = await asyncio.shield(held.answer)
        if answer is not None and held.mark is not None:
            changed = self.changes.changed_since(held.mark)
            if changed:
                raise CommitSuperseded(
                    f"reservation {res_id:.24} was committed, but {len(changed)} of its "
                    f"{len(held.mark.keys)} keys were put or deleted since")
        return answer

    def __len__(self) -> int:
        return len(self._held)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held:
            res_id, held = next(iter(self._held.items()))
            if not held.answer.done() or (held.until > now and self._keys <= self.max_keys):
                return
            self._forget(res_id)

    def _forget(self, res_id: str) -> None:
        held = self._held.pop(res_id)
        if held.mark is not None:
            self.changes.end_read(held.mark)
            self._keys -= len(held.mark.keys)
