"""Moving batches of commands to one node: grouping, spreading over connections, the SET
window, and the node's circuit breaker around each call.

A *node call* is one batch sent to one node; the breaker records one success or failure per
call, so a dead server opens it after ``breaker_failures`` calls, and while it is open a call
costs a dictionary lookup and no I/O.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import TypeAlias

from remote_tier.errors import Moved, RemoteTierError, RemoteUnavailable, ServerError
from remote_tier.keys import key_slot
from remote_tier.pool import NodePool
from remote_tier.resp import Arg, BulkSink, Reply, RespConnection
from remote_tier.stats import Counters

Outcome: TypeAlias = "bool | RemoteTierError"  # True: acknowledged; else why not


def group_keys(
    keys_b: Sequence[bytes], idxs: Sequence[int], *, cluster: bool, max_keys: int, spread: int
) -> list[list[int]]:
    """Split key indexes into groups for multi-key commands, order kept within a slot.

    Groups hold at most ``max_keys`` keys, and few enough that there are at least ``spread``
    groups when there are that many keys (so they can travel on ``spread`` connections). On
    a cluster a group never mixes hash slots (multi-key commands must not).
    """
    per = max(1, min(max_keys, -(-len(idxs) // spread)))
    if not cluster:
        return [list(idxs[j : j + per]) for j in range(0, len(idxs), per)]
    by_slot: dict[int, list[int]] = {}
    for i in idxs:
        by_slot.setdefault(key_slot(keys_b[i]), []).append(i)
    return [g[j : j + per] for g in by_slot.values() for j in range(0, len(g), per)]


async def execute(
    pool: NodePool,
    commands: Sequence[Sequence[Arg]],
    sinks: Sequence[BulkSink | None] | None,
    counters: Counters,
    *,
    owns_buffers: bool = False,
) -> list[Reply | Exception]:
    """Send ``commands`` to one node, spread over up to ``pool.size`` connections in
    contiguous shares; one reply per command, or the exception that stopped it.

    ``owns_buffers``: sinks write into caller memory, so a cancelled call aborts its
    connections — no reply may land in a buffer the caller has taken back.
    """
    if not pool.breaker.allow():
        counters.error("circuit_open")
        return [RemoteUnavailable("circuit_open", pool.address)] * len(commands)
    conns: list[RespConnection] = []
    try:
        conns = await pool.acquire(min(len(commands), pool.size))
        if any(conn.closed for conn in conns):  # died while others connected: send nothing
            raise RemoteUnavailable("connection", f"{pool.address}: connection lost")
        futures: list[asyncio.Future[Reply]] = []
        for s, conn in enumerate(conns):
            lo = s * len(commands) // len(conns)
            hi = (s + 1) * len(commands) // len(conns)
            futures += conn.send(commands[lo:hi], None if sinks is None else sinks[lo:hi])
        replies: list[Reply | Exception] = []
        for reply in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(reply, BaseException) and not isinstance(reply, Exception):
                raise reply  # cancellation of one reply cancels the call
            replies.append(reply)
    except RemoteUnavailable as exc:
        pool.breaker.record_failure()
        counters.error(exc.reason)
        return [exc] * len(commands)
    except BaseException:
        pool.breaker.abandon()
        if owns_buffers:
            for conn in conns:
                conn.abort()
        raise
    _record(pool, replies, counters)
    return replies


async def send_sets(
    pool: NodePool,
    commands: Sequence[Sequence[Arg]],
    sizes: Sequence[int],
    idxs: Sequence[int],
    window_bytes: int,
    counters: Counters,
    *,
    stop_on_failure: bool,
) -> dict[int, Outcome]:
    """Send the SET ``commands[i]`` for ``i`` in ``idxs``, in order, on one connection, with
    at most ``window_bytes`` of values in flight (a larger value travels alone: Redis reads a
    big argument straight into its object only when it is not queued behind another).

    With ``stop_on_failure`` nothing more is sent once a reply fails; items not sent are
    absent from the result.
    """
    if not pool.breaker.allow():
        counters.error("circuit_open")
        return {i: RemoteUnavailable("circuit_open", pool.address) for i in idxs}
    outcomes: dict[int, Outcome] = {}
    try:
        (conn,) = await pool.acquire(1)
        inflight: deque[tuple[int, asyncio.Future[Reply]]] = deque()
        inflight_bytes = 0
        pos, stopped = 0, False
        while pos < len(idxs) and not stopped and not conn.closed:
            while inflight and inflight_bytes + sizes[idxs[pos]] > window_bytes:
                j, fut = inflight.popleft()
                inflight_bytes -= sizes[j]
                outcomes[j] = await _outcome(fut)
                if stop_on_failure and outcomes[j] is not True:
                    stopped = True
                    break
            if stopped or conn.closed:
                break
            group = [idxs[pos]]  # every item that fits the window now goes in one write
            inflight_bytes += sizes[idxs[pos]]
            pos += 1
            while pos < len(idxs) and inflight_bytes + sizes[idxs[pos]] <= window_bytes:
                group.append(idxs[pos])
                inflight_bytes += sizes[idxs[pos]]
                pos += 1
            futures = conn.send([commands[i] for i in group])
            inflight.extend(zip(group, futures, strict=True))
        for j, fut in inflight:
            outcomes[j] = await _outcome(fut)
    except RemoteUnavailable as exc:
        pool.breaker.record_failure()
        counters.error(exc.reason)
        return {i: outcomes.get(i, exc) for i in idxs}
    except BaseException:
        pool.breaker.abandon()
        raise
    for i in idxs:
        if i not in outcomes and not stop_on_failure:
            outcomes[i] = RemoteUnavailable("connection", "connection closed mid-batch")
    _record(pool, list(outcomes.values()), counters)
    return outcomes


async def _outcome(fut: asyncio.Future[Reply]) -> Outcome:
    try:
        reply = await fut
    except RemoteTierError as exc:
        return exc
    if reply == "OK":
        return True
    return reply if isinstance(reply, ServerError) else ServerError(f"SET replied {reply!r}")


def _record(pool: NodePool, replies: Sequence[object], counters: Counters) -> None:
    """One breaker verdict and error count per node call."""
    failure = next(
        (r for r in replies if isinstance(r, RemoteTierError) and not isinstance(r, ServerError)),
        None,
    )
    if failure is None:
        pool.breaker.record_success()
    else:
        pool.breaker.record_failure()
        counters.error(failure.reason if isinstance(failure, RemoteUnavailable) else "protocol")
    num_moved = sum(isinstance(r, Moved) for r in replies)
    num_server = sum(isinstance(r, ServerError) for r in replies) - num_moved
    if num_moved:
        counters.error("moved", num_moved)
    if num_server:
        counters.error("server", num_server)
