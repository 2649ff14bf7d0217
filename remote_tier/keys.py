"""Redis key layout of the remote tier.

An envelope lives at ``{prefix}:{layout_fp}:{page_hash}:{kind}``; a value stored under an
engine-supplied key lives at ``{prefix}:raw:{key}``. Prefixes and layout fingerprints exclude
``:`` and glob characters, and no layout fingerprint may be ``raw``, so two namespaces can
never produce the same key and ``SCAN MATCH {prefix}:*`` selects exactly one namespace.

Part ``i`` >= 1 of a value split into parts lives at ``{key} #{i}`` (part 0 at the key itself):
no key of either form contains a space, so a part key never equals a key, and the ``SCAN``
patterns still select a value's parts with it.

No hash tags are used: on a cluster the pages of one prefix spread over all slots, and
batches are grouped by slot (``key_slot``) at send time instead.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from redis.crc import key_slot as _crc_key_slot

from remote_tier.errors import BadKey

RAW_KIND = "raw"
MAX_KEY_CHARS = 1024

_TOKEN_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_KIND_RE = re.compile(r"[a-z0-9_]{1,16}")
_HASH_RE = re.compile(r"[0-9a-f]{8,128}")
_RAW_RE = re.compile(r"[\x21-\x7e]{1,600}")  # printable ASCII, no space
_ENVELOPE_RE = re.compile(
    r"([A-Za-z0-9._-]{1,64}):([A-Za-z0-9._-]{1,128}):([0-9a-f]{8,128}):([a-z0-9_]{1,16})"
)


class KeyParts(NamedTuple):
    """What a key says its value must be: the header fields a reader checks."""

    kind: str
    layout_fp: str


def envelope_key(prefix: str, layout_fp: str, page_hash_hex: str, kind: str) -> str:
    """The key of one envelope; raises ``BadKey`` on a malformed part."""
    if not _TOKEN_RE.fullmatch(prefix) or len(prefix) > 64:
        raise BadKey(f"prefix must be 1-64 of [A-Za-z0-9._-], got {prefix!r}")
    if not _TOKEN_RE.fullmatch(layout_fp) or layout_fp == RAW_KIND:
        raise BadKey(f"layout_fp must be 1-128 of [A-Za-z0-9._-] and not 'raw', got {layout_fp!r}")
    if not _HASH_RE.fullmatch(page_hash_hex):
        raise BadKey(f"page hash must be 8-128 lowercase hex digits, got {page_hash_hex!r}")
    if not _KIND_RE.fullmatch(kind) or kind == RAW_KIND:
        raise BadKey(f"kind must be 1-16 of [a-z0-9_] and not 'raw', got {kind!r}")
    return f"{prefix}:{layout_fp}:{page_hash_hex}:{kind}"


def raw_key(prefix: str, key: str) -> str:
    """The Redis key for an engine-supplied key (1-600 printable ASCII characters)."""
    if not _TOKEN_RE.fullmatch(prefix) or len(prefix) > 64:
        raise BadKey(f"prefix must be 1-64 of [A-Za-z0-9._-], got {prefix!r}")
    if not _RAW_RE.fullmatch(key):
        raise BadKey(f"raw key must be 1-600 printable ASCII characters, got {key[:80]!r}")
    return f"{prefix}:{RAW_KIND}:{key}"


def parse_key(prefix: str, key: str) -> KeyParts:
    """The expected header fields of ``key``; ``BadKey`` if it is not a key of ``prefix``."""
    match = _ENVELOPE_RE.fullmatch(key) if isinstance(key, str) else None
    if match is not None:
        key_prefix, fp, _, kind = match.groups()
        if key_prefix == prefix and fp != RAW_KIND and kind != RAW_KIND:
            return KeyParts(kind, fp)
    elif isinstance(key, str) and len(key) <= MAX_KEY_CHARS:
        head = f"{prefix}:{RAW_KIND}:"
        if key.startswith(head) and _RAW_RE.fullmatch(key, len(head)):
            return KeyParts(RAW_KIND, "")
    raise BadKey(f"{key!r:.80} is not an envelope or raw key under prefix {prefix!r}")


def part_key(key_b: bytes, index: int) -> bytes:
    """The Redis key of part ``index`` of the split value at ``key_b`` (part 0: ``key_b``)."""
    return key_b if index == 0 else b"%s #%d" % (key_b, index)


def is_part_key(key_b: bytes) -> bool:
    """Whether ``key_b`` names a part >= 1 of a split value."""
    return b" #" in key_b


def key_slot(key: bytes) -> int:
    """The Redis Cluster hash slot (0-16383) of an encoded key."""
    return _crc_key_slot(key)


def scan_pattern(prefix: str, layout_fp: str | None = None) -> str:
    """The ``SCAN MATCH`` glob for a whole namespace or one layout fingerprint in it."""
    if layout_fp is None:
        return f"{prefix}:*"
    if not _TOKEN_RE.fullmatch(layout_fp):
        raise BadKey(f"layout_fp must be 1-128 of [A-Za-z0-9._-], got {layout_fp!r}")
    return f"{prefix}:{layout_fp}:*"
