"""``NodePool``: the data-path connections to one Redis server and that server's breaker."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from remote_tier.breaker import CircuitBreaker
from remote_tier.config import Endpoint, RemoteTierConfig
from remote_tier.resp import RespConnection

log = logging.getLogger(__name__)

_Slot = RespConnection | asyncio.Task[RespConnection] | None


def _retrieve(task: asyncio.Task[RespConnection]) -> None:
    if not task.cancelled():
        task.exception()


class NodePool:
    """Up to ``config.connections`` multiplexed connections to ``host:port``, opened lazily.

    Connections are shared: callers pipeline on them concurrently rather than check them out,
    so there is nothing to release; a failed connection is replaced on next use. Opening runs
    in a task that callers await through ``shield``, so a cancelled caller never aborts a
    connect another caller waits for (bookkeeping only — no lock is held across I/O).
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

    @property
    def size(self) -> int:
        """How many connections this pool may hold."""
        return len(self._slots)

    async def acquire(self, count: int) -> list[RespConnection]:
        """The ``count`` least busy connections (1 <= count <= size), opening missing ones
        concurrently; ``RemoteUnavailable`` if one cannot be opened."""
        assert 1 <= count <= len(self._slots), f"acquire({count}) of a pool of {self.size}"
        chosen = sorted(range(len(self._slots)), key=self._load)[:count]
        waits: list[RespConnection | asyncio.Task[RespConnection]] = []
        for i in chosen:
            slot = self._slots[i]
            if slot is None or (isinstance(slot, RespConnection) and slot.closed):
                slot = asyncio.ensure_future(self._open(i))
                slot.add_done_callback(_retrieve)
                self._slots[i] = slot
            waits.append(slot)
        conns: list[RespConnection] = []
        for item in waits:
            conns.append(item if isinstance(item, RespConnection) else await asyncio.shield(item))
        return conns

    def _load(self, i: int) -> int:
        slot = self._slots[i]
        return slot.num_pending if isinstance(slot, RespConnection) and not slot.closed else 0

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
            )
        except BaseException:
            self._slots[i] = None
            raise
        self._slots[i] = conn
        return conn

    def num_open(self) -> int:
        """Connections currently open."""
        return sum(isinstance(s, RespConnection) and not s.closed for s in self._slots)

    async def aclose(self) -> None:
        """Drop every connection and cancel connects in progress."""
        slots, self._slots = self._slots, [None] * len(self._slots)
        for slot in slots:
            if isinstance(slot, RespConnection):
                slot.abort()
            elif slot is not None:
                slot.cancel()
        tasks = [s for s in slots if isinstance(s, asyncio.Task)]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
