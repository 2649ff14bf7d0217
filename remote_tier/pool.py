"""``NodePool``: the data-path connections to one Redis server and that server's breaker."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from remote_tier.breaker import CircuitBreaker
from remote_tier.config import Endpoint, RemoteTierConfig
from remote_tier.errors import RemoteUnavailable
from remote_tier.resp import RespConnection

log = logging.getLogger(__name__)

_Slot = RespConnection | asyncio.Task[RespConnection] | None


def _retrieve(task: asyncio.Task[RespConnection]) -> None:
    if not task.cancelled():
        task.exception()


class NodePool:
    """Up to ``config.connections`` connections to ``host:port`` (or to the endpoint's unix
    socket, ``host`` being its path and ``port`` 0), opened lazily and checked
    out by one batch at a time (``checkout`` / ``release``, released on ``BaseException``).

    A failed connection is replaced at its next checkout. Opening runs in a task awaited
    through ``shield``, so a cancelled caller never aborts a connect in progress; the pool
    keeps bookkeeping only — nothing waits on I/O while holding anything.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        config: RemoteTierConfig,
        endpoint: Endpoint,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.breaker = CircuitBreaker(
            failures=config.breaker_failures,
            cooldown_s=config.breaker_cooldown_s,
            max_cooldown_s=config.breaker_max_cooldown_s,
            clock=clock,
            name=f"redis {self.address}",
        )
        self._config = config
        self._endpoint = endpoint
        self._slots: list[_Slot] = [None] * config.connections
        self._busy = [False] * config.connections
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def size(self) -> int:
        """How many connections this pool may hold."""
        return len(self._slots)

    async def checkout(self, count: int) -> list[tuple[int, RespConnection]]:
        """Between 1 and ``count`` idle connections, each with its slot number, now in the
        caller's sole use until ``release``; waits (first come, first served) while all are
        busy, and opens missing ones concurrently. ``RemoteUnavailable`` if one cannot be
        opened (nothing is then checked out).

        One batch per connection at a time: with large values, several requests queued on
        one connection make Redis buffer and trickle out replies, costing it about twice the
        CPU per byte, and the client too.
        """
        assert count >= 1, f"checkout({count})"
        while all(self._busy):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter  # resolved by release() once a slot is free
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                else:
                    self._wake_next()  # the wake-up was ours: pass it on
                raise
        chosen = [i for i, busy in enumerate(self._busy) if not busy][:count]
        for i in chosen:
            self._busy[i] = True
        try:
            waits: list[RespConnection | asyncio.Task[RespConnection]] = []
            for i in chosen:
                slot = self._slots[i]
                if slot is None or (isinstance(slot, RespConnection) and slot.closed):
                    slot = asyncio.ensure_future(self._open(i))
                    slot.add_done_callback(_retrieve)
                    self._slots[i] = slot
                waits.append(slot)
            conns: list[tuple[int, RespConnection]] = []
            for i, item in zip(chosen, waits, strict=True):
                conn = item if isinstance(item, RespConnection) else await asyncio.shield(item)
                conns.append((i, conn))
        except BaseException:
            self.release(chosen)
            raise
        return conns

    def release(self, slots: Sequence[int]) -> None:
        """Return checked-out slots and wake as many waiters."""
        for i in slots:
            assert self._busy[i], f"{self.address}: slot {i} released twice"
            self._busy[i] = False
            self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _open(self, i: int) -> RespConnection:
        ep = self._endpoint
        try:
            conn = await RespConnection.open(
                self.host,
                self.port,
                timeout_s=self._config.op_timeout_s,
                username=ep.username,
                password=ep.password,
                db=ep.db,
                path=ep.path,
            )
        except BaseException:
            self._slots[i] = None
            raise
        self._slots[i] = conn
        return conn

    def num_open(self) -> int:
        """Connections currently open."""
        return sum(isinstance(s, RespConnection) and not s.closed for s in self._slots)

    def check_integrity(self) -> None:
        """Assert no waiter sleeps while a slot is free (a lost wake-up)."""
        waiting = sum(not w.done() for w in self._waiters)
        assert not waiting or all(self._busy), f"{self.address}: {waiting} wait, a slot is free"
        assert 0 <= self.num_open() <= self.size, f"{self.address}: {self.num_open()} open"

    async def aclose(self) -> None:
        """Drop every connection, cancel connects in progress, fail waiting checkouts."""
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(RemoteUnavailable("connection", "pool closed"))
        slots, self._slots = self._slots, [None] * len(self._slots)
        for slot in slots:
            if isinstance(slot, RespConnection):
                slot.abort()
            elif slot is not None:
                slot.cancel()
        tasks = [s for s in slots if isinstance(s, asyncio.Task)]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
