"""The stored value: a small msgpack header followed by the raw payload bytes.

A whole value (format 5) has the header ``[5, kind, layout_fp, payload_len, tag]`` where
``tag`` is the 16-byte keyed MAC (``mac.Mac``, BLAKE3 keyed with the deployment's secret) of
the payload under the full Redis key and the *binding* ``[version, kind, layout_fp,
payload_len, num_parts]``, followed by the payload. Only a holder of the secret can make a
value that verifies; a value copied under another key fails there. The tag is packed as
``bin 8`` so the header's size depends only on ``(kind, layout_fp, payload_len)`` — a reader
that knows those can receive the payload straight into its own buffer (``header_size``).

A payload split into ``num_parts`` parts (format 6, ``num_parts`` >= 2) is stored as one value
per part, each with the header ``[6, kind, layout_fp, total_len, tag, index, num_parts]``
(``total_len`` and ``tag`` of the whole payload, bound to the head's key) followed by that
part's bytes: part ``index`` is ``payload[part_span(total_len, num_parts, index)]`` — parts of
``ceil(total_len / num_parts)`` bytes, the last one the remainder. Its header size depends
only on ``(kind, layout_fp, total_len, index, num_parts)`` (``part_header_size``).

Formats 1 to 4 (unkeyed checksums: xxh3 over the payload, then over key and payload) are no
longer accepted: a reader raises ``OldFormat`` (a ``CorruptValue``), so such values read as
misses and are deleted. A tag that does not verify raises ``BadTag`` (also a
``CorruptValue``).

Nothing here copies a payload: ``encode_header`` reads it once for the tag, and ``decode``
returns a ``memoryview`` slice of the value it was given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgpack

from remote_tier.errors import CorruptValue, OldFormat
from remote_tier.mac import TAG_BYTES, Mac

if TYPE_CHECKING:
    from typing_extensions import Buffer

FORMAT_VERSION = 5
SPLIT_FORMAT_VERSION = 6
OLD_VERSIONS = (1, 2, 3, 4)  # unkeyed checksums (before the MAC)
MAX_HEADER_BYTES = 256
MAX_PARTS = 4096

_NUM_FIELDS = {FORMAT_VERSION: 5, SPLIT_FORMAT_VERSION: 7}
BAD_TAG = "MAC mismatch (damaged, forged, another key's value, or another secret)"


class OldSplit(OldFormat):
    """The head of a split value in format 4: its other ``num_parts - 1`` parts go with it."""

    def __init__(self, message: str, num_parts: int) -> None:
        super().__init__(message)
        self.num_parts = num_parts


class BadTag(CorruptValue):
    """A value whose MAC tag does not verify: damaged, forged, written under another key, or
    written with another deployment's secret."""


class Header(NamedTuple):
    """A decoded value header; ``payload_len`` and ``tag`` are the whole payload's (of every
    part together, for a split value), ``part`` is the ``index`` field (0 when whole)."""

    version: int
    kind: str
    layout_fp: str
    payload_len: int
    tag: bytes
    part: int = 0
    num_parts: int = 1


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, numpy, …)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("payload buffer must be C-contiguous")
        view = view.cast("B")
    return view


def binding(kind: str, layout_fp: str, payload_len: int, num_parts: int = 1) -> bytes:
    """The header fields a tag binds besides key and payload: those every part shares."""
    version = FORMAT_VERSION if num_parts == 1 else SPLIT_FORMAT_VERSION
    return msgpack.packb([version, kind, layout_fp, payload_len, num_parts])


def tag(mac: Mac, key_b: bytes, kind: str, layout_fp: str, payload: Buffer,
        num_parts: int = 1) -> bytes:
    """The MAC tag of ``payload`` stored at the Redis key ``key_b`` (a split value's head key)
    in ``num_parts`` parts."""
    view = as_bytes_view(payload)
    return mac.sign(key_b, binding(kind, layout_fp, len(view), num_parts), view)


def encode_header(mac: Mac, key_b: bytes, kind: str, layout_fp: str, payload: memoryview
                  ) -> bytes:
    """The header to store in front of ``payload`` at the Redis key ``key_b``."""
    digest = tag(mac, key_b, kind, layout_fp, payload)
    return msgpack.packb(
        [FORMAT_VERSION, kind, layout_fp, len(payload), digest], use_bin_type=True
    )


def header_size(kind: str, layout_fp: str, payload_len: int) -> int:
    """Bytes of the header of a ``payload_len``-byte payload with this kind and fingerprint."""
    return len(
        msgpack.packb(
            [FORMAT_VERSION, kind, layout_fp, payload_len, bytes(TAG_BYTES)],
            use_bin_type=True,
        )
    )


def encode_part_header(
    kind: str, layout_fp: str, total_len: int, digest: bytes, index: int, num_parts: int
) -> bytes:
    """The header to store in front of part ``index`` of a split payload (``digest``: the
    whole payload's tag, ``tag(..., num_parts)``)."""
    fields = [SPLIT_FORMAT_VERSION, kind, layout_fp, total_len, digest, index, num_parts]
    return msgpack.packb(fields, use_bin_type=True)


def part_header_size(kind: str, layout_fp: str, total_len: int, index: int, num_parts: int) -> int:
    """Bytes of the header of part ``index`` of a split payload."""
    return len(
        encode_part_header(kind, layout_fp, total_len, bytes(TAG_BYTES), index, num_parts)
    )


def num_parts(total_len: int, chunk_bytes: int) -> int:
    """How many parts a ``total_len``-byte payload is stored in (1: whole; ``chunk_bytes`` 0:
    never split)."""
    if chunk_bytes <= 0 or total_len <= chunk_bytes:
        return 1
    return -(-total_len // chunk_bytes)


def part_span(total_len: int, num_parts: int, index: int) -> tuple[int, int]:
    """``(start, end)`` of part ``index`` in the payload."""
    size = -(-total_len // num_parts)
    return min(total_len, index * size), min(total_len, (index + 1) * size)


def read_header(value: memoryview) -> tuple[Header, int]:
    """The header at the start of ``value`` and its size; ``CorruptValue`` if malformed."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_HEADER_BYTES)
    unpacker.feed(value[:MAX_HEADER_BYTES])
    try:
        fields = unpacker.unpack()
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptValue(f"unreadable header: {type(exc).__name__}") from None
    size = unpacker.tell()
    if not isinstance(fields, list) or not fields:
        raise CorruptValue("header is not a 5-field array")
    version = fields[0]
    want = _NUM_FIELDS.get(version) if _is_count(version) else None
    if version in OLD_VERSIONS and _is_count(version):
        why = f"format version {version} (an unkeyed checksum, before the MAC)"
        parts = fields[6] if version == 4 and len(fields) == 7 else 0
        if _is_count(parts) and 2 <= parts <= MAX_PARTS:
            raise OldSplit(why, parts)
        raise OldFormat(why)
    if want is None:
        raise CorruptValue(
            f"format version {version!r}, expected {FORMAT_VERSION} or {SPLIT_FORMAT_VERSION}"
        )
    if len(fields) != want:
        raise CorruptValue(f"header is not a {want}-field array (format version {version})")
    _, kind, layout_fp, payload_len, digest, *split = fields
    if not isinstance(kind, str) or not isinstance(layout_fp, str):
        raise CorruptValue("header kind/layout_fp are not strings")
    if not _is_count(payload_len):
        raise CorruptValue(f"bad payload length {payload_len!r}")
    if not isinstance(digest, bytes) or len(digest) != TAG_BYTES:
        raise CorruptValue("bad tag field")
    if not split:
        return Header(version, kind, layout_fp, payload_len, digest), size
    index, parts = split
    if not (_is_count(parts) and 2 <= parts <= MAX_PARTS):
        raise CorruptValue(f"bad part count {parts!r}")
    if not (_is_count(index) and index < parts):
        raise CorruptValue(f"bad part index {index!r} of {parts}")
    if part_span(payload_len, parts, parts - 1)[0] >= payload_len:
        raise CorruptValue(f"{payload_len} bytes cannot fill {parts} parts")
    return Header(version, kind, layout_fp, payload_len, digest, index, parts), size


def _is_count(value: object) -> bool:
    """A non-negative ``int`` (msgpack booleans are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TagCheck(NamedTuple):
    """A tag still to verify: of ``payload`` stored at ``key_b`` with ``binding``."""

    key_b: bytes
    binding: bytes
    payload: memoryview
    tag: bytes

    def passes(self, mac: Mac) -> bool:
        """Whether the tag verifies (thread-safe: the store runs large ones on workers)."""
        return mac.verify(self.key_b, self.binding, self.payload, self.tag)


def check_whole(
    header: Header, payload: memoryview, *, key_b: bytes, kind: str, layout_fp: str
) -> TagCheck:
    """Check a whole value's header against what its key ``key_b`` promises (``CorruptValue``
    if not); the tag check that remains."""
    if header.version != FORMAT_VERSION:
        raise CorruptValue(f"part {header.part} of {header.num_parts}, not a whole value")
    if header.kind != kind:
        raise CorruptValue(f"kind {header.kind!r}, key says {kind!r}")
    if header.layout_fp != layout_fp:
        raise CorruptValue(f"layout fingerprint {header.layout_fp!r}, key says {layout_fp!r}")
    if header.payload_len != len(payload):
        raise CorruptValue(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    return TagCheck(key_b, binding(kind, layout_fp, len(payload)), payload, header.tag)


def verify(
    mac: Mac, header: Header, payload: memoryview, *, key_b: bytes, kind: str, layout_fp: str
) -> None:
    """Check a whole value's header against what its key ``key_b`` promises and its tag
    against the key, header and payload (``BadTag``)."""
    check = check_whole(header, payload, key_b=key_b, kind=kind, layout_fp=layout_fp)
    if not check.passes(mac):
        raise BadTag(BAD_TAG)


def decode(mac: Mac, value: Buffer, *, key_b: bytes, kind: str, layout_fp: str) -> memoryview:
    """The payload of the value stored at ``key_b`` (a view into it), after every check."""
    view = as_bytes_view(value)
    header, size = read_header(view)
    payload = view[size:]
    verify(mac, header, payload, key_b=key_b, kind=kind, layout_fp=layout_fp)
    return payload


def encode(mac: Mac, key_b: bytes, kind: str, layout_fp: str, payload: Buffer) -> bytes:
    """The whole value to store at ``key_b`` as one ``bytes`` (tests and tools; the store
    sends header and payload separately and never joins them)."""
    view = as_bytes_view(payload)
    return encode_header(mac, key_b, kind, layout_fp, view) + view.tobytes()
