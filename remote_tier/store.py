"""``RedisTier``: the L3 envelope store on Redis or Redis Cluster (mechanism only).

Every value is ``wire`` header + payload under a key from ``keys``; the key names the kind
and layout fingerprint the header must carry. Data travels on ``resp.RespConnection``s
(``connections`` per node), control (slot map, ``SCAN``) through redis-py.

Failure contract: a server that is down, slow or behind an open breaker makes ``get_many``
return ``None`` and ``put_many`` return ``False`` for the affected keys — counted, logged at
most per state change, never raised. A stored value failing any check is a miss and is
deleted. Misuse raises ``BadKey`` / ``ValueTooLarge`` / ``ValueError`` before any I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from remote_tier import wire
from remote_tier.buffers import BufferPool
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import CorruptValue, Moved, RemoteUnavailable, ValueTooLarge
from remote_tier.keys import KeyParts, parse_key, raw_key, scan_pattern
from remote_tier.resp import Arg, BulkSink, Reply
from remote_tier.router import Router
from remote_tier.stats import Counters, RemoteTierStats
from remote_tier.topology import Address
from remote_tier.transfer import execute, send_sets

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

_SCAN_COUNT = 1000
_POOLED_MIN_BYTES = 64 * 1024


class RedisTier:
    """An async envelope store. ``async with RedisTier(config) as tier`` or
    ``tier = await RedisTier.connect(config)`` … ``await tier.aclose()``.

    One event loop owns a tier; its bookkeeping takes no locks (there is no thread to race).
    ``clock`` drives the circuit breakers (tests inject a fake one).
    """

    def __init__(
        self, config: RemoteTierConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._counters = Counters()
        self._router = Router(config, self._counters, clock=clock)
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._buffers = BufferPool(config.recv_pool_bytes)
        self._closed = False

    @classmethod
    async def connect(
        cls, config: RemoteTierConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> RedisTier:
        """A started tier (a cluster's slot map is loaded now if reachable)."""
        tier = cls(config, clock=clock)
        await tier.start()
        return tier

    async def start(self) -> None:
        """Load the cluster slot map; an unreachable cluster is retried on later calls."""
        await self._router.ensure_topology()

    async def __aenter__(self) -> RedisTier:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every connection; the tier cannot be used afterwards."""
        self._closed = True
        await self._router.aclose()

    # -- keys -----------------------------------------------------------------------------------

    def raw_key(self, key: str) -> str:
        """The Redis key under this tier's prefix for an engine-supplied key."""
        return raw_key(self.config.key_prefix, key)

    def _parse(self, keys: Sequence[str]) -> list[KeyParts]:
        prefix = self.config.key_prefix
        return [parse_key(prefix, k) for k in keys]

    # -- data path ------------------------------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store ``(key, payload)`` pairs; ``True`` where the server acknowledged the write.

        With ``ordered_writes`` (default) a batch becomes visible strictly in the order given
        (parent first): an item is sent only behind earlier ones on the same connection, or
        after they are acknowledged; after the first failure nothing later is written (a later
        item already in flight is deleted again). Raises ``ValueTooLarge``/``BadKey`` before
        writing anything. Payloads are read during the call only (never kept).
        """
        self._check_open()
        prefix, limit = self.config.key_prefix, self.config.max_value_bytes
        ttl: tuple[Arg, ...] = () if self._ttl_ms is None else ("PX", self._ttl_ms)
        keys_b: list[bytes] = []
        commands: list[Sequence[Arg]] = []
        sizes: list[int] = []  # payload bytes: what the pipeline window counts
        for key, data in items:  # validate the whole batch before any I/O
            parts = parse_key(prefix, key)
            payload = wire.as_bytes_view(data)
            header = wire.encode_header(parts.kind, parts.layout_fp, payload)
            size = len(header) + len(payload)
            if size > limit:
                raise ValueTooLarge(
                    f"value for {key[:80]!r} is {size} bytes, max_value_bytes is {limit}"
                )
            key_b = key.encode()
            keys_b.append(key_b)
            commands.append(("SET", key_b, (header, payload), *ttl))
            sizes.append(len(payload))
        ok = [False] * len(items)
        if items and await self._router.ensure_topology():
            if self.config.ordered_writes:
                await self._put_ordered(keys_b, commands, sizes, ok)
            else:
                await self._put_unordered(keys_b, commands, sizes, ok)
        c = self._counters
        c.num_puts += sum(ok)
        c.num_put_failures += len(ok) - sum(ok)
        c.bytes_out += sum(size for size, good in zip(sizes, ok, strict=True) if good)
        return ok

    async def get_many(
        self, keys: Sequence[str], out: Sequence[Buffer] | None = None
    ) -> list[memoryview | None]:
        """The payloads of ``keys`` in order, ``None`` for a miss.

        Without ``out`` each payload is a view into a receive buffer of the tier's, reused only
        once nothing refers to it any more (``BufferPool``): keep it as long as needed. With
        ``out`` (one writable buffer per key, exactly the payload's size) the payload is
        received straight into ``out[i]`` and the view returned is ``out[i]``; a value of
        another size is a miss (``size_mismatch``). A value failing a check is a miss and is
        deleted. On a miss ``out[i]`` may have been overwritten.
        """
        self._check_open()
        parts = self._parse(keys)
        outs = None if out is None else [_writable(b) for b in out]
        if outs is not None and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        if outs:  # the sizes to expect are known: size the batches by them
            self._router.note_values(len(outs), sum(len(o) for o in outs))
        keys_b = [k.encode() for k in keys]
        sinks: list[BulkSink] = (
            [self._pooled_sink] * len(keys)
            if outs is None
            else [_sink(pt, o) for pt, o in zip(parts, outs, strict=True)]
        )
        replies: list[Reply | Exception] = [None] * len(keys)
        grouped = await self._router.run_keyed(
            "MGET", keys_b, self.config.batch_keys, sinks, reads_values=True
        )
        for group, reply in grouped:
            values = reply if isinstance(reply, list) and len(reply) == len(group) else None
            for pos, i in enumerate(group):
                replies[i] = reply if values is None else values[pos]
        results: list[memoryview | None] = [None] * len(keys)
        corrupt: list[bytes] = []
        for i, reply in enumerate(replies):
            payload, bad = self._accept(reply, parts[i], None if outs is None else outs[i])
            results[i] = payload
            if bad:
                corrupt.append(keys_b[i])
        hits = sum(r is not None for r in results)
        c = self._counters
        c.num_hits += hits
        c.num_misses += len(keys) - hits
        num_bytes = sum(len(r) for r in results if r is not None)
        c.bytes_in += num_bytes
        self._router.note_values(hits, num_bytes)
        if corrupt:
            c.num_corrupt_deleted += await self._unlink(corrupt)
        return results

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, exist — probing ``batch_keys`` per round and
        stopping at the first miss (an unreachable node is a miss). Presence only: values
        are not read or checked here."""
        self._check_open()
        self._parse(keys)
        keys_b = [k.encode() for k in keys]
        found = 0
        step = self.config.batch_keys
        for lo in range(0, len(keys_b), step):
            hit = [False] * min(step, len(keys_b) - lo)
            for group, reply in await self._router.run_keyed(
                "EXISTS", keys_b[lo : lo + step], 1, None
            ):
                hit[group[0]] = reply == 1
            for present in hit:
                if not present:
                    return found
                found += 1
        return found

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, probed in one batch (an unreachable node reads absent)."""
        self._check_open()
        self._parse(keys)
        present = [False] * len(keys)
        keys_b = [k.encode() for k in keys]
        for group, reply in await self._router.run_keyed("EXISTS", keys_b, 1, None):
            present[group[0]] = reply == 1
        return present

    async def delete_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` (``UNLINK``); the number that existed. Unreachable nodes count 0."""
        self._check_open()
        self._parse(keys)
        deleted = await self._unlink([k.encode() for k in keys])
        self._counters.num_deleted += deleted
        return deleted

    async def clear(self, layout_fp: str | None = None) -> int:
        """Delete every key of this tier's prefix (or of one layout fingerprint in it) and
        nothing else; the number deleted. Raises ``RemoteUnavailable`` if Redis is down."""
        self._check_open()
        pattern = scan_pattern(self.config.key_prefix, layout_fp)
        batch: list[bytes] = []
        deleted = 0
        async for key in self._router.topology.scan(pattern, _SCAN_COUNT):
            batch.append(key.encode())
            if len(batch) >= _SCAN_COUNT:
                deleted += await self._unlink(batch)
                batch = []
        if batch:
            deleted += await self._unlink(batch)
        self._counters.num_deleted += deleted
        return deleted

    async def ping(self) -> bool:
        """Whether every known node answers ``PING`` now (health checks)."""
        self._check_open()
        router = self._router
        if not await router.ensure_topology():
            return False
        pools = list(router.pools.values()) or [router.pool(router.address_of(b"-"))]
        replies = await asyncio.gather(
            *(execute(p, [("PING",)], None, self._counters) for p in pools)
        )
        return all(r[0] == "PONG" for r in replies)

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> RemoteTierStats:
        """A snapshot of the counters and of every node's breaker state."""
        breakers = {p.address: p.breaker.state for p in self._router.pools.values()}
        return self._counters.snapshot(breakers)

    def check_integrity(self) -> None:
        """Assert the bookkeeping is consistent (tests and the idle loop call this)."""
        c = self._counters
        assert min(c.num_hits, c.num_misses, c.bytes_in, c.bytes_out) >= 0, "negative counter"
        assert all(v >= 0 for v in c.errors.values()), f"negative error count {c.errors}"
        for (host, port), pool in self._router.pools.items():
            assert pool.address == f"{host}:{port}", f"pool {pool.address} filed at {host}:{port}"
            pool.check_integrity()

    # -- internals ------------------------------------------------------------------------------

    def _accept(
        self, reply: Reply | Exception, parts: KeyParts, out: memoryview | None
    ) -> tuple[memoryview | None, bool]:
        """The payload in one GET reply (or None), and whether the value was corrupt."""
        if reply is None or isinstance(reply, Exception):
            return None, False
        try:
            if isinstance(reply, tuple) and len(reply) == 1:  # received into a pooled buffer
                payload = wire.decode(reply[0], kind=parts.kind, layout_fp=parts.layout_fp)
            elif isinstance(reply, tuple):  # received as (header scratch, out)
                head, payload = reply
                header, size = wire.read_header(head)
                if size != len(head):
                    raise CorruptValue(f"header is {size} bytes, expected {len(head)}")
                wire.verify(header, payload, kind=parts.kind, layout_fp=parts.layout_fp)
                return payload, False
            elif isinstance(reply, (bytes, bytearray, memoryview)):
                payload = wire.decode(reply, kind=parts.kind, layout_fp=parts.layout_fp)
            else:
                raise CorruptValue(f"reply of type {type(reply).__name__}")
        except CorruptValue as exc:
            log.warning("corrupt value (%s); deleting it", exc)
            self._counters.error("corrupt")
            return None, True
        if out is not None:  # a value whose header size was unexpected came in whole
            if len(payload) != len(out):
                self._counters.error("size_mismatch")
                return None, False
            out[:] = payload
            return out, False
        return payload, False

    def _pooled_sink(self, _: int, length: int) -> Sequence[memoryview] | None:
        """Receive a large value into a reusable buffer (small ones: a fresh bytearray)."""
        return (self._buffers.take(length),) if length >= _POOLED_MIN_BYTES else None

    async def _unlink(self, keys_b: list[bytes]) -> int:
        replies = await self._router.run_keyed("UNLINK", keys_b, self.config.batch_keys, None)
        return sum(r for _, r in replies if isinstance(r, int))

    async def _put_ordered(
        self, keys_b: list[bytes], commands: list[Sequence[Arg]], sizes: list[int], ok: list[bool]
    ) -> None:
        """Runs of consecutive items on one node go on one connection; the next run starts
        after the previous one is acknowledged."""
        pos, refreshed, n = 0, False, len(keys_b)
        while pos < n:
            try:
                address = self._router.address_of(keys_b[pos])
                end = pos + 1
                while end < n and self._router.address_of(keys_b[end]) == address:
                    end += 1
            except RemoteUnavailable as exc:
                self._counters.error(exc.reason)
                break
            run = range(pos, end)
            outcomes = await send_sets(
                self._router.pool(address),
                commands,
                sizes,
                run,
                self.config.pipeline_bytes,
                self._counters,
                stop_on_failure=True,
            )
            first_bad = next((i for i in run if outcomes.get(i) is not True), end)
            for i in range(pos, first_bad):
                ok[i] = True
            if first_bad == end:
                pos = end
            elif isinstance(outcomes.get(first_bad), Moved) and not refreshed:
                refreshed = True  # resume at first_bad: later items are written again
                await self._router.refresh()
                pos = first_bad
            else:
                orphans = [keys_b[i] for i in range(first_bad + 1, end) if outcomes.get(i) is True]
                if orphans:  # written behind a failed parent: take them back
                    await self._unlink(orphans)
                break

    async def _put_unordered(
        self, keys_b: list[bytes], commands: list[Sequence[Arg]], sizes: list[int], ok: list[bool]
    ) -> None:
        """Every node's items split over its connections, all concurrently."""
        todo = list(range(len(keys_b)))
        for attempt in range(2):
            by_node: dict[Address, list[int]] = {}
            for i in todo:
                try:
                    by_node.setdefault(self._router.address_of(keys_b[i]), []).append(i)
                except RemoteUnavailable as exc:
                    self._counters.error(exc.reason)
            jobs = []
            for address, idxs in by_node.items():
                pool = self._router.pool(address)
                shares = min(pool.size, len(idxs))
                for s in range(shares):
                    share = idxs[s * len(idxs) // shares : (s + 1) * len(idxs) // shares]
                    jobs.append(
                        send_sets(
                            pool,
                            commands,
                            sizes,
                            share,
                            self.config.pipeline_bytes,
                            self._counters,
                            stop_on_failure=False,
                        )
                    )
            todo = []
            for outcomes in await asyncio.gather(*jobs):
                for i, outcome in outcomes.items():
                    ok[i] = outcome is True
                    if isinstance(outcome, Moved):
                        todo.append(i)
            if not todo or attempt:
                return
            await self._router.refresh()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RedisTier is closed")


def _writable(buf: Buffer) -> memoryview:
    view = wire.as_bytes_view(buf)
    if view.readonly:
        raise ValueError("output buffers must be writable")
    return view


def _sink(parts: KeyParts, out: memoryview) -> BulkSink:
    """Receive a value of the expected size as (header scratch, ``out``); else let the
    connection allocate (the value is then checked, and rejected, as a whole)."""
    head_size = wire.header_size(parts.kind, parts.layout_fp, len(out))

    def sink(_: int, length: int) -> Sequence[memoryview] | None:
        if length != head_size + len(out):
            return None
        return (memoryview(bytearray(head_size)), out)

    return sink
