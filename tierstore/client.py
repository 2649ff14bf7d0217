"""Clients of ``tierstore serve``: :class:`AsyncClient` (aiohttp) and :class:`Client` (sync).

Token ids travel as packed little-endian uint32 bytes in msgpack bodies; envelopes and values as
msgpack bytes. A 503 or a connection error is retried with exponential backoff; any other error
raises :class:`ServiceError` carrying the service's ``{error, detail}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp
import msgpack
import numpy as np

from tierstore.errors import TierStoreError

T = TypeVar("T")
MSGPACK = "application/msgpack"


class ServiceError(TierStoreError):
    """The service answered with an error (``status``, ``error``, ``detail``)."""

    def __init__(self, status: int, error: str, detail: str, *, attempts: int = 1,
                 limit: int | None = None) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail
        self.attempts = attempts  # > 1: an earlier attempt may have reached the service
        self.limit = limit  # a 413 for too many items: the most the route takes


def pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as packed little-endian uint32 bytes."""
    return np.asarray(tokens, dtype="<u4").tobytes()


class AsyncClient:
    """One connection pool to a service. ``async with AsyncClient(url) as c: ...``"""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", *, token: str | None = None,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.05) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.auth_headers = dict(headers)  # for same-host transports with their own sockets
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=64))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._session.close()

    # ------------------------------------------------------------------ prefix API
    async def match(self, tokens: Sequence[int] | np.ndarray, namespace: str = "default", *,
                    lock: bool = False, priority: int = 0) -> dict[str, Any]:
        """Matched tokens, per-tier breakdown, checkpoint and (with ``lock``) a lease id."""
        return await self._post("/v1/match", {"tokens": pack_tokens(tokens),
                                              "namespace": namespace, "lock": lock,
                                              "priority": priority})

    async def fetch(self, tokens: Sequence[int] | np.ndarray, namespace: str = "default"
                    ) -> dict[str, Any]:
        """The cached prefix's envelopes: ``kv`` (bytes per page), ``swa`` (bytes or None per
        page), ``state`` (bytes or None), plus ``matched_tokens`` and ``tiers``."""
        return await self._post("/v1/fetch", {"tokens": pack_tokens(tokens),
                                              "namespace": namespace})

    async def insert(self, tokens: Sequence[int] | np.ndarray, namespace: str = "default", *,
                     kv: Sequence[bytes], swa: Sequence[bytes] | None = None,
                     state: bytes | None = None) -> dict[str, Any]:
        """Cache the full pages of ``tokens``: one ``kv`` envelope per page, ``swa`` for the
        last pages, ``state`` at the (page-aligned) end."""
        body: dict[str, Any] = {"tokens": pack_tokens(tokens), "namespace": namespace,
                                "kv": list(kv)}
        if swa is not None:
            body["swa"] = list(swa)
        if state is not None:
            body["state"] = state
        return await self._post("/v1/insert", body)

    async def release(self, lease: str) -> None:
        """Release a lease ``match(..., lock=True)`` returned (an opaque string id, releasable
        only by the same principal: the same token, or without auth the same host)."""
        try:
            await self._post("/v1/release", {"lease": lease})
        except ServiceError as exc:
            # A retried release whose first attempt reached the service (and timed out or
            # lost its connection on the way back) finds the lease gone: it is released.
            if not (exc.status == 404 and exc.attempts > 1):
                raise

    # ------------------------------------------------------------------ storage API
    async def batch_set(self, keys: Sequence[str], values: Sequence[bytes],
                        namespace: str = "default") -> list[bool]:
        reply = await self._post("/v1/storage/batch_set", {"keys": list(keys),
                                                           "values": list(values),
                                                           "namespace": namespace})
        return list(reply["stored"])

    async def batch_get(self, keys: Sequence[str], namespace: str = "default"
                        ) -> list[bytes | None]:
        reply = await self._post("/v1/storage/batch_get", {"keys": list(keys),
                                                           "namespace": namespace})
        return list(reply["values"])

    async def batch_exists(self, keys: Sequence[str], namespace: str = "default") -> int:
        reply = await self._post("/v1/storage/batch_exists", {"keys": list(keys),
                                                              "namespace": namespace})
        return int(reply["count"])

    async def exists_each(self, keys: Sequence[str], namespace: str = "default") -> list[bool]:
        """Whether the service holds each of ``keys`` (any order of gaps)."""
        reply = await self._post("/v1/storage/batch_exists", {"keys": list(keys),
                                                              "namespace": namespace,
                                                              "each": True})
        return [bool(v) for v in reply["present"]]

    async def delete(self, keys: Sequence[str], namespace: str = "default") -> int:
        reply = await self._post("/v1/storage/delete", {"keys": list(keys),
                                                        "namespace": namespace})
        return int(reply["deleted"])

    # ------------------------------------------------------------------ control
    async def stats(self) -> dict[str, Any]:
        return await self._request("GET", "/v1/stats", None)

    async def health(self) -> bool:
        try:
            return (await self._request("GET", "/healthz", None)).get("status") == "ok"
        except (ServiceError, aiohttp.ClientError, asyncio.TimeoutError):
            return False

    # ------------------------------------------------------------------ transport
    async def call(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` (msgpack) to ``path``; the decoded answer, with the retries and errors
        of every method (for transports built on this client, e.g. shared memory)."""
        return await self._post(path, body)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._request("POST", path, msgpack.packb(body, use_bin_type=True))

    async def _request(self, method: str, path: str, data: bytes | None) -> Any:
        headers = {"Content-Type": MSGPACK} if data is not None else {}
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                async with self._session.request(method, self.base_url + path, data=data,
                                                 headers=headers) as response:
                    raw = await response.read()
                    if response.status == 503 and attempt < self.retries:
                        raise _Retry()
                    return _decode(response.status, response.content_type, raw, attempt + 1)
            except (_Retry, aiohttp.ClientConnectionError, asyncio.TimeoutError):
                if attempt == self.retries:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")


class _Retry(Exception):
    pass


def _decode(status: int, content_type: str, raw: bytes, attempts: int = 1) -> Any:
    body = msgpack.unpackb(raw, raw=False) if content_type == MSGPACK else \
        json.loads(raw) if raw else {}
    if status >= 400:
        if isinstance(body, dict):
            limit = body.get("limit")
            raise ServiceError(status, str(body.get("error")), str(body.get("detail")),
                               attempts=attempts,
                               limit=limit if type(limit) is int and limit > 0 else None)
        raise ServiceError(status, "http_error", raw[:200].decode(errors="replace"),
                           attempts=attempts)
    return body


class Client:
    """A blocking wrapper: the same methods as :class:`AsyncClient`, run on a private event-loop
    thread (so it works from any thread, including ones without a loop)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierstore-client",
                                        daemon=True)
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(base_url, **kwargs)

        self._async = self._call(make())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def call_nowait(self, path: str, body: dict[str, Any]) -> concurrent.futures.Future[Any]:
        """Send ``call(path, body)`` without waiting; the future holds the answer or error."""
        return asyncio.run_coroutine_threadsafe(self._async.call(path, body), self._loop)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._async, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return lambda *args, **kwargs: self._call(method(*args, **kwargs))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._async.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_stats(url: str, token: str | None, *, as_json: bool = False) -> int:
    """``tierstore stats``: per-tier hit rates of a running service."""
    with Client(url, token=token, retries=1) as client:
        stats = client.stats()
    if as_json:
        print(json.dumps(stats))
        return 0
    queried = stats["tokens_queried"] or 1
    print(f"requests {stats['requests']}, hit {stats['requests_hit']}; "
          f"token hit rate {stats['hit_rate']:.1%}")
    tiers = [("l1", "GPU"), ("l2", "host"), ("l3", "Redis")]
    if stats.get("disk"):  # the local disk tier sits between host memory and Redis
        tiers.insert(2, ("disk", "disk"))
    for tier, label in tiers:
        tokens = stats["hit_tokens"].get(tier, 0)
        print(f"  {label:<5} {tokens:>12,} tokens  {tokens / queried:6.1%}")
    missed = stats["tokens_queried"] - stats["tokens_hit"]
    print(f"  {'miss':<5} {missed:>12,} tokens  {missed / queried:6.1%}")
    return 0
