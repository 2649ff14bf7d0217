"""The stored value: a small msgpack header followed by the raw payload bytes.

The header is the msgpack array ``[version, kind, layout_fp, payload_len, checksum]`` where
``checksum`` is the 8-byte big-endian xxh3-64 digest of the payload, packed as ``bin 8`` so
the header's size depends only on ``(kind, layout_fp, payload_len)`` — a reader that knows
those can receive the payload straight into its own buffer (``header_size``).

Nothing here copies a payload: ``encode_header`` reads it once for the checksum, and
``decode`` returns a ``memoryview`` slice of the value it was given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgpack
import xxhash

from remote_tier.errors import CorruptValue

if TYPE_CHECKING:
    from typing_extensions import Buffer

FORMAT_VERSION = 1
MAX_HEADER_BYTES = 256
CHECKSUM_BYTES = 8


class Header(NamedTuple):
    """A decoded value header."""

    version: int
    kind: str
    layout_fp: str
    payload_len: int
    checksum: bytes


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, numpy, …)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("payload buffer must be C-contiguous")
        view = view.cast("B")
    return view


def checksum(payload: Buffer) -> bytes:
    """The xxh3-64 digest of ``payload``."""
    return xxhash.xxh3_64_digest(payload)


def encode_header(kind: str, layout_fp: str, payload: memoryview) -> bytes:
    """The header to store in front of ``payload``."""
    return msgpack.packb(
        [FORMAT_VERSION, kind, layout_fp, len(payload), checksum(payload)], use_bin_type=True
    )


def header_size(kind: str, layout_fp: str, payload_len: int) -> int:
    """Bytes of the header of a ``payload_len``-byte payload with this kind and fingerprint."""
    return len(
        msgpack.packb(
            [FORMAT_VERSION, kind, layout_fp, payload_len, bytes(CHECKSUM_BYTES)],
            use_bin_type=True,
        )
    )


def read_header(value: memoryview) -> tuple[Header, int]:
    """The header at the start of ``value`` and its size; ``CorruptValue`` if malformed."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_HEADER_BYTES)
    unpacker.feed(value[:MAX_HEADER_BYTES])
    try:
        fields = unpacker.unpack()
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptValue(f"unreadable header: {type(exc).__name__}") from None
    size = unpacker.tell()
    if not isinstance(fields, list) or len(fields) != 5:
        raise CorruptValue("header is not a 5-field array")
    version, kind, layout_fp, payload_len, digest = fields
    if version != FORMAT_VERSION:
        raise CorruptValue(f"format version {version!r}, expected {FORMAT_VERSION}")
    if not isinstance(kind, str) or not isinstance(layout_fp, str):
        raise CorruptValue("header kind/layout_fp are not strings")
    if not isinstance(payload_len, int) or payload_len < 0:
        raise CorruptValue(f"bad payload length {payload_len!r}")
    if not isinstance(digest, bytes) or len(digest) != CHECKSUM_BYTES:
        raise CorruptValue("bad checksum field")
    return Header(version, kind, layout_fp, payload_len, digest), size


def verify(header: Header, payload: memoryview, *, kind: str, layout_fp: str) -> None:
    """Check a header against what the key promises and against its payload."""
    if header.kind != kind:
        raise CorruptValue(f"kind {header.kind!r}, key says {kind!r}")
    if header.layout_fp != layout_fp:
        raise CorruptValue(f"layout fingerprint {header.layout_fp!r}, key says {layout_fp!r}")
    if header.payload_len != len(payload):
        raise CorruptValue(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise CorruptValue("payload checksum mismatch")


def decode(value: Buffer, *, kind: str, layout_fp: str) -> memoryview:
    """The payload of a stored value (a view into it), after every check passes."""
    view = as_bytes_view(value)
    header, size = read_header(view)
    payload = view[size:]
    verify(header, payload, kind=kind, layout_fp=layout_fp)
    return payload


def encode(kind: str, layout_fp: str, payload: Buffer) -> bytes:
    """The whole value as one ``bytes`` (tests and tools; the store sends header and payload
    separately and never joins them)."""
    view = as_bytes_view(payload)
    return encode_header(kind, layout_fp, view) + view.tobytes()
