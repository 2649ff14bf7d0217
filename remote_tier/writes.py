"""``Writer``: a ``put_many`` batch onto the nodes — items in order or not, and each split
value's parts before its head, so a visible head means every part was acknowledged."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from remote_tier.config import RemoteTierConfig
from remote_tier.errors import Moved, RemoteUnavailable
from remote_tier.resp import Arg
from remote_tier.router import Router
from remote_tier.stats import Counters
from remote_tier.topology import Address
from remote_tier.transfer import send_sets


class SetBatch:
    """The SETs of one batch in order: per item, the other parts of a split value, then its
    head (its whole value, or part 0). Payload slices are referenced, never copied."""

    def __init__(self, ttl: tuple[Arg, ...]) -> None:
        self._ttl = ttl
        self.keys_b: list[bytes] = []
        self.commands: list[Sequence[Arg]] = []
        self.sizes: list[int] = []  # payload bytes per SET: what the byte window counts
        self.owners: list[int] = []  # the item of each SET
        self.heads: list[int] = []  # the index of each item's head SET
        self.payload_sizes: list[int] = []  # per item

    def add(self, values: list[tuple[bytes, bytes, memoryview]]) -> None:
        """Add one item: ``(Redis key, header, payload slice)`` per value, the head last."""
        item = len(self.heads)
        for key_b, header, body in values:
            self.keys_b.append(key_b)
            self.commands.append(("SET", key_b, (header, body), *self._ttl))
            self.sizes.append(len(body))
            self.owners.append(item)
        self.heads.append(len(self.keys_b) - 1)
        self.payload_sizes.append(sum(len(body) for _, _, body in values))


class Writer:
    """Sends ``SetBatch``es through a ``Router``; bookkeeping only, one event loop."""

    def __init__(self, router: Router, counters: Counters, config: RemoteTierConfig) -> None:
        self._router = router
        self._counters = counters
        self._config = config

    async def put(self, batch: SetBatch) -> list[bool]:
        """Write ``batch``; per item, whether every one of its values was acknowledged.

        With ``ordered_writes`` every SET goes in batch order (``_put_ordered``), so nothing
        of a later item is written after a failure. Without, parts of split items go first,
        then the heads of items whose parts all landed, each phase on every node and
        connection at once. Parts of a failed item are unlinked again (a head whose write
        failed is not visible; a part that timed out may have landed)."""
        acked = [False] * len(batch.keys_b)
        if self._config.ordered_writes:
            await self._put_ordered(batch.keys_b, batch.commands, batch.sizes, acked)
        else:
            heads = set(batch.heads)
            await self._put_some(batch, [i for i in range(len(acked)) if i not in heads], acked)
            whole = [True] * len(batch.heads)  # every part but the head acknowledged
            for i, good in enumerate(acked):
                whole[batch.owners[i]] = whole[batch.owners[i]] and (good or i in heads)
            await self._put_some(
                batch, [h for h, w in zip(batch.heads, whole, strict=True) if w], acked
            )
        ok = [acked[h] for h in batch.heads]
        failed = [i for i, good in enumerate(ok) if not good]
        if failed and self._config.ordered_writes:
            failed = failed[:1]  # later items were never sent (or are already taken back)
        doomed = set(failed)
        orphans = [
            key_b
            for i, key_b in enumerate(batch.keys_b)
            if batch.owners[i] in doomed and i != batch.heads[batch.owners[i]]
        ]
        if orphans:
            await self._router.unlink(orphans)
        return ok

    async def _put_some(self, batch: SetBatch, idxs: list[int], acked: list[bool]) -> None:
        """``_put_unordered`` for the SETs ``idxs`` of ``batch``."""
        got = [False] * len(idxs)
        await self._put_unordered(
            [batch.keys_b[i] for i in idxs],
            [batch.commands[i] for i in idxs],
            [batch.sizes[i] for i in idxs],
            got,
        )
        for i, good in zip(idxs, got, strict=True):
            acked[i] = good

    async def _put_ordered(
        self, keys_b: list[bytes], commands: list[Sequence[Arg]], sizes: list[int], ok: list[bool]
    ) -> None:
        """Runs of consecutive items on one node go on one connection; the next run starts
        after the previous one is acknowledged."""
        router, pos, refreshed, n = self._router, 0, False, len(keys_b)
        while pos < n:
            try:
                address = router.address_of(keys_b[pos])
                end = pos + 1
                while end < n and router.address_of(keys_b[end]) == address:
                    end += 1
            except RemoteUnavailable as exc:
                self._counters.error(exc.reason)
                break
            run = range(pos, end)
            outcomes = await send_sets(
                router.pool(address),
                commands,
                sizes,
                run,
                self._config.pipeline_bytes,
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
                await router.refresh()
                pos = first_bad
            else:
                orphans = [keys_b[i] for i in range(first_bad + 1, end) if outcomes.get(i) is True]
                if orphans:  # written behind a failed parent: take them back
                    await router.unlink(orphans)
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
                            self._config.pipeline_bytes,
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
