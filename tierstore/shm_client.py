"""Same-host transport for the storage API: bytes move through the service's shared segment.

Control calls (attach, lease, reserve, commit) go over HTTP; the bytes are copied by the
calling thread between the mapped segment and the caller's buffers, so many threads copy at
once and the service never touches them. The attach goes through a :class:`Client`; the data
calls go straight from the calling thread over its own keep-alive connection
(:class:`_Control`), which costs a quarter of the client CPU of a hop through the
:class:`Client`'s event-loop thread and two thread wake-ups less per call. Only a client on
the service's host can attach (it must map the segment and find the service's nonce in
it); elsewhere, or when the service has no segment, :func:`open_transport` answers None and
callers use HTTP.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import threading
import time
import urllib.parse
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from host_tier.shm import SharedSegment, ShmError
from tierstore.client import MSGPACK, Client, ServiceError, _decode, pack_tokens
from tierstore.errors import TierStoreError, UnavailableError

log = logging.getLogger(__name__)

Transport = Literal["auto", "shm", "http"]
Sink = Callable[[int, torch.Tensor], bool]
Source = Callable[[int, torch.Tensor], None]
# Finished leases that ride on one read request (and no more than the service's max_batch).
RELEASES_PER_CALL = 256


class ShmUnavailable(UnavailableError, RuntimeError):
    """Shared memory cannot be used with this service (another host, no segment, refused)."""


class ServiceUnreachable(ShmUnavailable):
    """The service did not answer the attach (down or restarting): try again later."""


class SegmentChanged(ShmUnavailable):
    """The service behind the URL is not the one whose segment this transport mapped (it
    restarted): attach again."""


class LeaseExpired(TierStoreError, RuntimeError):
    """A read lease ended before the copy did: the bytes copied under it are not trusted."""


class SharedMemoryTransport:
    """The storage API of one service through its shared segment (see ``service/shm.py``).

    Thread-safe: every call is independent (one HTTP request at a time per control step, on
    the calling thread's own connection).

    ``defer_release``: a read's lease, once its copies are done well within the lease's TTL,
    is not released by a request of its own but named in the next read's request (one
    request per read instead of two); the owner then calls :meth:`release_pending` when it
    goes idle, so that no lease outlives the work by more than that.
    """

    def __init__(self, client: Client, segment: SharedSegment, lease_ttl_s: float, *,
                 release_in_get: bool = False, max_batch: int | None = None) -> None:
        self.client = client
        self.segment = segment
        self.lease_ttl_s = lease_ttl_s
        self.release_in_get = release_in_get  # the service takes ``release`` lists
        # The most keys or lease ids the service takes in one request (None: not said, as
        # from services before it did); longer calls go as several requests.
        self.max_batch = max_batch
        self._releases = min(RELEASES_PER_CALL, max_batch or RELEASES_PER_CALL)
        self.defer_release = False
        self._pending: list[str] = []
        self._pending_lock = threading.Lock()
        self._control = _Control(client)

    @classmethod
    def attach(cls, client: Client) -> SharedMemoryTransport:
        """Map the service's segment; ShmUnavailable when that is not possible from here."""
        try:
            reply = client.call("/v1/shm/attach", {})
            info = reply["segments"]["kv"]
            segment = SharedSegment.attach(str(info["name"]), bytes(info["nonce"]),
                                           int(info["nbytes"]))
            ttl = float(reply["lease_ttl_s"])
            batched = bool(reply.get("release_in_get", False))
            limit = reply.get("max_batch")
            max_batch = int(limit) if isinstance(limit, int) and limit > 0 else None
        except ServiceError as exc:
            raise ShmUnavailable(f"the service refused shared memory: {exc}") from exc
        except (ShmError, KeyError, TypeError) as exc:
            raise ShmUnavailable(f"cannot map the service's segment: {exc}") from exc
        except (OSError, asyncio.TimeoutError) as exc:  # the service is unreachable
            raise ServiceUnreachable(f"cannot reach the service: {exc}") from exc
        return cls(client, segment, ttl, release_in_get=batched, max_batch=max_batch)

    def _parts(self, n: int) -> list[range]:
        """``range(n)`` in runs of at most ``max_batch``: one request each."""
        step = self.max_batch or max(n, 1)
        return [range(i, min(i + step, n)) for i in range(0, n, step)] or [range(0)]

    # ------------------------------------------------------------------ reads
    def get_into(self, keys: Sequence[str], namespace: str, sink: Sink) -> list[bool]:
        """Per key found, ``sink(i, view)`` with the value as a ``uint8`` tensor (a view of
        the segment, valid only during the call; it copies what it keeps and answers whether
        it took the value). Per key whether it was found and taken. LeaseExpired when the
        service had ended the read lease before the copies finished. More keys than the
        service's ``max_batch`` go as several requests, one after the other."""
        taken: list[bool] = []
        for part in self._parts(len(keys)):
            def at(j: int, view: torch.Tensor, base: int = part.start) -> bool:
                return sink(base + j, view)

            taken += self._get_part(keys[part.start:part.stop], namespace,
                                    sink if part.start == 0 else at)
        return taken

    def _get_part(self, keys: Sequence[str], namespace: str, sink: Sink) -> list[bool]:
        sent = time.monotonic()
        body: dict[str, Any] = {"keys": list(keys), "namespace": namespace,
                                "segment": self.segment.name}
        done = self._take_pending(self._releases)
        if done:
            body["release"] = done
        try:
            reply = self._call("/v1/storage/shm_get", body)
        except BaseException:
            # Ended or not (a refused request ends none), they are ended again later: ending a
            # lease twice, or one the service no longer knows, changes nothing.
            self._defer(done)
            raise
        buf = self.segment.tensor
        taken = [False] * len(keys)
        try:
            for i, item in enumerate(reply["values"]):
                if item is None:
                    continue
                if isinstance(item, bytes):  # a Redis value host memory could not take
                    view = torch.frombuffer(bytearray(item), dtype=torch.uint8)
                else:
                    start, length = int(item[0]), int(item[1])
                    view = buf[start:start + length]
                taken[i] = bool(sink(i, view))
        finally:
            released = self._release(reply["lease"], sent)
        if not released:
            raise LeaseExpired(f"read lease of {len(keys)} keys expired before the copy ended")
        return taken

    def _release(self, lease: str | None, sent: float) -> bool:
        """End a read lease; whether it still held when the copies ended. The service starts a
        lease's TTL after this host's monotonic clock read ``sent``: well within the TTL the
        lease certainly held, so the release goes out without waiting for its answer."""
        if lease is None:
            return True
        if time.monotonic() - sent < 0.5 * self.lease_ttl_s:
            if self.defer_release and self.release_in_get:
                self._defer([lease])
            else:
                self.client.call_nowait("/v1/storage/shm_release", {"lease": lease})
            return True
        return bool(self._call("/v1/storage/shm_release", {"lease": lease})["released"])

    def release_pending(self) -> int:
        """End every deferred lease now (one request per ``RELEASES_PER_CALL``, or the
        service's ``max_batch`` when smaller); how many were sent. A service that cannot be
        reached ends them itself when they expire."""
        done = self._take_pending(None)
        for start in range(0, len(done), self._releases):
            try:
                self._control.call("/v1/storage/shm_release",
                                   {"leases": done[start:start + self._releases]})
            except (OSError, ServiceError) as exc:
                log.debug("deferred leases not released (they expire): %s", exc)
        return len(done)

    def _take_pending(self, limit: int | None) -> list[str]:
        if not self._pending:  # unlocked peek: a lease deferred meanwhile goes with the next
            return []
        with self._pending_lock:
            done, self._pending = self._pending[:limit], self._pending[len(
                self._pending) if limit is None else limit:]
        return done

    def _defer(self, leases: list[str]) -> None:
        if leases:
            with self._pending_lock:
                self._pending.extend(leases)

    def batch_get(self, keys: Sequence[str], namespace: str = "default"
                  ) -> list[bytes | None]:
        """Values of ``keys`` as bytes (None where missing)."""
        out: list[bytes | None] = [None] * len(keys)

        def keep(i: int, view: torch.Tensor) -> bool:
            out[i] = view.numpy().tobytes()
            return True

        self.get_into(keys, namespace, keep)
        return out

    def fetch_into(self, tokens: Sequence[int] | np.ndarray, namespace: str,
                   sink: Callable[[str, int, torch.Tensor], None]) -> dict[str, Any] | None:
        """``/v1/fetch`` through the segment: ``sink(kind, i, view)`` per envelope of the
        cached prefix (``kv`` per page, ``swa`` per page not tombstoned, ``state`` once; the
        view is valid only during the call), then the answer without bytes (``kv`` /
        ``swa`` / ``state`` as ``[offset, length]`` or None, ``matched_tokens``, ``tiers``).
        None when the rows do not fit the segment now (use ``Client.fetch``)."""
        sent = time.monotonic()
        try:
            reply = self._call("/v1/shm/fetch", {"tokens": pack_tokens(tokens),
                                                 "namespace": namespace,
                                                 "segment": self.segment.name})
        except ServiceError as exc:
            if exc.error == "shm_full":
                return None
            raise
        buf = self.segment.tensor
        try:
            for kind in ("kv", "swa", "state"):
                items = reply[kind] if kind != "state" else [reply["state"]]
                for i, item in enumerate(items):
                    if item is not None:
                        sink(kind, i, buf[int(item[0]):int(item[0]) + int(item[1])])
        finally:
            released = self._release(reply["lease"], sent)
        if not released:
            raise LeaseExpired("the fetch's read lease expired before the copy ended")
        return dict(reply)

    def fetch(self, tokens: Sequence[int] | np.ndarray, namespace: str = "default"
              ) -> dict[str, Any]:
        """What ``Client.fetch`` answers (envelopes as bytes), read through the segment when
        the rows fit it, else over HTTP."""
        got: dict[str, list[bytes]] = {"kv": [], "swa": [], "state": []}

        def keep(kind: str, i: int, view: torch.Tensor) -> None:
            got[kind].append(view.numpy().tobytes())

        reply = self.fetch_into(tokens, namespace, keep)
        if reply is None:
            return dict(self.client.fetch(tokens, namespace))
        swa = iter(got["swa"])
        reply["kv"] = got["kv"]
        reply["swa"] = [None if item is None else next(swa) for item in reply["swa"]]
        reply["state"] = got["state"][0] if got["state"] else None
        return reply

    # ------------------------------------------------------------------ writes
    def put_from(self, keys: Sequence[str], sizes: Sequence[int], namespace: str,
                 source: Source) -> list[bool]:
        """Reserve ranges for values of ``sizes``, let ``source(i, view)`` fill each (a
        ``uint8`` view of exactly ``sizes[i]`` bytes), then commit; per key whether the
        service holds it now. A key whose range could not be reserved is False (send it over
        HTTP; so is every key while this principal holds its quota of reservations, or the
        service all it keeps). If ``source`` raises, the reservation is aborted and nothing
        more becomes visible. More keys than the service's ``max_batch`` go as several
        reservations, one after the other."""
        stored: list[bool] = []
        for part in self._parts(len(keys)):
            def at(j: int, view: torch.Tensor, base: int = part.start) -> None:
                source(base + j, view)

            stored += self._put_part(keys[part.start:part.stop],
                                     sizes[part.start:part.stop], namespace,
                                     source if part.start == 0 else at)
        return stored

    def _put_part(self, keys: Sequence[str], sizes: Sequence[int], namespace: str,
                  source: Source) -> list[bool]:
        try:
            reply = self._call("/v1/storage/shm_reserve", {
                "keys": list(keys), "sizes": [int(n) for n in sizes], "namespace": namespace,
                "segment": self.segment.name})
        except ServiceError as exc:
            if exc.error in ("reservation_quota", "reservations_full"):
                return [False] * len(keys)
            raise
        res_id, buf = reply["reservation"], self.segment.tensor
        try:
            for i, slot in enumerate(reply["slots"]):
                if slot is not None:
                    start, length = int(slot[0]), int(slot[1])
                    source(i, buf[start:start + length])
        except BaseException:
            self._control.call("/v1/storage/shm_abort", {"reservation": res_id})
            raise
        stored = self._control.call("/v1/storage/shm_commit", {"reservation": res_id})["stored"]
        return [bool(s) for s in stored]

    def batch_set(self, keys: Sequence[str], values: Sequence[Any],
                  namespace: str = "default") -> list[bool]:
        """Store bytes-like values (or CPU tensors) under ``keys``; per key whether stored."""
        flat = [_as_bytes(v) for v in values]

        def fill(i: int, view: torch.Tensor) -> None:
            copy_bytes(view, flat[i])

        return self.put_from(keys, [t.numel() for t in flat], namespace, fill)

    def _call(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return self._control.call(path, body)
        except ServiceError as exc:
            if exc.status == 409 or exc.error == "shm_unavailable":
                raise SegmentChanged(f"the service no longer serves segment "
                                     f"{self.segment.name}: {exc}") from exc
            raise

    def close(self) -> None:
        """End deferred leases, close this transport's connections and unmap the segment
        (the service keeps it)."""
        self.release_pending()
        self._control.close()
        self.segment.close()


class _Control:
    """Blocking HTTP for a transport's data calls, from the calling thread itself: one
    keep-alive connection per thread, the client's token, timeout and retries (a 503 or a
    connection error is retried with backoff; a kept-alive connection the service closed
    meanwhile is reopened at once). Answers and errors as :class:`Client` gives them."""

    def __init__(self, client: Client) -> None:
        url = urllib.parse.urlsplit(client.base_url)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "127.0.0.1", url.port
        self._prefix = url.path.rstrip("/")
        self._headers = {**client.auth_headers, "Content-Type": MSGPACK}
        self._timeout_s = float(client.timeout_s)
        self._retries, self._backoff_s = int(client.retries), float(client.backoff_s)
        self._local = threading.local()
        # Weak: a connection dies (and its socket closes) with the thread that used it.
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()

    def call(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` (msgpack) to ``path``; the decoded answer, or ServiceError / OSError."""
        data = msgpack.packb(body, use_bin_type=True)
        delay, attempt, fresh_tries = self._backoff_s, 0, 0
        while True:
            conn, reused = self._connection()
            try:
                conn.request("POST", self._prefix + path, data, self._headers)
                response = conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                if reused and fresh_tries == 0 and isinstance(
                        exc, (ConnectionResetError, BrokenPipeError,
                              http.client.RemoteDisconnected)):
                    fresh_tries += 1  # the service closed an idle connection: not a failure
                    continue
                if attempt >= self._retries:
                    if isinstance(exc, OSError):
                        raise
                    raise ConnectionError(f"bad answer from the service: {exc}") from exc
            else:
                if response.will_close:
                    self._drop(conn)
                if response.status != 503 or attempt >= self._retries:
                    kind = (response.getheader("Content-Type") or "").split(";")[0].strip()
                    return _decode(response.status, kind, raw, attempt + 1)
            attempt += 1
            time.sleep(delay)
            delay *= 2

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=self._timeout_s)
        self._local.conn = conn
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._open.discard(conn)

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one)."""
        with self._lock:
            conns, self._open = list(self._open), weakref.WeakSet()
        for conn in conns:
            conn.close()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous CPU tensors of one dtype and shape a plain
    single-threaded memcpy (numpy, GIL released): torch splits a copy across its intra-op
    threads, which stalls for milliseconds when a core is busy (measured: 0.3 vs 5 GiB/s on
    2 loaded cores)."""
    if dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and \
            dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous():
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(),
                  src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def _as_bytes(value: Any) -> torch.Tensor:
    """A flat ``uint8`` tensor over ``value``'s bytes (no copy for contiguous CPU tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    view = memoryview(value).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only bytes: only ever read through this tensor
        warnings.simplefilter("ignore")
        return torch.frombuffer(view, dtype=torch.uint8)


def open_transport(client: Client, mode: Transport = "auto") -> SharedMemoryTransport | None:
    """The shared-memory transport for ``client``'s service, or None to use HTTP: ``http``
    never tries, ``auto`` tries and falls back (one log line), ``shm`` raises ShmUnavailable
    when it cannot attach."""
    if mode == "http":
        return None
    try:
        transport = SharedMemoryTransport.attach(client)
    except ShmUnavailable as exc:
        if mode == "shm":
            raise
        log.info("tierstore: HTTP transport (%s)", exc)
        return None
    log.info("tierstore: shared-memory transport (segment %.1f MiB)",
             transport.segment.nbytes / 2**20)
    return transport
