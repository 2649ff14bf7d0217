"""``RedisTier``: the L3 envelope store on Redis or Redis Cluster (mechanism only).

Every value is ``wire`` header + payload under a key from ``keys``; the key names the kind
and layout fingerprint the header must carry, and the header's MAC tag (``mac``, keyed from
``config.mac_key``) authenticates key, header and payload. A payload over ``chunk_bytes`` is
split into parts, one Redis value each (``split``), invisibly to callers: its head (part 0)
is at the key and is written last. Data travels on ``resp.RespConnection``s (``connections`` per
node), control (slot map, ``SCAN``) through redis-py.

Failure contract: a server that is down, slow or behind an open breaker makes ``get_many``
return ``None`` and ``put_many`` return ``False`` for the affected keys — counted, logged at
most per state change, never raised. A stored value failing any check is a miss and is
deleted (a tag that does not verify is also counted as ``num_mac_failures``). Misuse raises
``BadKey`` / ``ValueTooLarge`` / ``ValueError`` before any I/O.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from remote_tier import split, wire
from remote_tier.buffers import BufferPool
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import CorruptValue
from remote_tier.keys import KeyParts, is_part_key, parse_key, part_key, raw_key, scan_pattern
from remote_tier.mac import Mac, user_secret
from remote_tier.reads import ReadBatch
from remote_tier.router import Router
from remote_tier.stats import Counters, RemoteTierStats
from remote_tier.transfer import execute
from remote_tier.writes import SetBatch, Writer

if TYPE_CHECKING:
    from typing_extensions import Buffer

T = TypeVar("T")
_SCAN_COUNT = 1000
# Payloads from ``Mac.offload_bytes`` up are signed and verified on worker threads (BLAKE3
# releases the GIL), all of a batch at once, while the loop moves other batches' bytes.
_HASH_THREADS = max(2, min(8, os.cpu_count() or 1))
_GROUP_BYTES = 2 << 20  # payload bytes per hand-off to a hashing thread (about 0.5 ms)


class RedisTier:
    """An async envelope store. ``async with RedisTier(config) as tier`` or
    ``tier = await RedisTier.connect(config)`` … ``await tier.aclose()``.

    One event loop owns a tier; its bookkeeping takes no locks (there is no thread to race).
    ``clock`` drives the circuit breakers (tests inject a fake one). ``mac`` signs and
    verifies values: by default keyed from ``config.mac_key`` (or this user's key file);
    ``tierstore bench mac`` passes another to measure the MAC's cost. Raises
    ``mac.MacKeyError`` when the user's key file is needed and cannot be made or read.
    """

    def __init__(
        self,
        config: RemoteTierConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        mac: Mac | None = None,
    ) -> None:
        self.config = config
        if mac is None:
            mac = Mac(user_secret() if config.mac_key is None else config.mac_key)
        self.mac = mac
        self._counters = Counters()
        self._router = Router(config, self._counters, clock=clock)
        self._writer = Writer(self._router, self._counters, config)
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._buffers = BufferPool(config.recv_pool_bytes)
        self._hasher: ThreadPoolExecutor | None = None  # started on the first large value
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
        """Close every connection and the hashing threads; the tier cannot be used
        afterwards."""
        self._closed = True
        await self._router.aclose()
        if self._hasher is not None:
            self._hasher.shutdown(wait=False)

    # -- keys -----------------------------------------------------------------------------------

    def raw_key(self, key: str) -> str:
        """The Redis key under this tier's prefix for an engine-supplied key."""
        return raw_key(self.config.key_prefix, key)

    def _parse(self, keys: Sequence[str]) -> list[KeyParts]:
        prefix = self.config.key_prefix
        return [parse_key(prefix, k) for k in keys]

    # -- data path ------------------------------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store ``(key, payload)`` pairs; ``True`` where the server acknowledged the write
        (of every part, for a payload over ``chunk_bytes``).

        With ``ordered_writes`` (default) a batch becomes visible strictly in the order given
        (parent first): an item is sent only behind earlier ones on the same connection, or
        after they are acknowledged; after the first failure nothing later becomes visible (a
        later item already in flight is deleted again, as are the parts of items that did not
        become visible). Raises ``ValueTooLarge``/``BadKey`` before writing anything. Payloads
        are read during the call only (never kept or copied).
        """
        self._check_open()
        prefix = self.config.key_prefix
        batch = SetBatch(() if self._ttl_ms is None else ("PX", self._ttl_ms))
        # validate and sign the whole batch before any I/O
        todo = [(key, parse_key(prefix, key), wire.as_bytes_view(data)) for key, data in items]
        for values in await self._offload(
            [partial(split.values_of, k, kp, p, self.config, self.mac) for k, kp, p in todo],
            [len(p) for _, _, p in todo],
        ):
            batch.add(values)
        ok = [False] * len(items)
        if items and await self._router.ensure_topology():
            ok = await self._writer.put(batch)
        c = self._counters
        c.num_puts += sum(ok)
        c.num_put_failures += len(ok) - sum(ok)
        c.bytes_out += sum(n for n, good in zip(batch.payload_sizes, ok, strict=True) if good)
        return ok

    async def get_many(
        self, keys: Sequence[str], out: Sequence[Buffer] | None = None
    ) -> list[memoryview | None]:
        """The payloads of ``keys`` in order, ``None`` for a miss.

        Without ``out`` each payload is a view into a receive buffer of the tier's, reused only
        once nothing refers to it any more (``BufferPool``): keep it as long as needed. With
        ``out`` (one writable buffer per key, exactly the payload's size) the payload is
        received straight into ``out[i]`` and the view returned is ``out[i]``; a value of
        another size is a miss (``size_mismatch``). A value failing a check, or split with a
        part missing, is a miss and is deleted. On a miss ``out[i]`` may have been overwritten.

        One round trip reads every head, and with ``out`` every part this tier's
        ``chunk_bytes`` predicts; the parts of other split values take one more.
        """
        self._check_open()
        parts = self._parse(keys)
        outs = None if out is None else [_writable(b) for b in out]
        if outs is not None and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        chunk, router, c = self.config.chunk_bytes, self._router, self._counters
        keys_b = [k.encode() for k in keys]
        reads = ReadBatch(
            keys_b,
            parts,
            outs,
            chunk_bytes=chunk,
            buffers=self._buffers,
            counters=c,
        )
        if outs:  # the sizes to expect are known: size the batches by them
            router.note_values(len(reads.fetch), sum(len(o) for o in outs))
        later = reads.take_heads(await router.mget(reads.fetch, reads.sinks))
        if later:
            split.take_parts(later, await router.mget(*split.part_requests(later)))
        num_values = reads.finish()
        checks = [check for _, check in reads.checks]
        reads.settle(
            await self._offload(
                [partial(check.passes, self.mac) for check in checks],
                [len(check.payload) for check in checks],
            )
        )
        results = reads.results
        hits = sum(r is not None for r in results)
        c.num_hits += hits
        c.num_misses += len(keys) - hits
        num_bytes = sum(len(r) for r in results if r is not None)
        c.bytes_in += num_bytes
        router.note_values(num_values, num_bytes)
        if reads.absent:  # MGET reads a LIST (any non-string) as nil: find those
            reads.corrupt += await self._wrong_types(
                [keys_b[i] for i in reads.absent], [parts[i].kind for i in reads.absent]
            )
        if reads.corrupt or reads.useless:
            dropped, _ = await asyncio.gather(
                router.unlink(reads.corrupt), router.unlink(reads.useless)
            )
            c.num_corrupt_deleted += dropped
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
        """Delete ``keys`` (``UNLINK``), each with every part of a split value; the number of
        keys that existed. Unreachable nodes count 0."""
        self._check_open()
        self._parse(keys)
        keys_b = [k.encode() for k in keys]
        deleted = await self._drop(keys_b + await self._parts_of(keys_b))
        self._counters.num_deleted += deleted
        return deleted

    async def clear(self, layout_fp: str | None = None) -> int:
        """Delete every key of this tier's prefix (or of one layout fingerprint in it) and
        nothing else; the number of values deleted (a split value counts once: its other
        parts, and parts left without a head, are deleted uncounted). Raises
        ``RemoteUnavailable`` if Redis is down."""
        self._check_open()
        pattern = scan_pattern(self.config.key_prefix, layout_fp)
        batch: list[bytes] = []
        deleted = 0
        async for key in self._router.topology.scan(pattern, _SCAN_COUNT):
            batch.append(key.encode())
            if len(batch) >= _SCAN_COUNT:
                deleted += await self._drop(batch)
                batch = []
        deleted += await self._drop(batch)
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

    async def _offload(self, jobs: list[Callable[[], T]], sizes: list[int]) -> list[T]:
        """Each job's result: those of ``mac.offload_bytes`` or more run on the hashing
        threads, grouped into runs of about ``_GROUP_BYTES`` (one hand-off each: a hand-off
        costs the loop tens of microseconds), all at once; the rest here meanwhile. A job's
        exception is raised once all are done."""
        least = self.mac.offload_bytes
        far = [i for i, size in enumerate(sizes) if size >= least]
        if not far:
            return [job() for job in jobs]
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="tierstore-mac")
        groups: list[list[int]] = [[]]
        group_bytes = 0
        for i in far:
            if group_bytes >= _GROUP_BYTES:
                groups.append([])
                group_bytes = 0
            groups[-1].append(i)
            group_bytes += sizes[i]
        loop = asyncio.get_running_loop()
        futures = [
            loop.run_in_executor(self._hasher, _run_all, [jobs[i] for i in group])
            for group in groups
        ]
        got: dict[int, T | BaseException] = {}
        offloaded = set(far)
        for i, job in enumerate(jobs):
            if i not in offloaded:
                try:
                    got[i] = job()
                except Exception as exc:  # raised below, once the workers are done
                    got[i] = exc
        for group, done in zip(groups, await asyncio.gather(*futures, return_exceptions=True),
                               strict=True):
            if isinstance(done, BaseException):
                raise done
            got.update(zip(group, done, strict=True))
        results: list[T] = []
        for i in range(len(jobs)):
            result = got[i]
            if isinstance(result, BaseException):
                raise result
            results.append(result)
        return results

    async def _parts_of(self, keys_b: list[bytes]) -> list[bytes]:
        """The keys of the other parts of every split value among ``keys_b``, read from the
        heads' headers (one ``GETRANGE`` each)."""
        grouped = await self._router.run_keyed(
            "GETRANGE", keys_b, 1, None, args=(0, wire.MAX_HEADER_BYTES - 1)
        )
        found: list[bytes] = []
        for group, reply in grouped:
            if not isinstance(reply, (bytes, bytearray, memoryview)):
                continue  # absent, unreachable, or not a string
            try:
                header, _ = wire.read_header(memoryview(reply))
            except CorruptValue:
                continue
            found += [part_key(keys_b[group[0]], i) for i in range(1, header.num_parts)]
        return found

    async def _wrong_types(self, keys_b: list[bytes], classes: list[str]) -> list[bytes]:
        """The keys among ``keys_b`` (each read as nil) that hold another Redis type than a
        string, each counted and logged (rate-limited, per key class) as ``wrongtype``. A key
        written or deleted meanwhile reads ``string`` / ``none`` and is left alone."""
        wrong: list[bytes] = []
        for group, reply in await self._router.run_keyed("TYPE", keys_b, 1, None):
            kind = reply.decode() if isinstance(reply, (bytes, bytearray)) else reply
            if isinstance(kind, str) and kind not in ("string", "none"):
                i = group[0]
                wrong.append(keys_b[i])
                self._counters.anomaly("wrongtype", classes[i], f"a {kind} at {keys_b[i][:80]!r}")
        return wrong

    async def _drop(self, keys_b: list[bytes]) -> int:
        """``UNLINK`` ``keys_b``; how many existed, parts of split values not counted."""
        heads = [k for k in keys_b if not is_part_key(k)]
        parts = [k for k in keys_b if is_part_key(k)]
        deleted, _ = await asyncio.gather(self._router.unlink(heads), self._router.unlink(parts))
        return deleted

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RedisTier is closed")


def _run_all(jobs: list[Callable[[], T]]) -> list[T]:
    """Every job's result, in order (one hashing thread's share)."""
    return [job() for job in jobs]


def _writable(buf: Buffer) -> memoryview:
    view = wire.as_bytes_view(buf)
    if view.readonly:
        raise ValueError("output buffers must be writable")
    return view
