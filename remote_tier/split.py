"""Values split over several Redis keys: the Redis values a payload is written as, and the
reassembly of a split value read back (layout and headers: ``wire``; part keys: ``keys``).

A split value is visible once its head (part 0, at the key itself) is: the head is written
after every other part is acknowledged, so a reader goes by the head's header. Every part
carries the whole payload's MAC tag — bound to the head's key — so parts of two different
writes of one key, or of another key's value, are never taken for one value, and the
assembled payload is verified once as a whole against the key it is read at.
"""

from __future__ import annotations

from typing import Literal

from remote_tier import wire
from remote_tier.config import RemoteTierConfig
from remote_tier.errors import CorruptValue, ValueTooLarge
from remote_tier.keys import KeyParts, part_key
from remote_tier.mac import Mac
from remote_tier.resp import BulkSink, Reply

# Why an assembly failed, mildest first: a part unreadable now (node down: keep the value),
# a part missing (the value is useless), a part not of this value (corrupt).
Failure = Literal["unavailable", "incomplete", "corrupt"]
_RANK: dict[Failure | None, int] = {None: 0, "unavailable": 1, "incomplete": 2, "corrupt": 3}


def values_of(
    key: str, parts: KeyParts, payload: memoryview, config: RemoteTierConfig, mac: Mac
) -> list[tuple[bytes, bytes, memoryview]]:
    """``(Redis key, header, payload slice)`` of each Redis value storing ``payload`` at
    ``key``, the head last. Raises ``ValueTooLarge`` (the numbers in the message) when one
    would exceed ``max_value_bytes`` or the payload would need over ``wire.MAX_PARTS`` parts."""
    key_b, total, kind, fp = key.encode(), len(payload), parts.kind, parts.layout_fp
    num = wire.num_parts(total, config.chunk_bytes)
    if num > wire.MAX_PARTS:
        raise ValueTooLarge(
            f"value for {key[:80]!r} is {total} bytes: {num} parts of chunk_bytes "
            f"{config.chunk_bytes}, at most {wire.MAX_PARTS}"
        )
    if num == 1:
        values = [(key_b, wire.encode_header(mac, key_b, kind, fp, payload), payload)]
    else:
        digest = wire.tag(mac, key_b, kind, fp, payload, num)
        values = []
        for index in [*range(1, num), 0]:
            lo, hi = wire.part_span(total, num, index)
            header = wire.encode_part_header(kind, fp, total, digest, index, num)
            values.append((part_key(key_b, index), header, payload[lo:hi]))
    limit = config.max_value_bytes
    for _, header, body in values:
        if len(header) + len(body) > limit:
            raise ValueTooLarge(
                f"value for {key[:80]!r} is {len(header) + len(body)} bytes, "
                f"max_value_bytes is {limit}"
            )
    return values


class Assembly:
    """One split value being received into ``dest`` (its ``total`` bytes): the part
    headers seen so far and whether any failed. The head's tag is known up front
    (``digest``) or learnt from the head (``take_head``); ``tag_check`` is what verifies the
    assembled payload against it."""

    def __init__(
        self,
        key_b: bytes,
        parts: KeyParts,
        num_parts: int,
        dest: memoryview,
        digest: bytes | None = None,
    ) -> None:
        assert 2 <= num_parts <= wire.MAX_PARTS, f"{num_parts} parts"
        self.key_b = key_b
        self.parts = parts
        self.num_parts = num_parts
        self.dest = dest
        self.digest = digest
        self.failure: Failure | None = None
        self.first = 0  # where the replies of parts 1.. start in the caller's batch

    def part_keys(self) -> list[bytes]:
        """The Redis keys of parts 1 .. num_parts-1."""
        return [part_key(self.key_b, i) for i in range(1, self.num_parts)]

    def all_keys(self) -> list[bytes]:
        """The head's key and every part's."""
        return [self.key_b, *self.part_keys()]

    def sink(self, index: int) -> BulkSink:
        """Receive part ``index`` as (header scratch, its slice of ``dest``) when its length is
        what its header fields predict; else let the connection allocate (then rejected)."""
        total = len(self.dest)
        lo, hi = wire.part_span(total, self.num_parts, index)
        size = wire.part_header_size(
            self.parts.kind, self.parts.layout_fp, total, index, self.num_parts
        )
        target = self.dest[lo:hi]

        def sink(_: int, length: int) -> tuple[memoryview, ...] | None:
            return (memoryview(bytearray(size)), target) if length == size + hi - lo else None

        return sink

    def take_head(self, reply: Reply | Exception) -> bool:
        """Whether ``reply`` (of ``sink(0)``) is the head this layout expects; if so its
        tag is now ``digest``."""
        header = self._header(reply, 0)
        if header is None:
            return False
        self.digest = header.tag
        return True

    def take_part(self, index: int, reply: Reply | Exception) -> None:
        """Check the reply for part ``index`` (of ``sink(index)``); a bad one sets ``failure``."""
        if isinstance(reply, Exception):
            self._fail("unavailable")
        elif reply is None:
            self._fail("incomplete")
        elif self._header(reply, index) is None:
            self._fail("corrupt")

    def finish(self) -> memoryview | None:
        """The assembled payload (``dest``) once every part passed (its tag is still to
        verify: ``tag_check``); else ``None`` with ``failure`` set."""
        return self.dest if self.failure is None else None

    def tag_check(self) -> wire.TagCheck:
        """The check of the assembled payload's tag against the head's key."""
        kind, fp, num = self.parts.kind, self.parts.layout_fp, self.num_parts
        binding = wire.binding(kind, fp, len(self.dest), num)
        return wire.TagCheck(self.key_b, binding, self.dest, self.digest or b"")

    def _fail(self, failure: Failure) -> None:
        if _RANK[failure] > _RANK[self.failure]:
            self.failure = failure

    def _header(self, reply: Reply | Exception, index: int) -> wire.Header | None:
        """The header of a reply received as (scratch, slice), if it is exactly the one
        expected for part ``index`` (any tag while ``digest`` is unknown)."""
        if not (isinstance(reply, tuple) and len(reply) == 2):
            return None
        scratch = reply[0]
        try:
            header, size = wire.read_header(scratch)
        except CorruptValue:
            return None
        digest = header.tag if self.digest is None else self.digest
        want = wire.Header(
            wire.SPLIT_FORMAT_VERSION,
            self.parts.kind,
            self.parts.layout_fp,
            len(self.dest),
            digest,
            index,
            self.num_parts,
        )
        return header if size == len(scratch) and header == want else None


def part_requests(assemblies: list[Assembly]) -> tuple[list[bytes], list[BulkSink]]:
    """The keys and sinks to read parts 1.. of every assembly in one batch (each part into
    its slice of ``dest``); sets each one's ``first``."""
    keys_b: list[bytes] = []
    sinks: list[BulkSink] = []
    for a in assemblies:
        a.first = len(keys_b)
        keys_b += a.part_keys()
        sinks += [a.sink(j) for j in range(1, a.num_parts)]
    return keys_b, sinks


def take_parts(assemblies: list[Assembly], replies: list[Reply | Exception]) -> None:
    """Check the replies to ``part_requests(assemblies)``."""
    for a in assemblies:
        for j in range(1, a.num_parts):
            a.take_part(j, replies[a.first + j - 1])
