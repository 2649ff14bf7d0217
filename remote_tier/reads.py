"""``ReadBatch``: the bookkeeping of one ``get_many`` — which keys to fetch into which
buffers, and what the replies hold: whole values checked, split values assembled, failed
ones listed for deletion. No I/O here: ``RedisTier`` sends the batches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from remote_tier import wire
from remote_tier.buffers import BufferPool
from remote_tier.errors import CorruptValue, OldFormat
from remote_tier.keys import KeyParts, part_key
from remote_tier.resp import BulkSink, Reply
from remote_tier.split import Assembly
from remote_tier.stats import Counters

log = logging.getLogger(__name__)

_POOLED_MIN_BYTES = 64 * 1024


class ReadBatch:
    """One read of ``keys_b`` (into ``outs`` when given). ``fetch``/``sinks`` are the first
    batch: every head and, with ``outs``, every part that ``chunk_bytes`` predicts, each
    received straight into its slice. ``take_heads`` then ``finish`` (after reading the parts
    of the split values it returned); ``corrupt`` (heads) and ``useless`` (other keys) are
    then what to delete, and ``absent`` the keys that read as absent (a key holding another
    Redis type than a string reads absent too: ``RedisTier`` probes them). A payload is a
    result only once its tag verifies: ``checks`` lists the tags still to verify after
    ``finish``, and ``settle`` takes the verdicts (the store hashes large payloads on worker
    threads, so the loop is not held while it does)."""

    def __init__(
        self,
        keys_b: list[bytes],
        parts: list[KeyParts],
        outs: list[memoryview] | None,
        *,
        chunk_bytes: int,
        buffers: BufferPool,
        counters: Counters,
    ) -> None:
        self._keys_b = keys_b
        self.checks: list[tuple[int, wire.TagCheck]] = []  # (result index, its tag to verify)
        self._parts = parts
        self._outs = outs
        self._buffers = buffers
        self._counters = counters
        self.results: list[memoryview | None] = [None] * len(keys_b)
        self.corrupt: list[bytes] = []  # heads of corrupt values
        self.useless: list[bytes] = []  # their parts, and every key of incomplete values
        self.absent: list[int] = []  # keys whose head read as nil
        self._assemblies: list[tuple[int, Assembly]] = []
        self._planned: list[Assembly | None] = [None] * len(keys_b)
        self.fetch = list(keys_b)
        # Not a bound method: a batch referring to itself would keep the pooled buffers its
        # replies landed in looking busy until the garbage collector ran.
        self.sinks: list[BulkSink] = [_pooled_sink(buffers)] * len(keys_b)
        for i, out in enumerate(outs or ()):
            num = wire.num_parts(len(out), chunk_bytes)
            if num == 1:
                self.sinks[i] = _sink(parts[i], out)
                continue
            plan = Assembly(keys_b[i], parts[i], num, out)
            plan.first = len(self.fetch)
            self._planned[i] = plan
            self.sinks[i] = plan.sink(0)
            self.fetch += plan.part_keys()
            self.sinks += [plan.sink(j) for j in range(1, num)]

    def take_heads(self, replies: list[Reply | Exception]) -> list[Assembly]:
        """Take the replies to ``fetch``; the split values whose other parts are still to
        read (their heads copied into place)."""
        later: list[Assembly] = []
        for i, plan in enumerate(self._planned):
            if plan is not None and plan.take_head(replies[i]):
                for j in range(1, plan.num_parts):
                    plan.take_part(j, replies[plan.first + j - 1])
                self._assemblies.append((i, plan))
                continue
            out = None if self._outs is None else self._outs[i]
            if replies[i] is None:
                self.absent.append(i)
            got = self._accept(i, replies[i], self._parts[i], self._keys_b[i], out)
            if isinstance(got, Assembly):
                self._assemblies.append((i, got))
                later.append(got)
            elif isinstance(got, list):  # corrupt: the head and the parts it names go
                self.corrupt.append(self._keys_b[i])
                self.useless += got + (plan.part_keys() if plan is not None else [])
            else:
                self.results[i] = got
        return later

    def finish(self) -> int:
        """Settle every split value's parts (``results``, failures counted and listed; the
        tags of whole ones go to ``checks``); the number of Redis values the hits were read
        from."""
        num_values = sum(r is not None for r in self.results)
        num_incomplete = 0
        for i, a in self._assemblies:
            self.results[i] = got = a.finish()
            if got is not None:
                num_values += a.num_parts
                self.checks.append((i, a.tag_check()))
            elif a.failure == "corrupt":
                self._counters.anomaly("corrupt", a.parts.kind, f"bad part of {a.key_b[:80]!r}")
                self.corrupt.append(a.key_b)
                self.useless += a.part_keys()
            elif a.failure == "incomplete":
                num_incomplete += 1
                self.useless += a.all_keys()
        if num_incomplete:
            log.warning("%d split values miss a part; deleting them", num_incomplete)
            self._counters.error("incomplete", num_incomplete)
        return num_values

    def settle(self, verdicts: Sequence[bool]) -> None:
        """Take whether each of ``checks`` verified: a value whose tag did not is a miss,
        counted (``corrupt``, ``num_mac_failures``) and listed for deletion with its parts."""
        split = dict(self._assemblies)
        for (i, check), ok in zip(self.checks, verdicts, strict=True):
            if ok:
                continue
            self.results[i] = None
            self._counters.num_mac_failures += 1
            key_b = check.key_b
            detail = f"{wire.BAD_TAG} at {key_b[:80]!r}"
            self._counters.anomaly("corrupt", self._parts[i].kind, detail)
            self.corrupt.append(key_b)
            if i in split:
                self.useless += split[i].part_keys()
        self.checks = []

    def _accept(
        self,
        i: int,
        reply: Reply | Exception,
        parts: KeyParts,
        key_b: bytes,
        out: memoryview | None,
    ) -> memoryview | Assembly | list[bytes] | None:
        """What the reply for head ``i`` holds: the payload of a whole value (its tag still
        to check: added to ``checks``), the ``Assembly`` of a split one, the keys of the
        other parts of a corrupt one (``[]`` when not known), or ``None`` (a miss)."""
        if reply is None or isinstance(reply, Exception):
            return None
        doomed: list[bytes] = []
        try:
            if isinstance(reply, tuple) and len(reply) == 2:  # received as (header scratch, out)
                scratch, payload = reply
                header = _whole_header(scratch)
                if header is not None and out is not None and len(payload) == len(out):
                    check = wire.check_whole(
                        header, payload, key_b=key_b, kind=parts.kind, layout_fp=parts.layout_fp
                    )
                    self.checks.append((i, check))
                    return payload
                value = memoryview(b"".join(reply))  # another layout than expected: rejoin
            elif isinstance(reply, tuple) and len(reply) == 1:  # received into a pooled buffer
                value = reply[0]
            elif isinstance(reply, (bytes, bytearray, memoryview)):
                value = wire.as_bytes_view(reply)
            else:
                raise CorruptValue(f"reply of type {type(reply).__name__}")
            header, size = wire.read_header(value)
            payload = value[size:]
            if header.version == wire.FORMAT_VERSION:
                check = wire.check_whole(
                    header, payload, key_b=key_b, kind=parts.kind, layout_fp=parts.layout_fp
                )
            else:
                doomed = [part_key(key_b, i) for i in range(1, header.num_parts)]
                return self._split_head(header, payload, parts, key_b, out)
        except CorruptValue as exc:
            kind = "old_format" if isinstance(exc, OldFormat) else "corrupt"
            self._counters.anomaly(kind, parts.kind, f"{exc} at {key_b[:80]!r}")
            if isinstance(exc, wire.OldSplit):
                doomed = [part_key(key_b, i) for i in range(1, exc.num_parts)]
            return doomed
        if out is not None:  # a value whose header size was unexpected came in whole
            if len(payload) != len(out):
                self._counters.error("size_mismatch")
                return None
            out[:] = payload
            payload = out
        self.checks.append((i, check._replace(payload=payload)))
        return payload

    def _split_head(
        self,
        header: wire.Header,
        payload: memoryview,
        parts: KeyParts,
        key_b: bytes,
        out: memoryview | None,
    ) -> Assembly | None:
        """The assembly of a split value from its head, which came in whole (``None``: a
        valid head, but ``out`` is of another size). Raises ``CorruptValue``."""
        total = header.payload_len
        if (header.part, header.kind, header.layout_fp) != (0, parts.kind, parts.layout_fp):
            raise CorruptValue(f"part {header.part} ({header.kind}/{header.layout_fp}) as head")
        end = wire.part_span(total, header.num_parts, 0)[1]
        if len(payload) != end:
            raise CorruptValue(f"head holds {len(payload)} bytes, its header says {end}")
        if out is not None and len(out) != total:
            self._counters.error("size_mismatch")
            return None
        if out is not None:
            dest = out
        elif total >= _POOLED_MIN_BYTES:
            dest = self._buffers.take(total)
        else:
            dest = memoryview(bytearray(total))
        dest[:end] = payload
        return Assembly(key_b, parts, header.num_parts, dest, header.tag)


def _pooled_sink(buffers: BufferPool) -> BulkSink:
    """Receive a large value into a reusable buffer (small ones: a fresh bytearray)."""

    def sink(_: int, length: int) -> Sequence[memoryview] | None:
        return (buffers.take(length),) if length >= _POOLED_MIN_BYTES else None

    return sink


def _whole_header(scratch: memoryview) -> wire.Header | None:
    """The header of a whole value received as (``scratch``, payload), if ``scratch`` holds
    exactly one; else ``None`` (the value is of another layout, or corrupt)."""
    try:
        header, size = wire.read_header(scratch)
    except CorruptValue:
        return None
    return header if size == len(scratch) and header.version == wire.FORMAT_VERSION else None


def _sink(parts: KeyParts, out: memoryview) -> BulkSink:
    """Receive a value of the expected size as (header scratch, ``out``); else let the
    connection allocate (the value is then checked, and rejected, as a whole)."""
    head_size = wire.header_size(parts.kind, parts.layout_fp, len(out))

    def sink(_: int, length: int) -> Sequence[memoryview] | None:
        if length != head_size + len(out):
            return None
        return (memoryview(bytearray(head_size)), out)

    return sink
