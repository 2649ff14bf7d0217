"""The aiohttp application: prefix API, key-addressed storage API, stats, metrics, dashboard.

One event loop; every call into the store runs on one worker thread (the store is not
thread-safe, and its bulk copies must not block the loop). Errors are JSON
``{"error", "detail"}``; a rejected request changes nothing.

Every request has a principal (:mod:`.access`): its tenant's namespaces scope what it names
(prefix pages and storage keys carry the tenant), its quotas bound what it holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any, TypeVar

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from remote_tier import RedisTier, RemoteTierConfig, RemoteUnavailable
from tierstore.attribution import match_fields
from tierstore.errors import LeaseError, NamespaceError, ShapeError, TokenError
from tierstore.hashing import as_tokens
from tierstore.layout import LayoutError
from tierstore.radix import TIERS
from tierstore.service.access import (
    PRINCIPAL,
    Authenticator,
    namespace,
    principal,
    require_write,
    store_namespace,
)
from tierstore.service.codec import (
    INT64_MAX,
    INT64_MIN,
    MSGPACK,
    HTTPError,
    blobs_field,
    error_response,
    field,
    int_field,
    msgpack_chunks,
    read_body,
    release_body,
    stack,
    tokens_field,
)
from tierstore.service.config import ServiceConfig
from tierstore.service.http import install
from tierstore.service.kv import BadKeyError, KeyValueStore
from tierstore.service.kv_disk import open_disk
from tierstore.service.leases import LeaseTable
from tierstore.service.metrics import Metrics
from tierstore.service.principals import Principals
from tierstore.service.quotas import PageQuota
from tierstore.service.shm import ShmRoutes
from tierstore.store import TierStore

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS: dict[type[Exception], tuple[int, str]] = {
           TokenError: (400, "bad_tokens"), NamespaceError: (400, "bad_namespace"),
           BadKeyError: (400, "bad_key"), ShapeError: (422, "wrong_shape"),
           LayoutError: (422, "wrong_shape"), LeaseError: (404, "unknown_lease"),
           RemoteUnavailable: (503, "tier_unavailable")}
_MAPPED = tuple(_STATUS)


class Service:
    """Owns the store for the app's lifetime (the caller built it; the app's cleanup, or a
    start that fails, closes it with :meth:`aclose`)."""

    def __init__(self, store: TierStore, config: ServiceConfig,
                 kv_remote: RemoteTierConfig | None = None) -> None:
        self.store = store
        self.config = config
        self.kv_remote = kv_remote
        self.principals = None if config.principals is None else \
            Principals.load(config.principals)
        self.auth = Authenticator(config, self.principals)
        self.kv = KeyValueStore(config.kv_host_bytes, None, ttl_s=config.lease_ttl_s,
                                shared=config.shm, reservation_ttl_s=config.reservation_ttl_s,
                                disk=open_disk(config))
        self.pages = PageQuota()
        self.leases = LeaseTable(config.lease_ttl_s)
        self.metrics = Metrics()
        self.requests: Counter[str] = Counter()
        self.started = time.time()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tierstore-store")
        self.store_busy_s = 0.0  # seconds the store's thread spent in calls (its load)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the store's thread (the store is not thread-safe). Only store calls go
        there: the storage API and shared-memory control calls run on the loop, and bulk copies
        in worker threads or in the client."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._timed, fn, args, kwargs)

    def _timed(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.store_busy_s += time.perf_counter() - start

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._timing, self._errors, self._auth])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/dashboard", self.dashboard)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/stats", self.stats)
        app.router.add_post("/v1/match", self.match)
        app.router.add_post("/v1/fetch", self.fetch)
        app.router.add_post("/v1/insert", self.insert)
        app.router.add_post("/v1/release", self.release)
        app.router.add_post("/v1/storage/batch_set", self.batch_set)
        app.router.add_post("/v1/storage/batch_get", self.batch_get)
        app.router.add_post("/v1/storage/batch_exists", self.batch_exists)
        app.router.add_post("/v1/storage/delete", self.delete)
        app.cleanup_ctx.append(self._lifecycle)
        install(app, self.config)
        ShmRoutes(self).register(app)
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        try:
            if self.kv_remote is not None:
                self.kv.remote = await RedisTier.connect(self.kv_remote)
        except BaseException as exc:
            # The app does not start, so the cleanup after ``yield`` never runs: release the
            # disk copies' files, locks and threads now (a later start may use them).
            log.error("service start failed: storage API Redis: %s: %s", type(exc).__name__,
                      exc)
            await self.aclose()
            raise
        reaper = asyncio.create_task(self._reap_leases())
        log.info("service up: L1 %.1f MiB on %s, L2 %s, L3 %s", self.store.arena.capacity_bytes
                 / 2**20, self.store.arena.device, "on" if self.store.host else "off",
                 "on" if self.store.remote else "off")
        yield
        reaper.cancel()
        await self.aclose()

    async def aclose(self) -> None:
        """Close the storage API's tiers (background writes finished first) and the store,
        and stop the store's thread."""
        await self.kv.aclose()
        await self.run(self.store.close)
        self._executor.shutdown(wait=True)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.lease_ttl_s / 4))
            for lease in self.leases.expired():
                await self.run(self.store.release, lease)

    # ------------------------------------------------------------------ middlewares
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HTTPError as exc:
            response = error_response(exc.status, exc.error, exc.detail, limit=exc.limit)
            if exc.status in (408, 413):  # the body was not (all) read: drop the connection
                response.force_close()
            return response
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, "body_too_large", exc.text or "request body too large")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason.lower().replace(" ", "_"),
                                  f"{request.method} {request.path}: {exc.reason}")
        except _MAPPED as exc:
            status, error = next(v for k, v in _STATUS.items() if isinstance(exc, k))
            return error_response(status, error, str(exc))
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal_error", "see the service log")
        finally:
            release_body(request)

    @web.middleware
    async def _timing(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # Outermost: it sees the status ``_errors`` answered (inside it, every error raised
        # as an exception was counted as a 500).
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            route = request.match_info.route.resource
            endpoint = route.canonical if route is not None else "unmatched"
            self.requests[endpoint] += 1
            self.metrics.latency.labels(endpoint, str(status)).observe(
                time.perf_counter() - start)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request[PRINCIPAL] = self.auth.identify(request)
        return await handler(request)

    # ------------------------------------------------------------------ control
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(self, request: web.Request) -> web.Response:
        body = await self._stats()
        who = principal(request)
        tenant, name = who.tenant, who.tenant.name
        count, reserved = self.kv.host.reservations_held(who.id)
        # What the caller holds against its quotas (the open tenant has none).
        body["principal"] = {"tenant": name or None, "read_only": tenant.read_only,
                             "value_bytes": self.kv.quota.held(name),
                             "max_value_bytes": tenant.max_value_bytes,
                             "prefix_pages": self.pages.held(name),
                             "max_prefix_pages": tenant.max_prefix_pages,
                             "reservations": count, "reserved_bytes": reserved}
        return web.json_response(body)

    async def _stats(self) -> dict[str, Any]:
        snapshot = await self.run(self.store.stats)
        body = dataclasses.asdict(snapshot)
        body["hit_rate"] = snapshot.hit_rate
        body["service"] = {"uptime_s": time.time() - self.started, "leases": len(self.leases),
                           "store_busy_s": self.store_busy_s,
                           "requests": dict(self.requests), "kv": self.kv.stats(),
                           # what one request may carry (clients size their batches by it)
                           "limits": {"max_batch": self.config.max_batch,
                                      "max_tokens": self.config.max_tokens,
                                      "max_body_bytes": self.config.max_body_bytes},
                           "model": self.store.layout.name, "page_size":
                           self.store.layout.page_size,
                           "envelope_bytes": {k: e.nbytes for k, e in
                                              self.store.layout.envelopes().items()}}
        body["time"] = time.time()
        return body

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.store.snapshot = await self.run(self.store.stats)
        remote = self.kv.remote
        self.metrics.store.kv_errors = {} if remote is None else dict(remote.stats().errors)
        kv = self.kv.stats()
        self.metrics.store.extra = {"leases_active": len(self.leases),
                                    "kv_host_bytes": kv["host_bytes"],
                                    **({"kv_disk_bytes": kv["disk_used_bytes"]}
                                       if "disk_used_bytes" in kv else {})}
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def dashboard(self, request: web.Request) -> web.Response:
        page = resources.files("tierstore.service").joinpath("static/dashboard.html")
        return web.Response(text=page.read_text(encoding="utf-8"), content_type="text/html")

    async def openapi(self, request: web.Request) -> web.Response:
        spec = resources.files("tierstore.service").joinpath("openapi.json")
        return web.Response(text=spec.read_text(encoding="utf-8"),
                            content_type="application/json")

    # ------------------------------------------------------------------ prefix API
    async def match(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        tokens = tokens_field(body, self.config.max_tokens)
        scoped = store_namespace(request, body)
        lock = field(body, "lock", bool, default=False)
        priority = int_field(body, "priority", INT64_MIN, INT64_MAX, default=0)
        who = principal(request).id

        def work() -> tuple[Any, str | None]:
            result = self.store.match(tokens, scoped, priority=priority)
            lease_id = None
            if result.lease is not None:
                if lock:
                    lease_id = self.leases.add(result.lease, who)
                else:
                    self.store.release(result.lease)
            return result, lease_id

        result, lease_id = await self.run(work)
        return web.json_response({
            "matched_tokens": result.tokens, "pages": result.pages,
            "checkpoint": result.tokens if result.state is not None else None,
            "kv_pages_found": result.kv_pages_found, "tiers": result.tiers, "lease": lease_id,
            **match_fields(result.lost, result.evicted_from)})

    async def fetch(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        tokens = tokens_field(body, self.config.max_tokens)
        chunks, done = await self.run(self._fetch, tokens, store_namespace(request, body))
        try:
            return await _stream(request, chunks)
        finally:
            await self.run(done)

    def _fetch(self, tokens: Any, namespace: str) -> tuple[list[Any], Callable[[], None]]:
        """Match (promoting into L1) and describe the response as chunks that point straight
        into the arena's rows: the store's prefix read keeps them in place and cached until
        ``done`` runs on the store thread."""
        read = self.store.read_prefix(tokens, namespace)
        try:
            result, rows = read.match, read.rows
            swa = rows.get("swa") or [None] * len(result.swa)
            payload = {"matched_tokens": result.tokens, "pages": result.pages,
                       "checkpoint": result.tokens if result.state is not None else None,
                       "tiers": result.tiers, "kv": [_view(r) for r in rows.get("kv", [])],
                       "swa": [None if r is None else _view(r) for r in swa],
                       "state": _view(rows["state"][0]) if "state" in rows else None}
            chunks = msgpack_chunks(payload)
        except BaseException:
            read.close()
            raise
        return chunks, read.close

    async def insert(self, request: web.Request) -> web.Response:
        tenant = require_write(request).tenant  # before the body: a refused write reads none of it
        body = await read_body(request)
        tokens = tokens_field(body, self.config.max_tokens)
        scoped = store_namespace(request, body)
        envelopes = self.store.layout.envelopes()
        given: dict[str, torch.Tensor | None] = {}
        for kind in ("kv", "swa"):
            blobs = blobs_field(body, kind, self.config.max_batch)
            if blobs is not None and kind not in envelopes:
                raise HTTPError(422, "wrong_shape", f"this layout has no {kind!r} envelopes")
            given[kind] = None if blobs is None else torch.from_numpy(
                stack(blobs, envelopes[kind].nbytes, kind))
        state = field(body, "state", bytes, default=None)
        if state is not None:
            if "state" not in envelopes:
                raise HTTPError(422, "wrong_shape", "this layout has no 'state' envelopes")
            given["state"] = torch.from_numpy(stack([state], envelopes["state"].nbytes,
                                                    "state"))
        limit = tenant.max_prefix_pages

        def work() -> Any:
            if limit is not None and not self._page_room(tenant.name, limit, tokens, scoped):
                return None
            result = self.store.insert(tokens, scoped, kv=given.get("kv"),
                                       swa=given.get("swa"), state=given.get("state"))
            if limit is not None and result.new_pages:
                self.pages.add(tenant.name, scoped, _packed(tokens), result.new_pages)
            return result

        result = await self.run(work)
        if result is None:
            raise HTTPError(429, "quota_exceeded", f"tenant {tenant.name!r} holds "
                            f"{self.pages.held(tenant.name)} cached prefix pages of its "
                            f"{limit} (or its inserts' records pass "
                            f"{self.pages.record_bytes} bytes); this insert would add more "
                            f"(wait for eviction, or ask for a larger quota)")
        return web.json_response(dataclasses.asdict(result))

    def _page_room(self, tenant: str, limit: int, tokens: Any, scoped: str) -> bool:
        """Whether ``tenant`` may insert ``tokens`` (store thread): the pages it would add
        fit its quota, after recounting its records against what is still cached."""
        page = self.store.layout.page_size

        def cached(ns: str, toks: Any) -> int:
            return self.store.peek(toks, ns, tiers=TIERS) // page

        count = len(as_tokens(tokens))
        need = count // page - cached(scoped, tokens)
        if need <= 0 or self.pages.fits(tenant, limit, need, 4 * count):
            return True
        self.pages.refresh(tenant, cached, 4 * page)
        return self.pages.fits(tenant, limit, need, 4 * count)

    async def release(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        lease_id = field(body, "lease", str)
        lease = self.leases.pop(lease_id, principal(request).id)
        if lease is None:  # the same answer whoever holds it: existence is not revealed
            raise HTTPError(404, "unknown_lease", f"lease {lease_id[:64]!r} is not held "
                                                  f"(released, expired after "
                                                  f"{self.config.lease_ttl_s} s, or never "
                                                  f"issued to you)")
        await self.run(self.store.release, lease)
        return web.json_response({"released": True})

    # ------------------------------------------------------------------ storage API
    def keys(self, request: web.Request, body: dict[str, Any]) -> list[str]:
        """The stored keys the body's ``keys`` name in its (tenant-scoped) namespace."""
        keys = field(body, "keys", list)
        if len(keys) > self.config.max_batch:
            raise HTTPError(413, "batch_too_large", f"{len(keys)} keys exceed the limit of "
                                                    f"{self.config.max_batch}",
                            limit=self.config.max_batch)
        who, name = namespace(request, body)
        return [self.kv.key(name, k, who.tenant.name) for k in keys]

    async def batch_set(self, request: web.Request) -> web.Response:
        tenant = require_write(request).tenant  # before the body: a refused write reads none of it
        body = await read_body(request)
        keys = self.keys(request, body)
        values = blobs_field(body, "values", self.config.max_batch, required=True)
        assert values is not None
        if len(values) != len(keys):
            raise HTTPError(422, "wrong_shape", f"{len(keys)} keys but {len(values)} values")
        stored, reasons = await self.kv.batch_set(keys, values, limit=tenant.max_value_bytes)
        return web.json_response({"stored": stored, "reasons": reasons})

    async def batch_get(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        keys = self.keys(request, body)
        values, release = await self.kv.read(keys)  # pinned host ranges: stream, then release
        try:
            return await _stream(request, msgpack_chunks({"values": values}))
        finally:
            release()

    async def batch_exists(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        keys = self.keys(request, body)
        if not field(body, "each", bool, default=False):
            return web.json_response({"count": await self.kv.batch_exists(keys)})
        present = await self.kv.exists_each(keys)
        count = next((i for i, here in enumerate(present) if not here), len(present))
        return web.json_response({"count": count, "present": present})

    async def delete(self, request: web.Request) -> web.Response:
        require_write(request)  # before the body: a refused write reads none of it
        body = await read_body(request)
        keys = self.keys(request, body)
        return web.json_response({"deleted": await self.kv.delete(keys)})


async def _stream(request: web.Request, chunks: list[Any]) -> web.StreamResponse:
    """Write a msgpack body given as chunks (see ``msgpack_chunks``) without joining them."""
    response = web.StreamResponse(headers={"Content-Type": MSGPACK})
    response.content_length = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
    await response.write_eof()
    return response


def _packed(tokens: Any) -> bytes:
    """Token ids as the packed little-endian uint32 bytes the page quota records."""
    return tokens if isinstance(tokens, bytes) else as_tokens(tokens).tobytes()


def _view(row: torch.Tensor | None) -> memoryview:
    assert row is not None
    return memoryview(row.numpy()).cast("B")  # type: ignore[arg-type]
