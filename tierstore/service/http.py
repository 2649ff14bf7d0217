"""HTTP limits around the app: connection cap, header / body / idle timeouts, body size and
in-flight body bytes, and aiohttp's own parser errors answered in the JSON error shape.

aiohttp has a keep-alive timeout and a body size limit but no header-read timeout, no
connection cap, and it reads a body up to the limit before refusing it; its parser errors are
``text/plain``. ``GuardedRunner`` runs an app behind a ``RequestHandler`` subclass that adds
these, and it finishes reading a body already begun when shutdown starts (it uses aiohttp's
request-handler internals: ``_request_count``, ``_kwargs`` and ``_parser``, checked by
``tests/service/test_hardening.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from tierstore.service.body import (
    BODY_LIMITS,
    JSON_MAX_BYTES,
    BodyBudget,
    BodyLimits,
    RouteLimits,
)
from tierstore.service.config import ServiceConfig

log = logging.getLogger(__name__)
# After answering a request whose body was not read (413, 408), the rest is read and dropped
# this long before the connection closes, so the client sees the answer rather than a reset.
LINGER_S = 1.0
CONTROL_BYTES = 64 << 10  # a body's fields besides its bulk (namespace, lease, segment, ...)
KEY_BYTES = 512  # one storage key (at most 400 characters) with its msgpack header, and more
# Routes by the shape of their bodies (a route not named here gets the default limits).
PREFIX_ROUTES = ("/v1/match", "/v1/fetch", "/v1/shm/fetch")
# shm_release takes up to max_batch lease ids (``leases``), as shm_get takes them too.
KEY_ROUTES = ("/v1/storage/batch_get", "/v1/storage/batch_exists", "/v1/storage/delete",
              "/v1/storage/shm_get", "/v1/storage/shm_reserve", "/v1/storage/shm_release")
CONTROL_ROUTES = ("/v1/release", "/v1/shm/attach", "/v1/storage/shm_commit",
                  "/v1/storage/shm_abort")


def install(app: web.Application, config: ServiceConfig) -> None:
    """Attach ``config``'s body limits (per route) and the thread that checks large bodies
    to ``app`` (``read_body`` finds them there); the thread stops with the app."""
    routes, default = route_limits(config)
    executor = ThreadPoolExecutor(2, thread_name_prefix="tierstore-decode")
    app[BODY_LIMITS] = BodyLimits(config.max_body_bytes, config.body_timeout_s,
                                  BodyBudget(config.inflight_body_bytes), routes, default,
                                  executor)

    async def stop(app: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop)


def route_limits(config: ServiceConfig) -> tuple[dict[str, RouteLimits], RouteLimits]:
    """Per route what a body may hold, from ``config``'s limits: token routes ``max_tokens``
    ids (5 bytes each at most in msgpack), key routes ``max_batch`` keys, the bulk routes up
    to ``max_body_bytes``; and the default for any other route."""
    big, tokens, batch = config.max_body_bytes, config.max_tokens, config.max_batch

    def sized(bulk: int) -> tuple[int, int]:
        size = min(big, bulk + CONTROL_BYTES)
        return size, min(size, JSON_MAX_BYTES)

    prefix = RouteLimits(*sized(5 * tokens), max_array=tokens, max_bin=4 * tokens,
                         array_error="too_many_tokens")
    keys = RouteLimits(*sized(batch * KEY_BYTES), max_array=batch,
                       array_error="batch_too_large")
    control = RouteLimits(*sized(0), max_array=64)
    routes = {**dict.fromkeys(PREFIX_ROUTES, prefix), **dict.fromkeys(KEY_ROUTES, keys),
              **dict.fromkeys(CONTROL_ROUTES, control),
              "/v1/insert": RouteLimits(*sized(big), max_array=max(tokens, batch), max_bin=big),
              "/v1/storage/batch_set": RouteLimits(*sized(big), max_array=batch, max_bin=big,
                                                   array_error="batch_too_large")}
    default = RouteLimits(*sized(big), max_array=max(tokens, batch), max_map=1024,
                          max_str=64 << 10, max_bin=big)
    return routes, default


def raw_error(status: int, error: str, detail: str) -> bytes:
    """A whole HTTP/1.1 error response in the JSON error shape, closing the connection (for
    answers written before the app sees a request)."""
    body = json.dumps({"error": error, "detail": detail}).encode()
    return (f"HTTP/1.1 {status} {error.replace('_', ' ')}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class GuardedHandler(RequestHandler):
    """aiohttp's request handler plus a header-read deadline and JSON parser errors."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.in_flight = 0  # requests parsed and not yet answered
        self._header_timer: asyncio.TimerHandle | None = None
        self._draining = False  # shutdown began: only the body of the request being served

    def data_received(self, data: bytes) -> None:
        if self._draining:
            self._drain(data)
            return
        before = self._request_count
        if self.in_flight == 0 and self._header_timer is None and data:
            self._header_timer = self._loop.call_later(self.header_timeout_s,
                                                       self._headers_late)
        super().data_received(data)
        parsed = self._request_count - before
        if parsed:
            self.in_flight += parsed
            self._cancel_header_timer()

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.in_flight = max(0, self.in_flight - 1)

    def close(self) -> None:
        # A graceful close (the runner's cleanup calls it first, then shutdown): see _drain.
        self._draining = True
        super().close()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        self._draining = True
        await super().shutdown(timeout)

    def _drain(self, data: bytes) -> None:
        """Once a graceful close or shutdown begins, aiohttp drops what a connection sends,
        even the rest of the body of a request whose headers came before (aiohttp#2298):
        that request is served all the same (in progress, or queued), waits out
        ``body_timeout_s`` for its body and holds shutdown as long. Bodies are still read
        here; a request whose headers come now is not served (its parsed message is
        dropped, and the connection closes after the answers owed)."""
        if self._parser is None:
            return
        try:
            self._parser.feed_data(data)
        except HttpProcessingError:  # a malformed next request: nothing more is read
            self._parser = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Parser errors (and anything before the app) as ``{error, detail}`` JSON."""
        if status >= 500:
            self.log_exception("Error handling request", exc_info=exc)
        detail = message or (str(exc) if exc else "") or "malformed request"
        error = "malformed_request" if status < 500 else "internal_error"
        resp = web.json_response({"error": error, "detail": detail[:500]}, status=status)
        resp.force_close()
        return resp

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.in_flight or self.transport is None:
            return
        self.transport.write(raw_error(408, "header_timeout", f"request headers did not "
                                       f"arrive within {self.header_timeout_s} s"))
        self.force_close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


class GuardedServer(web.Server):
    """Creates ``GuardedHandler``s and keeps at most ``max_connections`` open."""

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.num_refused = 0
        self.num_evicted = 0

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s,
                              **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self._connections) <= self.max_connections:
            return
        idle = next((h for h in self._connections if h is not handler
                     and isinstance(h, GuardedHandler) and h.in_flight == 0), None)
        if idle is not None:  # oldest first: the dict keeps connection order
            self.num_evicted += 1
            idle.force_close()
            self._connections.pop(idle, None)
            return
        self.num_refused += 1
        transport.write(raw_error(503, "too_many_connections",
                                  f"{self.max_connections} connections are busy"))
        handler.force_close()
        self._connections.pop(handler, None)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` serving through ``GuardedServer`` with ``config``'s limits."""

    def __init__(self, app: web.Application, config: ServiceConfig, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", config.keepalive_timeout_s)
        kwargs.setdefault("lingering_time", LINGER_S)
        super().__init__(app, **kwargs)
        self._config = config

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation,
                             header_timeout_s=self._config.header_timeout_s,
                             max_connections=self._config.max_connections, **plain._kwargs)


def run(app: web.Application, config: ServiceConfig) -> None:
    """Serve ``app`` on ``config.host:port`` until SIGINT / SIGTERM."""

    async def main() -> None:
        runner = GuardedRunner(app, config, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, config.host, config.port).start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            log.info("stopping")
        finally:
            await runner.cleanup()

    asyncio.run(main())
