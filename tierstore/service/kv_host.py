"""The storage API's host copy: engine-keyed values in one shared-memory segment, LRU-evicted.

Values live in byte ranges of a :class:`~host_tier.shm.SharedSegment` (private memory when
``/dev/shm`` is unusable), so a client on the same host can copy them itself. A range is
*pinned* while someone reads it outside the loop (a client's read lease, an HTTP response
being streamed, a Redis write in flight); a pinned value that is replaced, deleted or evicted
disappears from the index at once and its bytes are reused only after the last unpin. Writes
*reserve* a range, fill it, then *publish* it: until then nothing is visible. Leases handed to
clients expire after ``ttl_s``, reservations after ``reservation_ttl_s`` (a client may die
holding one); each belongs to the principal that took it and is unknown to anyone else.
A value's *owner* is the tenant in its key (:func:`tenant_of`); a reservation made for a
tenant evicts only that tenant's values.
Runs on the service's event loop; not thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from host_tier.shm import SharedSegment, ShmError, available
from host_tier.slots import ByteSlots

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Value:
    """One value's byte range; ``pins`` readers hold it, ``dead`` once no longer indexed."""

    start: int
    length: int
    pins: int = 0
    dead: bool = False
    owner: str = ""


@dataclass
class Reservation:
    """Unpublished ranges (with the keys they are for) held for ``principal`` until ``until``."""

    items: list[tuple[str, Value | None]]
    principal: str
    until: float
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(v.length for _, v in self.items if v is not None)


def tenant_of(key: str) -> str:
    """The tenant a stored key belongs to: the part before ``|`` in ``{tenant}|{rest}``, ""
    for the keys of a service without tenants (they start ``{digits}:``)."""
    bar, colon = key.find("|"), key.find(":")
    return key[:bar] if bar > 0 and (colon < 0 or bar < colon) else ""


class HostValues:
    """Values under keys in ``capacity_bytes`` of (shared) memory, least recently used first."""

    def __init__(self, capacity_bytes: int, ttl_s: float, *, shared: bool = True,
                 reservation_ttl_s: float | None = None) -> None:
        self.ttl_s = ttl_s
        self.reservation_ttl_s = ttl_s if reservation_ttl_s is None else reservation_ttl_s
        self.segment: SharedSegment | None = None
        if shared and available(capacity_bytes):
            try:
                self.segment = SharedSegment.create(capacity_bytes, prefix="tierstore-kv")
            except ShmError as exc:
                log.warning("storage API host copy in private memory (%s): same-host clients "
                            "use HTTP", exc)
        self.buffer = self.segment.tensor if self.segment is not None else \
            torch.zeros(capacity_bytes, dtype=torch.uint8)
        self._bytes = self.buffer.numpy()
        self.slots = ByteSlots(capacity_bytes)
        self._index: OrderedDict[str, Value] = OrderedDict()
        self._leases: dict[str, tuple[list[Value], float, str]] = {}
        self._reserved: dict[str, Reservation] = {}
        self._held: dict[str, tuple[int, int]] = {}  # principal -> (reservations, bytes)
        self.live_bytes = 0
        self.evictions = 0

    # ------------------------------------------------------------------ index
    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def get(self, key: str) -> Value | None:
        """The value under ``key`` (now the most recently used), or None."""
        value = self._index.get(key)
        if value is not None:
            self._index.move_to_end(key)
        return value

    def view(self, value: Value) -> memoryview:
        """The value's bytes, without a copy (pin it to keep them past the next loop turn)."""
        return self._bytes[value.start:value.start + value.length].data

    def tensor(self, value: Value) -> torch.Tensor:
        """The value's bytes as a ``uint8`` tensor view."""
        return self.buffer[value.start:value.start + value.length]

    def put(self, key: str, data: memoryview | bytes) -> bool:
        """Copy ``data`` in under ``key`` (replacing any value); False when it cannot fit."""
        view = memoryview(data).cast("B")
        value = self.reserve(view.nbytes)
        if value is None:
            return False
        self._bytes[value.start:value.start + value.length] = np.frombuffer(view, np.uint8)
        self.publish(key, value)
        return True

    def reserve(self, nbytes: int, *, owner: str | None = None) -> Value | None:
        """An unindexed range of ``nbytes`` to fill (evicting least recently used unpinned
        values as needed: only ``owner``'s when given); None when it cannot fit even then
        (pinned values, other tenants' values and fragments)."""
        if nbytes > self.slots.capacity:
            return None
        start = self.slots.alloc(max(1, nbytes))
        if start is None:
            for key in [k for k, v in self._index.items()
                        if not v.pins and (owner is None or v.owner == owner)]:
                self.drop(key)
                self.evictions += 1
                start = self.slots.alloc(max(1, nbytes))
                if start is not None:
                    break
            if start is None:  # fragmented past what eviction could merge
                return None
        return Value(start, nbytes)

    def publish(self, key: str, value: Value) -> None:
        """Make a filled reservation the value of ``key`` (replacing the old one)."""
        self.drop(key)
        value.owner = tenant_of(key)
        self._index[key] = value
        self.live_bytes += value.length

    def drop(self, key: str) -> bool:
        """Unindex ``key``'s value (its range is reused once unpinned); whether it was held."""
        value = self._index.pop(key, None)
        if value is None:
            return False
        self.live_bytes -= value.length
        value.dead = True
        if not value.pins:
            self.slots.free(value.start)
        return True

    def keys(self) -> list[str]:
        """The keys held, least recently used first."""
        return list(self._index)

    def drop_unpinned(self, key: str) -> bool:
        """Unindex ``key``'s value unless a reader pins it; whether it was dropped."""
        value = self._index.get(key)
        return value is not None and not value.pins and self.drop(key)

    def abandon(self, value: Value) -> None:
        """Return an unpublished reservation."""
        value.dead = True
        if not value.pins:
            self.slots.free(value.start)

    def stage(self, sizes: list[int]) -> list[Value] | None:
        """Unindexed, pinned ranges for bytes a client will read once (e.g. a prefix's rows
        copied out of the store); the last unpin frees them. None when they do not all fit
        (nothing is held then)."""
        staged: list[Value] = []
        for nbytes in sizes:
            value = self.reserve(nbytes)
            if value is None:
                for held in staged:
                    self.unpin(held)
                return None
            value.dead, value.pins = True, 1
            staged.append(value)
        return staged

    def pin(self, value: Value) -> None:
        value.pins += 1

    def unpin(self, value: Value) -> None:
        assert value.pins > 0, f"unpin of an unpinned value at {value.start}"
        value.pins -= 1
        if value.dead and not value.pins:
            self.slots.free(value.start)

    # ------------------------------------------------------------------ client holds
    def lease(self, values: Iterable[Value], principal: str = "") -> str:
        """Hand the pins the caller holds on ``values`` to ``principal`` until
        :meth:`end_lease` or ``ttl_s``; the lease id."""
        held = list(values)
        lease_id = secrets.token_urlsafe(18)
        self._leases[lease_id] = (held, time.monotonic() + self.ttl_s, principal)
        return lease_id

    def end_lease(self, lease_id: str, principal: str = "") -> bool:
        """Unpin a lease's values; False when it was unknown, had expired (its ranges may
        have been reused since: what the client copied under it is not to be trusted), or
        belongs to another principal (then it stays held)."""
        entry = self._leases.get(lease_id)
        if entry is None or not secrets.compare_digest(entry[2], principal):
            return False
        del self._leases[lease_id]
        for value in entry[0]:
            self.unpin(value)
        return True

    def reservations_held(self, principal: str) -> tuple[int, int]:
        """(reservations, bytes) ``principal`` holds now."""
        return self._held.get(principal, (0, 0))

    @property
    def num_reservations(self) -> int:
        return len(self._reserved)

    def hold_reservation(self, items: list[tuple[str, Value | None]], principal: str = ""
                         ) -> str:
        """Keep unpublished ranges (with the keys they are for) for ``principal`` to fill until
        ``reservation_ttl_s``; the reservation id."""
        res_id = secrets.token_urlsafe(18)
        held = Reservation(items, principal, time.monotonic() + self.reservation_ttl_s)
        self._reserved[res_id] = held
        count, nbytes = self.reservations_held(principal)
        self._held[principal] = (count + 1, nbytes + held.nbytes)
        return res_id

    def take_reservation(self, res_id: str, principal: str = ""
                         ) -> list[tuple[str, Value | None]] | None:
        """The reservation's (key, range) pairs (the caller publishes or abandons them); None
        when unknown, expired or another principal's (then it stays held)."""
        held = self._reserved.get(res_id)
        if held is None or not secrets.compare_digest(held.principal, principal):
            return None
        del self._reserved[res_id]
        count, nbytes = self._held[principal]
        if count == 1:
            del self._held[principal]
        else:
            self._held[principal] = (count - 1, nbytes - held.nbytes)
        return held.items

    def expire(self) -> tuple[int, int]:
        """End leases and abandon reservations past their time; (leases, reservations)."""
        now = time.monotonic()
        leases = [(k, who) for k, (_, until, who) in self._leases.items() if until <= now]
        for lease_id, who in leases:
            self.end_lease(lease_id, who)
        held = [(k, r.principal) for k, r in self._reserved.items() if r.until <= now]
        for res_id, who in held:
            for _, value in self.take_reservation(res_id, who) or []:
                if value is not None:
                    self.abandon(value)
        return len(leases), len(held)

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> dict[str, int]:
        return {"host_keys": len(self._index), "host_bytes": self.live_bytes,
                "host_used_bytes": self.slots.used_bytes, "host_evictions": self.evictions,
                "shm_leases": len(self._leases), "shm_reservations": len(self._reserved)}

    def check_integrity(self) -> None:
        """AssertionError unless every allocated range is an indexed, leased, reserved or
        pinned value and the allocator's own invariants hold."""
        self.slots.check_integrity()
        assert self.live_bytes == sum(v.length for v in self._index.values())
        indexed = {v.start for v in self._index.values()}
        assert len(indexed) == len(self._index), "two keys share a range"
        reserved = {v.start for r in self._reserved.values() for _, v in r.items
                    if v is not None}
        leased = {v.start for vs, _, _ in self._leases.values() for v in vs}
        held: dict[str, tuple[int, int]] = {}
        for r in self._reserved.values():
            count, nbytes = held.get(r.principal, (0, 0))
            held[r.principal] = (count + 1, nbytes + r.nbytes)
        assert held == self._held, f"reservation totals {self._held} != {held}"
        assert self.slots.starts() >= indexed | reserved | leased

    def close(self) -> None:
        """Unlink the segment (mapped clients keep their mapping until they drop it)."""
        if self.segment is not None:
            self.segment.close()
