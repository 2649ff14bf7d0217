"""How the HiCache backend reaches the service: through its shared segment when SGLang runs on
the service's host (bytes copied by SGLang's own thread, straight between the segment and the
host pool), over HTTP otherwise or when shared memory is refused. A service that is down,
restarting or refusing turns every call into a miss / ``False`` with a rate-limited log line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
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
# The limit a 413 ``batch_too_large`` names: "... exceed the limit of 4", or msgpack's
# "9 exceeds max_array_len(4)" when the service refused the body as it arrived.
_NAMED_LIMIT = re.compile(r"(?:limit of |max_array_len\()(\d+)")


class _Smaller(Exception):
    """A request carried more keys than the service takes; its limit is now known: split."""

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
        # The most keys the service takes in one request (None: not known), asked again on
        # reconnect (a restarted service may take fewer) and lowered by a 413 that names it.
        self._service_limit: int | None = None
        self._limit_stale = True
        self.client = Client(config.url, token=config.auth_token, timeout_s=config.timeout_s,
                             retries=config.retries)
        self.reachable = self.client.health()
        if self.reachable:
            self.transport()
            self._learn_limit()

    # ------------------------------------------------------------------ batch limit
    @property
    def max_batch(self) -> int:
        """Keys one request carries: ``config.max_batch``, within the service's own limit
        (asked first when unknown, or after a reconnect, unless the service is down)."""
        return self.within(self.config.max_batch)

    def within(self, items: int) -> int:
        """``items``, or fewer where the service takes fewer keys per request."""
        if self._limit_stale and time.monotonic() >= self._down_until:
            self._learn_limit()
        limit = self._service_limit
        return items if limit is None else min(items, limit)

    def _learn_limit(self) -> None:
        """Ask the service its batch limit: the shared-memory attach answer, else
        ``/v1/stats`` (``service.limits.max_batch``). Asked once per (re)connection: a
        service that cannot say is asked again after it was down, or told by a 413."""
        self._limit_stale = False
        shm = self._shm
        limit = shm.max_batch if shm is not None else None
        if limit is None:
            stats = self.request(None, self.client.stats)
            found = (stats or {}).get("service", {}).get("limits", {}).get("max_batch")
            limit = found if isinstance(found, int) and found > 0 else None
            self._limit_stale = False  # this very answer may have been the reconnect
        if limit is None:
            return
        if limit != self._service_limit:
            log.info("tierstore: the service at %s takes %d keys per request",
                     self.config.url, limit)
        self._service_limit = limit

    def _lower_limit(self, exc: ServiceError, sent: int) -> bool:
        """After a 413 for ``sent`` keys: adopt the limit it carries (its ``limit`` field, or
        named in its detail; else the one the service states, else half of ``sent``); False
        when ``sent`` cannot shrink (one key)."""
        named = _NAMED_LIMIT.search(exc.detail)  # from a service older than the field
        limit = exc.limit if exc.limit is not None else int(named.group(1)) if named else None
        if limit is None or not 0 < limit < sent:
            self._learn_limit()
            limit = self._service_limit
        if limit is None or not 0 < limit < sent:
            limit = sent // 2  # it says nothing usable: halve, which always ends
        if limit < 1:
            return False
        with self._lock:
            self._service_limit = min(limit, self._service_limit or limit)
            self._limit_stale = False
        self._log.warning("tierstore: the service at %s refused %d keys in one request (%s); "
                          "sending %d per request", self.config.url, sent, exc.detail[:120],
                          self._service_limit)
        return True

    def _parts(self, sizes: Sequence[int], max_bytes: int, fn: Callable[[slice], T],
               items: int | None = None) -> Iterator[tuple[slice, T | None]]:
        """``fn(part)`` through ``request`` for consecutive parts of at most ``items`` (default
        ``max_batch``; fewer where the service takes fewer) and beyond one item, ``max_bytes``
        of ``sizes``, in order; None for a part that failed. A 413 that shows the service
        takes fewer keys re-splits that part and the rest (the refused request changed
        nothing)."""
        start = 0
        while start < len(sizes):
            cap = self.within(items or self.config.max_batch)
            first = next(_chunks(sizes[start:], cap, max_bytes))
            part = slice(start, start + first.stop)
            try:
                result = self.request(None, functools.partial(self._sized, fn, part))
            except _Smaller:
                continue
            yield part, result
            start = part.stop

    def _sized(self, fn: Callable[[slice], T], part: slice) -> T:
        try:
            return fn(part)
        except ServiceError as exc:
            sent = part.stop - part.start
            if exc.status == 413 and exc.error == "batch_too_large" and \
                    self._lower_limit(exc, sent):
                raise _Smaller from exc
            raise

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

    def _over_shm(self, shm: SharedMemoryTransport, fn: Callable[[], T], sent: int) -> T:
        """``fn()`` for ``sent`` keys; a segment the service no longer serves (it restarted),
        or a 413 for more keys than the service now takes (it restarted with a lower
        ``--max-batch`` than the mapping was told), drops the mapping and answers ``_HTTP``
        (the next call attaches again, and learns the limit anew)."""
        try:
            return fn()
        except SegmentChanged as exc:
            reason = str(exc)
            self._limit_stale = True  # a new service: its limit may differ, ask it again
        except ServiceError as exc:
            if not (exc.status == 413 and exc.error == "batch_too_large" and
                    self._lower_limit(exc, sent)):
                raise
            reason = f"the segment's batch limit is stale ({exc.detail[:120]})"
        with self._lock:
            if self._shm is shm:
                self._shm, self._shm_retry_at = None, 0.0
        shm.close()
        log.info("tierstore HiCache L3: %s", reason)
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
                self._down, self._limit_stale = False, True  # it may have restarted
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
        for part, found in self._parts([0] * len(keys), 1, lambda part: self.client.batch_exists(
                keys[part], ns)):
            total += found or 0
            if (found or 0) < part.stop - part.start:
                break
        return total

    def present(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """Whether the service holds each key (absent where a request failed)."""
        return [bool(v) for v in self.exists_each(ns, keys)]

    def exists_each(self, ns: str, keys: Sequence[str], batch: int | None = None
                    ) -> list[bool | None]:
        """Per key whether the service holds it; None where its request failed. Requests of
        ``batch`` keys (default ``max_batch``; fewer where the service takes fewer)."""
        out: list[bool | None] = []
        for part, got in self._parts([0] * len(keys), 1, lambda part: self.client.exists_each(
                keys[part], ns), batch):
            n = part.stop - part.start
            out += [bool(v) for v in got] if got is not None and len(got) == n else [None] * n
        return out

    def delete(self, ns: str, keys: Sequence[str]) -> bool:
        """Delete ``keys``; False when a request failed."""
        ok = True
        for _, deleted in self._parts([0] * len(keys), 1,
                                      lambda part: self.client.delete(keys[part], ns)):
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
        if shm is None:
            self._read_http(ns, keys, sizes, take, done, slice(0, len(keys)))
            return done
        for part in _chunks(sizes, self.max_batch, _UNBOUNDED):
            chunk, base = list(keys[part]), part.start

            def at(j: int, view: torch.Tensor, base: int = base) -> bool:
                return take(base + j, view)

            got = self.request(None, functools.partial(
                self._over_shm, shm, functools.partial(shm.get_into, chunk, ns, at),
                len(chunk)))
            if got is _HTTP:
                self._read_http(ns, keys, sizes, take, done, part)
            elif got is not None:
                done[part] = got
        return done

    def _read_http(self, ns: str, keys: Sequence[str], sizes: Sequence[int], take: Take,
                   done: list[bool], span: slice) -> None:
        """Over HTTP, ``take`` each key of ``span`` found, marking it in ``done``."""
        lo = span.start
        for part, values in self._parts(sizes[span], self.config.max_request_bytes,
                                        lambda part: self.client.batch_get(
                                            keys[lo + part.start:lo + part.stop], ns)):
            if values is None or len(values) != part.stop - part.start:
                continue
            for j, value in enumerate(values, lo + part.start):
                if value is not None:
                    done[j] = take(j, _tensor_of(value))

    def write(self, ns: str, keys: Sequence[str], sizes: Sequence[int], fill: Fill,
              blob: Blob) -> list[bool]:
        """Store value ``i`` under ``keys[i]``: through shared memory ``fill(i, range)``
        copies it into a reserved ``uint8`` range of ``sizes[i]`` bytes; over HTTP (or for a
        value host memory cannot take) ``blob(i)`` gives its bytes. Per key whether the service
        holds it now. With ``skip_existing`` leading keys already stored are not sent."""
        done = self.count(ns, keys) if self.config.skip_existing else 0
        keys, sizes = list(keys[done:]), list(sizes[done:])
        acked = [False] * len(keys)
        shm = self.transport()
        if shm is None:
            self._write_http(ns, keys, sizes, blob, acked, list(range(len(keys))), done)
            return [True] * done + acked
        for part in _chunks(sizes, self.max_batch, _UNBOUNDED):
            base = done + part.start

            def at(j: int, view: torch.Tensor, base: int = base) -> None:
                fill(base + j, view)

            got = self.request(None, functools.partial(
                self._over_shm, shm,
                functools.partial(shm.put_from, keys[part], sizes[part], ns, at),
                part.stop - part.start))
            if got is None:
                continue
            if got is not _HTTP:
                acked[part] = got
            todo = [j for j in range(part.start, part.stop) if not acked[j]]
            if todo:  # refused by the segment (too big for host memory) or no segment
                self._write_http(ns, keys, sizes, blob, acked, todo, done)
        return [True] * done + acked

    def _write_http(self, ns: str, keys: list[str], sizes: list[int], blob: Blob,
                    acked: list[bool], todo: list[int], offset: int) -> None:
        """Over HTTP, store the values ``todo`` names (``blob(offset + j)``), marking in
        ``acked`` which the service holds now."""
        def send(part: slice) -> list[bool]:
            picked = todo[part]
            return self.client.batch_set([keys[j] for j in picked],
                                         [blob(offset + j) for j in picked], ns)

        for part, sent in self._parts([sizes[j] for j in todo],
                                      self.config.max_request_bytes, send):
            picked = todo[part]
            ok = sent if sent is not None and len(sent) == len(picked) else \
                [False] * len(picked)
            for j, good in zip(picked, ok, strict=True):
                acked[j] = bool(good)

    def close(self) -> None:
        """Unmap the segment and close the client."""
        if self._shm is not None:
            self._shm.close()
        self.client.close()


def _tensor_of(value: bytes) -> torch.Tensor:
    if not value:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(value, dtype=torch.uint8)
