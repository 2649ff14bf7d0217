"""How the HiCache backend reaches the service: through its shared segment when SGLang runs on
the service's host (bytes copied by SGLang's own thread, straight between the segment and the
host pool), over HTTP otherwise or when shared memory is refused. A service that is down,
restarting or refusing turns every call into a miss / ``False`` with a rate-limited log line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import aiohttp
import torch

from tierstore.client import Client, ServiceError
from tierstore.integrations._support import TierStoreL3Config, _chunks, _Counters, _LogLimiter
from tierstore.shm_client import (
    LeaseExpired,
    SegmentChanged,
    ServiceUnreachable,
    SharedMemoryTransport,
    ShmUnavailable,
)

log = logging.getLogger("tierstore.integrations.sglang")
T = TypeVar("T")
_DOWN = (aiohttp.ClientConnectionError, asyncio.TimeoutError, TimeoutError, OSError)
_HTTP: Any = object()  # a shared-memory call that must be redone over HTTP
Take = Callable[[int, torch.Tensor], bool]
Fill = Callable[[int, torch.Tensor], None]
Blob = Callable[[int], Any]
_UNBOUNDED = 1 << 62

with warnings.catch_warnings():
    # torch warns once per process that a tensor over read-only bytes is writable; values are
    # only ever read through such views, so spend that one warning here, silently.
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class ServiceIO:
    """Storage API calls of one backend: existence, reads into and writes from callbacks."""

    def __init__(self, config: TierStoreL3Config, counters: _Counters, limiter: _LogLimiter
                 ) -> None:
        self.config = config
        self._counters = counters
        self._log = limiter
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self._shm: SharedMemoryTransport | None = None
        self._shm_retry_at = 0.0
        self._shm_backoff_s = 0.0
        self.client = Client(config.url, token=config.auth_token, timeout_s=config.timeout_s,
                             retries=config.retries)
        self.reachable = self.client.health()
        if self.reachable:
            self.transport()

    # ------------------------------------------------------------------ transport choice
    @property
    def mode(self) -> str:
        """``shm`` while the shared segment is mapped, else ``http``."""
        return "shm" if self._shm is not None else "http"

    def transport(self) -> SharedMemoryTransport | None:
        """The shared-memory transport, or None (HTTP). When it is missing, attaching is
        retried after 5 s, doubling up to 5 min while it keeps failing (e.g. another host);
        ``auto`` logs the first failure only."""
        if self.config.transport == "http" or self._shm is not None:
            return self._shm
        with self._lock:
            if self._shm is None and time.monotonic() >= self._shm_retry_at:
                try:
                    self._shm = SharedMemoryTransport.attach(self.client)
                    self._shm_backoff_s = 0.0
                    log.info("tierstore HiCache L3: shared-memory transport to %s",
                             self.config.url)
                except ServiceUnreachable:  # down: attach again soon, as requests retry
                    self._shm_retry_at = time.monotonic() + self.config.retry_down_s
                except ShmUnavailable as exc:
                    first = self._shm_backoff_s == 0.0
                    self._shm_backoff_s = min(300.0, max(5.0, self.config.retry_down_s,
                                                         2 * self._shm_backoff_s))
                    self._shm_retry_at = time.monotonic() + self._shm_backoff_s
                    if self.config.transport == "shm":
                        self._log.warning("tierstore: transport 'shm' is not available (%s); "
                                          "using HTTP meanwhile", exc)
                    elif first:
                        log.info("tierstore HiCache L3: HTTP transport (%s)", exc)
            return self._shm

    def _over_shm(self, shm: SharedMemoryTransport, fn: Callable[[], T]) -> T:
        """``fn()``; a segment the service no longer serves (it restarted) drops the mapping
        and answers ``_HTTP`` (the next call attaches again)."""
        try:
            return fn()
        except SegmentChanged as exc:
            with self._lock:
                if self._shm is shm:
                    self._shm, self._shm_retry_at = None, 0.0
            shm.close()
            log.info("tierstore HiCache L3: %s", exc)
            return _HTTP

    # ------------------------------------------------------------------ guarded requests
    def request(self, default: T, fn: Callable[[], T]) -> T:
        """``fn()`` against the service; a failure is ``default`` and, for a connection failure
        or 503, answers every call at once for ``retry_down_s``."""
        if time.monotonic() < self._down_until:
            return default
        try:
            result = fn()
        except ServiceError as exc:
            self._counters.fail()
            if exc.status == 503:
                self._mark_down(exc)
            else:
                self._log.warning("tierstore service refused a request: %s", exc)
            return default
        except LeaseExpired as exc:
            self._counters.fail()
            self._log.warning("tierstore: %s; the pages read as misses", exc)
            return default
        except _DOWN as exc:
            self._counters.fail()
            self._mark_down(exc)
            return default
        if self._down:
            with self._lock:
                self._down = False
            log.info("tierstore service at %s reachable again", self.config.url)
        return result

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self._down = True
            self._down_until = time.monotonic() + self.config.retry_down_s
        self._log.warning("tierstore service at %s unavailable (%s: %s); storage calls miss "
                          "for %.1f s", self.config.url, type(exc).__name__, exc,
                          self.config.retry_down_s)

    # ------------------------------------------------------------------ calls
    def count(self, ns: str, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the service holds (0 when unreachable)."""
        total = 0
        for part in _chunks([0] * len(keys), self.config.max_batch, 1):
            chunk = list(keys[part])
            found = self.request(0, functools.partial(self.client.batch_exists, chunk, ns))
            total += found
            if found < len(chunk):
                break
        return total

    def present(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """Whether the service holds each key (absent where a request failed)."""
        out: list[bool] = []
        for part in _chunks([0] * len(keys), self.config.max_batch, 1):
            chunk = list(keys[part])
            got = self.request(None, functools.partial(self.client.exists_each, chunk, ns))
            out += got if got is not None and len(got) == len(chunk) else [False] * len(chunk)
        return out

    def delete(self, ns: str, keys: Sequence[str]) -> bool:
        """Delete ``keys``; False when a request failed."""
        ok = True
        for part in _chunks([0] * len(keys), self.config.max_batch, 1):
            deleted = self.request(None, functools.partial(self.client.delete, keys[part], ns))
            ok = ok and deleted is not None
        return ok

    def read(self, ns: str, keys: Sequence[str], sizes: Sequence[int], take: Take
             ) -> list[bool]:
        """``take(i, bytes)`` for each key found (a ``uint8`` tensor valid only during the
        call: a view of the shared segment, or of the HTTP body); per key whether it was
        found and taken. Requests of ``max_batch`` keys (and over HTTP, about
        ``max_request_bytes`` of expected ``sizes``)."""
        done = [False] * len(keys)
        shm = self.transport()
        for part in _chunks(sizes, self.config.max_batch,
                            _UNBOUNDED if shm is not None else self.config.max_request_bytes):
            chunk, base = list(keys[part]), part.start

            def at(j: int, view: torch.Tensor, base: int = base) -> bool:
                return take(base + j, view)

            if shm is not None:
                got = self.request(None, functools.partial(
                    self._over_shm, shm, functools.partial(shm.get_into, chunk, ns, at)))
                if got is not _HTTP:
                    if got is not None:
                        done[part] = got
                    continue
            values = self.request(None, functools.partial(self.client.batch_get, chunk, ns))
            if values is None or len(values) != len(chunk):
                continue
            for j, value in enumerate(values):
                if value is not None:
                    done[base + j] = at(j, _tensor_of(value))
        return done

    def write(self, ns: str, keys: Sequence[str], sizes: Sequence[int], fill: Fill,
              blob: Blob) -> list[bool]:
        """Store value ``i`` under ``keys[i]``: through shared memory ``fill(i, range)``
        copies it into a reserved ``uint8`` range of ``sizes[i]`` bytes; over HTTP (or for a
        value host memory cannot take) ``blob(i)`` gives its bytes. Per key whether the service
        holds it now. With ``skip_existing`` leading keys already stored are not sent."""
        done = self.count(ns, keys) if self.config.skip_existing else 0
        stored = [True] * done
        keys, sizes = list(keys[done:]), list(sizes[done:])
        shm = self.transport()
        for part in _chunks(sizes, self.config.max_batch,
                            _UNBOUNDED if shm is not None else self.config.max_request_bytes):
            chunk, base = keys[part], done + part.start
            acked: list[bool] | None = None
            if shm is not None:
                def at(j: int, view: torch.Tensor, base: int = base) -> None:
                    fill(base + j, view)

                got = self.request(None, functools.partial(
                    self._over_shm, shm,
                    functools.partial(shm.put_from, chunk, sizes[part], ns, at)))
                if got is None:
                    stored.extend([False] * len(chunk))
                    continue
                acked = None if got is _HTTP else got
            todo = [j for j in range(len(chunk)) if acked is None or not acked[j]]
            for sub in _chunks([sizes[part][j] for j in todo], self.config.max_batch,
                               self.config.max_request_bytes) if todo else []:
                picked = todo[sub]
                sent = self.request(None, functools.partial(
                    self.client.batch_set, [chunk[j] for j in picked],
                    [blob(base + j) for j in picked], ns))
                ok = sent if sent is not None and len(sent) == len(picked) else \
                    [False] * len(picked)
                acked = acked or [False] * len(chunk)
                for j, good in zip(picked, ok, strict=True):
                    acked[j] = bool(good)
            stored.extend(acked if acked is not None else [False] * len(chunk))
        return stored

    def close(self) -> None:
        """Unmap the segment and close the client."""
        if self._shm is not None:
            self._shm.close()
        self.client.close()


def _tensor_of(value: bytes) -> torch.Tensor:
    if not value:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(value, dtype=torch.uint8)
