"""Same-host transport for the storage API: bytes move through the service's shared segment.

Control calls (attach, lease, reserve, commit) go over HTTP through a :class:`Client`; the
bytes are copied by the calling thread between the mapped segment and the caller's buffers, so
many threads copy at once and the service never touches them. Only a client on the service's
host can attach (it must map the segment and find the service's nonce in it); elsewhere, or
when the service has no segment, :func:`open_transport` answers None and callers use HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from host_tier.shm import SharedSegment, ShmError
from tierstore.client import Client, ServiceError, pack_tokens
from tierstore.errors import TierStoreError, UnavailableError

log = logging.getLogger(__name__)

Transport = Literal["auto", "shm", "http"]
Sink = Callable[[int, torch.Tensor], bool]
Source = Callable[[int, torch.Tensor], None]


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

    Thread-safe: every call is independent (one HTTP request at a time per control step).
    """

    def __init__(self, client: Client, segment: SharedSegment, lease_ttl_s: float) -> None:
        self.client = client
        self.segment = segment
        self.lease_ttl_s = lease_ttl_s

    @classmethod
    def attach(cls, client: Client) -> SharedMemoryTransport:
        """Map the service's segment; ShmUnavailable when that is not possible from here."""
        try:
            reply = client.call("/v1/shm/attach", {})
            info = reply["segments"]["kv"]
            segment = SharedSegment.attach(str(info["name"]), bytes(info["nonce"]),
                                           int(info["nbytes"]))
            ttl = float(reply["lease_ttl_s"])
        except ServiceError as exc:
            raise ShmUnavailable(f"the service refused shared memory: {exc}") from exc
        except (ShmError, KeyError, TypeError) as exc:
            raise ShmUnavailable(f"cannot map the service's segment: {exc}") from exc
        except (OSError, asyncio.TimeoutError) as exc:  # the service is unreachable
            raise ServiceUnreachable(f"cannot reach the service: {exc}") from exc
        return cls(client, segment, ttl)

    # ------------------------------------------------------------------ reads
    def get_into(self, keys: Sequence[str], namespace: str, sink: Sink) -> list[bool]:
        """Per key found, ``sink(i, view)`` with the value as a ``uint8`` tensor (a view of
        the segment, valid only during the call; it copies what it keeps and answers whether
        it took the value). Per key whether it was found and taken. LeaseExpired when the
        service had ended the read lease before the copies finished."""
        sent = time.monotonic()
        reply = self._call("/v1/storage/shm_get", {"keys": list(keys), "namespace": namespace,
                                                   "segment": self.segment.name})
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
            self.client.call_nowait("/v1/storage/shm_release", {"lease": lease})
            return True
        return bool(self.client.call("/v1/storage/shm_release", {"lease": lease})["released"])

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
        becomes visible."""
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
            self.client.call("/v1/storage/shm_abort", {"reservation": res_id})
            raise
        stored = self.client.call("/v1/storage/shm_commit", {"reservation": res_id})["stored"]
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
            return self.client.call(path, body)
        except ServiceError as exc:
            if exc.status == 409 or exc.error == "shm_unavailable":
                raise SegmentChanged(f"the service no longer serves segment "
                                     f"{self.segment.name}: {exc}") from exc
            raise

    def close(self) -> None:
        """Unmap the segment (the service keeps it)."""
        self.segment.close()


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
