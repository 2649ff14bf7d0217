"""NodePool: one batch per connection, waiters served in order, nothing leaks on cancel."""

from __future__ import annotations

import asyncio

import pytest

from remote_tier.config import RemoteTierConfig
from remote_tier.errors import RemoteUnavailable
from remote_tier.pool import NodePool
from tierstore.testing.redis_server import RedisServer, free_port


def _pool(port: int, connections: int = 2) -> NodePool:
    config = RemoteTierConfig(url=f"redis://127.0.0.1:{port}", connections=connections)
    return NodePool("127.0.0.1", port, config=config, endpoint=config.endpoint())


async def test_checkout_is_exclusive_and_release_wakes_waiters(server: RedisServer) -> None:
    pool = _pool(server.port)
    first = await pool.checkout(2)
    assert len(first) == 2 and pool.num_open() == 2
    waiter = asyncio.ensure_future(pool.checkout(2))
    await asyncio.sleep(0.01)
    assert not waiter.done(), "every connection is busy: the next batch must wait"
    pool.check_integrity()
    pool.release([first[0][0]])
    second = await asyncio.wait_for(waiter, 1.0)
    assert [slot for slot, _ in second] == [first[0][0]]  # only what is free
    pool.release([first[1][0]])
    pool.release([second[0][0]])
    with pytest.raises(AssertionError, match="twice"):
        pool.release([second[0][0]])
    await pool.aclose()


async def test_cancelled_waiter_passes_its_turn_on(server: RedisServer) -> None:
    pool = _pool(server.port, connections=1)
    ((slot, _),) = await pool.checkout(1)
    cancelled = asyncio.ensure_future(pool.checkout(1))
    patient = asyncio.ensure_future(pool.checkout(1))
    await asyncio.sleep(0.01)
    pool.release([slot])  # wakes `cancelled` ...
    cancelled.cancel()  # ... which gives its turn to `patient`
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    ((slot2, conn),) = await asyncio.wait_for(patient, 1.0)
    assert slot2 == slot and not conn.closed
    pool.release([slot2])
    pool.check_integrity()
    await pool.aclose()


async def test_close_fails_waiting_checkouts(server: RedisServer) -> None:
    pool = _pool(server.port, connections=1)
    await pool.checkout(1)
    waiter = asyncio.ensure_future(pool.checkout(1))
    await asyncio.sleep(0.01)
    await pool.aclose()
    with pytest.raises(RemoteUnavailable, match="pool closed"):
        await waiter


async def test_failed_connect_checks_nothing_out(redis_bin: str) -> None:
    pool = _pool(free_port())  # nothing listens there
    with pytest.raises(RemoteUnavailable, match="connection"):
        await pool.checkout(2)
    with pytest.raises(RemoteUnavailable):
        await pool.checkout(2)  # slots were released: no deadlock, a fresh attempt
    await pool.aclose()
