"""Moving batches of commands to one node: grouping, spreading over connections, the byte
window, and the node's circuit breaker around each call.

A *node call* is one batch sent to one node; the breaker records one success or failure per
call, so a dead server opens it after ``breaker_failures`` calls, and while it is open a call
costs a dictionary lookup and no I/O.

Every connection carries at most ``window_bytes`` of values at a time (a larger value
travels alone), reads and writes alike: Redis reads a big SET argument straight into its
object only when nothing is queued behind it, and it buffers and trickles out big replies
queued behind one another at about twice the CPU per byte.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeAlias

from remote_tier.errors import Moved, RemoteTierError, RemoteUnavailable, ServerError
from remote_tier.keys import key_slot
from remote_tier.pool import NodePool
from remote_tier.resp import Arg, BulkSink, Reply, RespConnection
from remote_tier.stats import Counters

Outcome: TypeAlias = "bool | RemoteTierError"  # a SET: True when acknowledged, else why not
Result: TypeAlias = "Reply | Exception"


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
    costs: Sequence[int] | None = None,
    window_bytes: int = 0,
    max_connections: int = 1,
    *,
    owns_buffers: bool = False,
) -> list[Result]:
    """Send ``commands`` to one node over up to ``max_connections`` connections (contiguous
    shares, each within the byte window by the expected ``costs``); one reply per command, or
    the exception that stopped it.

    ``owns_buffers``: sinks write into caller memory, so a cancelled call aborts its
    connections — no reply may land in a buffer the caller has taken back.
    """
    if not pool.breaker.allow():
        counters.error("circuit_open")
        return [RemoteUnavailable("circuit_open", pool.address)] * len(commands)
    try:
        checked = await pool.checkout(max(1, min(len(commands), max_connections, pool.size)))
    except RemoteUnavailable as exc:
        pool.breaker.record_failure()
        counters.error(exc.reason)
        return [exc] * len(commands)
    except BaseException:
        pool.breaker.abandon()
        raise
    replies: dict[int, Result] = {}
    try:
        costs = costs or [0] * len(commands)
        shares = []
        for s, (_, conn) in enumerate(checked):
            mine = range(s * len(commands) // len(checked), (s + 1) * len(commands) // len(checked))
            shares.append(_pipeline(conn, mine, commands, sinks, costs, window_bytes, replies))
        await asyncio.gather(*shares)
    except BaseException:
        pool.breaker.abandon()
        if owns_buffers:
            for _, conn in checked:
                conn.abort()
        raise
    finally:
        pool.release([i for i, _ in checked])
    results = [replies[i] for i in range(len(commands))]
    _record(pool, results, counters)
    return results


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
    at most ``window_bytes`` of payload (``sizes``) in flight.

    With ``stop_on_failure`` nothing more is sent once a reply fails; items not sent are
    absent from the result.
    """
    if not pool.breaker.allow():
        counters.error("circuit_open")
        return {i: RemoteUnavailable("circuit_open", pool.address) for i in idxs}
    try:
        ((slot, conn),) = await pool.checkout(1)
    except RemoteUnavailable as exc:
        pool.breaker.record_failure()
        counters.error(exc.reason)
        return {i: exc for i in idxs}
    except BaseException:
        pool.breaker.abandon()
        raise
    replies: dict[int, Result] = {}
    try:
        stop = (lambda r: r != "OK") if stop_on_failure else None
        await _pipeline(conn, idxs, commands, None, sizes, window_bytes, replies, stop)
    except BaseException:
        pool.breaker.abandon()
        raise
    finally:
        pool.release([slot])
    outcomes = {i: _outcome(r) for i, r in replies.items()}
    _record(pool, list(outcomes.values()), counters)
    return outcomes


async def _pipeline(
    conn: RespConnection,
    idxs: Sequence[int],
    commands: Sequence[Sequence[Arg]],
    sinks: Sequence[BulkSink | None] | None,
    costs: Sequence[int],
    window_bytes: int,
    replies: dict[int, Result],
    stop: Callable[[Result], bool] | None = None,
) -> None:
    """Send ``commands[i]`` for ``i`` in ``idxs`` in order on ``conn``, never more than
    ``window_bytes`` of ``costs`` in flight (but always one); store each reply. Once ``stop``
    holds for a reply nothing more is sent; without ``stop`` every unsent command gets the
    connection's failure."""
    inflight: deque[tuple[int, asyncio.Future[Reply]]] = deque()
    inflight_cost = 0
    pos, stopped = 0, False
    while pos < len(idxs) and not stopped and not conn.closed:
        while inflight and inflight_cost + costs[idxs[pos]] > window_bytes:
            j, fut = inflight.popleft()
            inflight_cost -= costs[j]
            replies[j] = await _settle(fut)
            if stop is not None and stop(replies[j]):
                stopped = True
                break
        if stopped or conn.closed:
            break
        group = [idxs[pos]]  # every command that fits the window now goes in one write
        inflight_cost += costs[idxs[pos]]
        pos += 1
        while pos < len(idxs) and inflight_cost + costs[idxs[pos]] <= window_bytes:
            group.append(idxs[pos])
            inflight_cost += costs[idxs[pos]]
            pos += 1
        futures = conn.send(
            [commands[i] for i in group], None if sinks is None else [sinks[i] for i in group]
        )
        inflight.extend(zip(group, futures, strict=True))
    for j, fut in inflight:
        replies[j] = await _settle(fut)
    if stop is None:
        lost = RemoteUnavailable("connection", "connection closed mid-batch")
        for i in idxs[pos:]:
            replies[i] = lost


async def _settle(fut: asyncio.Future[Reply]) -> Result:
    """A reply, or the tier error that replaced it (cancellation propagates)."""
    try:
        return await fut
    except RemoteTierError as exc:
        return exc


def _outcome(reply: Result) -> Outcome:
    if reply == "OK":
        return True
    if isinstance(reply, RemoteTierError):
        return reply
    return ServerError(f"SET replied {reply!r}")


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
