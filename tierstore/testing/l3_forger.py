"""What someone with write access to the L3 Redis, but not the deployment's MAC secret, can
write there: values the tier must never serve (tests of the MAC).

- ``old_checksum_value``: the value in wire format 3, whose unkeyed xxh3 checksum over the
  key, layout fingerprint and payload anyone can compute (what tierstore accepted before the
  MAC).
- ``foreign_value``: the value in the current format, signed with a secret of the forger's.
"""

from __future__ import annotations

import os
import struct

import msgpack
import xxhash

from remote_tier import wire
from remote_tier.mac import Mac


def key_fields(key: str) -> tuple[str, str]:
    """``(kind, layout_fp)`` that a tier key promises (``raw`` keys: ``("raw", "")``)."""
    _, fp, *rest = key.split(":")
    if fp == "raw":
        return "raw", ""
    return rest[-1], fp


def old_checksum_value(key: str, payload: bytes) -> bytes:
    """``payload`` at ``key`` in wire format 3, with a correct unkeyed checksum."""
    kind, fp = key_fields(key)
    key_b, fp_b = key.encode(), fp.encode()
    h = xxhash.xxh3_64(struct.pack(">I", len(key_b)) + key_b + struct.pack(">I", len(fp_b)) + fp_b)
    h.update(struct.pack(">Q", len(payload)))
    h.update(payload)
    header = msgpack.packb([3, kind, fp, len(payload), h.digest()], use_bin_type=True)
    return bytes(header) + payload


def foreign_value(key: str, payload: bytes) -> bytes:
    """``payload`` at ``key`` in the current format, tagged under a random secret."""
    kind, fp = key_fields(key)
    return wire.encode(Mac(os.urandom(32)), key.encode(), kind, fp, payload)
