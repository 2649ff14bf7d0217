"""Same-host storage API: control calls over HTTP, bytes through the shared segment.

A client that authenticated over HTTP asks ``/v1/shm/attach`` for the segment's name and
nonce and maps it (it proves the mapping is this service's memory by the nonce, i.e. that it
runs on the same host). Then:

Every data call names the segment the client mapped (409 when it is not this service's).

- ``/v1/storage/shm_get`` pins the values of its keys under a read lease and answers
  ``[offset, length]`` per key (bytes inline for a value Redis had that host memory cannot
  take, nil for a miss); the client copies, then ``/v1/storage/shm_release`` ends the lease
  (``released: false`` means it expired first and the copy must be discarded). A client that
  need not wait for that answer may instead name finished leases in the ``release`` list of
  its next ``shm_get`` (or send them as ``leases`` in one ``shm_release``): one request less
  per read;
- ``/v1/storage/shm_reserve`` holds unpublished ranges; the client copies into them;
  ``/v1/storage/shm_commit`` makes them visible (and writes them through to Redis), or
  ``/v1/storage/shm_abort`` returns them. A commit sent again (its answer lost) gets the
  first answer for ``--lease-ttl`` seconds, or 409 ``reservation_superseded`` once a key of
  it was put or deleted since (:mod:`.kv_commits`). An uncommitted reservation is reclaimed after
  ``--reservation-ttl`` seconds: a client that dies between reserve and commit leaves nothing
  visible. A principal holds at most its reservation quota (count and bytes; 429
  ``reservation_quota`` beyond), the service at most ``max_reservations`` (503
  ``reservations_full``), and a reservation evicts only its own tenant's values.

- ``/v1/shm/fetch`` is ``/v1/fetch`` for a same-host client: the matched prefix's rows are
  copied (off the store's thread) into staged ranges of the segment, answered as
  ``[offset, length]`` per envelope under a read lease (503 ``shm_full`` when they do not fit:
  use ``/v1/fetch``).

Leases expire after ``--lease-ttl`` seconds. Leases and reservations belong to the principal
that took them: to anyone else they do not exist (``released: false``, 404, ``aborted: false``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

import msgpack
import torch
from aiohttp import web

from tierstore.service.access import principal, require_write, store_namespace
from tierstore.service.codec import MSGPACK, HTTPError, field, read_body, tokens_field
from tierstore.service.config import ServiceConfig
from tierstore.service.kv import KeyValueStore
from tierstore.service.kv_commits import CommitSuperseded
from tierstore.service.kv_host import Value
from tierstore.shm_client import copy_bytes
from tierstore.store import TierStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServiceCore(Protocol):
    """What the shared-memory routes use of the service (``app.Service`` implements it)."""

    store: TierStore
    config: ServiceConfig
    kv: KeyValueStore

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the store's thread."""
        ...

    def keys(self, request: web.Request, body: dict[str, Any]) -> list[str]:
        """The stored (tenant-scoped) keys a storage request names."""
        ...


class ShmRoutes:
    """The ``/v1/shm/*`` and ``/v1/storage/shm_*`` handlers of one service."""

    def __init__(self, service: ServiceCore) -> None:
        self.service = service
        self.kv = service.kv
        self._tasks: set[asyncio.Future[Any]] = set()

    def register(self, app: web.Application) -> None:
        """Add the routes and the task that expires leases and reservations."""
        app.router.add_post("/v1/shm/attach", self.attach)
        app.router.add_post("/v1/shm/fetch", self.fetch)
        app.router.add_post("/v1/storage/shm_get", self.get)
        app.router.add_post("/v1/storage/shm_release", self.release)
        app.router.add_post("/v1/storage/shm_reserve", self.reserve)
        app.router.add_post("/v1/storage/shm_commit", self.commit)
        app.router.add_post("/v1/storage/shm_abort", self.abort)
        app.cleanup_ctx.append(self._reaper)

    async def _reaper(self, app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                config = self.service.config
                await asyncio.sleep(min(1.0, config.lease_ttl_s / 4,
                                        config.reservation_ttl_s / 4))
                leases, reservations = self.kv.host.expire()
                if leases or reservations:
                    log.info("expired %d shared-memory leases, %d reservations", leases,
                             reservations)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    async def attach(self, request: web.Request) -> web.Response:
        segment = self.kv.host.segment
        if segment is None:
            raise HTTPError(503, "shm_unavailable", "this service keeps values in private "
                                                    "memory (no usable /dev/shm): use HTTP")
        config = self.service.config
        # max_batch: the most keys (and lease ids) one request may name; a client splits.
        return _msgpack({"segments": {"kv": {"name": segment.name, "nonce": segment.nonce,
                                             "nbytes": segment.nbytes}},
                         "lease_ttl_s": config.lease_ttl_s, "max_batch": config.max_batch,
                         "release_in_get": True})

    async def fetch(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        self._check(body)
        tokens = tokens_field(body, self.service.config.max_tokens)
        scoped = store_namespace(request, body)
        store = self.service.store
        read = await self.service.run(store.read_prefix, tokens, scoped)
        handed_off = False
        try:
            rows = [(kind, i, row) for kind, kind_rows in read.rows.items()
                    for i, row in enumerate(kind_rows) if row is not None]
            staged = self.kv.host.stage([row.numel() for _, _, row in rows])
            if staged is None:
                raise HTTPError(503, "shm_full", "the prefix's rows do not fit the shared "
                                                 "segment now: use /v1/fetch")
            # A bulk copy: neither on the loop nor on the store's thread.
            copy = asyncio.get_running_loop().run_in_executor(
                None, _copy_rows, [r for _, _, r in rows],
                [self.kv.host.tensor(v) for v in staged])
            try:
                await asyncio.shield(copy)
            except BaseException:  # failed or cancelled: clean up once the copy has stopped
                def cleanup(_: object, held: list[Value] = staged) -> None:
                    for value in held:
                        self.kv.host.unpin(value)
                    task = asyncio.ensure_future(self.service.run(read.close))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

                copy.add_done_callback(cleanup)
                handed_off = True
                raise
        finally:
            if not handed_off:
                await self.service.run(read.close)
        match = read.match
        out: dict[str, list[Any]] = {kind: [None] * len(kind_rows)
                                     for kind, kind_rows in read.rows.items()}
        for (kind, i, _), value in zip(rows, staged, strict=True):
            out[kind][i] = [value.start, value.length]
        lease = self.kv.host.lease(staged, principal(request).id) if staged else None
        return _msgpack({"matched_tokens": match.tokens, "pages": match.pages,
                         "checkpoint": match.tokens if match.state is not None else None,
                         "tiers": match.tiers, "lease": lease, "kv": out.get("kv", []),
                         "swa": out.get("swa", [None] * len(match.swa)),
                         "state": out["state"][0] if "state" in out else None})

    async def get(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        self._check(body)
        keys = self.service.keys(request, body)
        done = _lease_ids(body, "release", self.service.config.max_batch)
        who = principal(request).id
        released = sum(self.kv.host.end_lease(lease, who) for lease in done)
        found = await self.kv.lookup(keys)
        pinned = [v for v in found if isinstance(v, Value)]
        lease = self.kv.host.lease(pinned, who) if pinned else None
        values = [[v.start, v.length] if isinstance(v, Value) else v for v in found]
        return _msgpack({"lease": lease, "values": values, "released": released})

    async def release(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        who = principal(request).id
        if "leases" in body:  # a batch of finished reads whose answers nobody waits for
            done = _lease_ids(body, "leases", self.service.config.max_batch)
            return web.json_response({"released": sum(self.kv.host.end_lease(lease, who)
                                                      for lease in done)})
        lease = field(body, "lease", str)
        return web.json_response({"released": self.kv.host.end_lease(lease, who)})

    async def reserve(self, request: web.Request) -> web.Response:
        who = require_write(request)  # before the body: a refused write reads none of it
        body = await read_body(request)
        self._check(body)
        keys = self.service.keys(request, body)
        sizes = field(body, "sizes", list)
        if len(sizes) != len(keys) or not all(type(n) is int and n >= 0 for n in sizes):
            raise HTTPError(422, "wrong_shape", f"{len(keys)} keys need as many sizes "
                                                f"(non-negative ints), got {len(sizes)}")
        budget = self._budget(who.id, who.tenant.max_reservations,
                              who.tenant.max_reserved_bytes)
        res_id, values = self.kv.reserve(keys, sizes, who.id, budget=budget)
        return _msgpack({"reservation": res_id,
                         "slots": [None if v is None else [v.start, v.length]
                                   for v in values]})

    async def commit(self, request: web.Request) -> web.Response:
        who = require_write(request)  # before the body: a refused write reads none of it
        body = await read_body(request)
        res_id = field(body, "reservation", str)
        try:
            stored = await self.kv.commit(res_id, who.id, limit=who.tenant.max_value_bytes)
        except CommitSuperseded as exc:
            raise HTTPError(409, "reservation_superseded", str(exc)) from None
        if stored is None:
            raise HTTPError(404, "unknown_reservation", f"reservation {res_id:.24} is not held "
                            f"(aborted, expired after "
                            f"{self.service.config.reservation_ttl_s} s, committed over "
                            f"{self.service.config.lease_ttl_s} s ago, or never issued to "
                            f"you)")
        return web.json_response({"stored": stored})

    async def abort(self, request: web.Request) -> web.Response:
        who = require_write(request)  # before the body: a refused write reads none of it
        body = await read_body(request)
        res_id = field(body, "reservation", str)
        return web.json_response({"aborted": self.kv.abort(res_id, who.id)})

    def _budget(self, who: str, max_count: int | None, max_bytes: int | None) -> int:
        """The bytes ``who`` may still reserve under its quota (its tenant's, else the
        service's per-principal default): values past it get no range (the client sends
        them over HTTP). 429 when it holds its quota of reservations; 503 when the service
        holds ``max_reservations`` already."""
        config = self.service.config
        count_cap = config.reservations_per_principal if max_count is None else max_count
        bytes_cap = config.reserved_bytes_cap if max_bytes is None else max_bytes
        count, held = self.kv.host.reservations_held(who)
        if count >= count_cap:
            raise HTTPError(429, "reservation_quota",
                            f"you hold {count} reservations ({held} bytes), your quota is "
                            f"{count_cap} (commit or abort first; uncommitted ones expire "
                            f"after {config.reservation_ttl_s} s)")
        if self.kv.host.num_reservations >= config.max_reservations:
            raise HTTPError(503, "reservations_full",
                            f"the service holds {config.max_reservations} reservations; "
                            f"retry after they are committed or expire")
        return max(0, bytes_cap - held)

    def _check(self, body: dict[str, Any]) -> None:
        """503 without a segment; 409 when the client mapped another one (e.g. of a service
        that ran on this port before): its offsets would point into the wrong memory."""
        segment = self.kv.host.segment
        if segment is None:
            raise HTTPError(503, "shm_unavailable", "no shared segment on this service")
        if field(body, "segment", str) != segment.name:
            raise HTTPError(409, "segment_changed", "the client mapped another segment: "
                                                   "attach again")


def _lease_ids(body: dict[str, Any], name: str, limit: int) -> list[str]:
    """The lease ids of list field ``name`` (none when absent); 400 when it is not a list of
    strings, 413 beyond ``limit`` ids (checked before any lease ends)."""
    ids = field(body, name, list, default=[])
    if len(ids) > limit:
        raise HTTPError(413, "batch_too_large", f"{len(ids)} leases exceed the limit of {limit}",
                        limit=limit)
    if not all(isinstance(i, str) for i in ids):
        raise HTTPError(400, "bad_field", f"field {name!r} must be a list of lease ids")
    return list(ids)


def _msgpack(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=msgpack.packb(payload, use_bin_type=True), content_type=MSGPACK)


def _copy_rows(rows: list[torch.Tensor], out: list[torch.Tensor]) -> None:
    for src, dst in zip(rows, out, strict=True):
        copy_bytes(dst, src.reshape(-1).view(torch.uint8))
