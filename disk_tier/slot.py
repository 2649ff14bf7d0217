"""The on-disk slot: a fixed header, then the envelope, padded to the alignment.

A slot's header names what the slot holds (kind, page key, the page's parent key and depth,
so that a restart can re-link pages into a prefix tree), which layout wrote it (a hash of the
layout fingerprint), a generation (the writer's counter: of two slots claiming one key the
newer wins), the body length and a MAC (``remote_tier.mac.Mac``, the scheme L3 uses) over
``(page key, header fields, body)``. Header and body go down in one write; a slot whose write
was torn, whose key or layout is not the expected one, or whose tag does not verify is a miss.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3

MAGIC = b"TSDSLOT1"
ALIGN = 4096  # file offsets, lengths and buffers of O_DIRECT I/O are multiples of this
HEADER_BYTES = 512  # the header's room at the head of each slot
KEY_BYTES = 32  # room for a page key (sha256: 32 bytes, xxh3-128: 16)
KINDS = ("kv", "swa", "state")
# magic, generation, kind, key len, parent len, depth, body length, layout hash, key, parent
_FIELDS = struct.Struct(">8sQBBBxII16s32s32s")
TAG_AT = _FIELDS.size
TAG_BYTES = 16


def slot_bytes(unit: int) -> int:
    """Bytes of a slot holding a ``unit``-byte envelope (header included, aligned)."""
    return -(-(HEADER_BYTES + unit) // ALIGN) * ALIGN


def layout_hash(fingerprint: str) -> bytes:
    """The 16 bytes of a layout fingerprint a header carries."""
    return blake3.blake3(fingerprint.encode()).digest(16)


@dataclass(frozen=True)
class SlotMeta:
    """What a slot holds: ``key`` (the page key; for a checkpoint, the key of the page it
    ends), ``parent`` (the previous page's key; empty for a first page) and ``depth`` (the
    page's position in the prompt, in pages)."""

    key: bytes
    parent: bytes
    depth: int

    def __post_init__(self) -> None:
        if not 0 < len(self.key) <= KEY_BYTES or len(self.parent) > KEY_BYTES:
            raise ValueError(f"page keys are 1..{KEY_BYTES} bytes, got {len(self.key)} "
                             f"(parent {len(self.parent)})")
        if not 0 <= self.depth < 1 << 32:
            raise ValueError(f"depth must fit in 32 bits, got {self.depth}")


@dataclass(frozen=True)
class Header:
    """A decoded slot header (its tag not yet checked against the body)."""

    generation: int
    kind: str
    meta: SlotMeta
    length: int
    layout: bytes
    fields: bytes  # the packed fields the tag covers
    tag: bytes


def pack(generation: int, kind: str, meta: SlotMeta, length: int, layout: bytes) -> bytes:
    """The header's fields (without the tag) for a slot about to be written."""
    return _FIELDS.pack(MAGIC, generation, KINDS.index(kind), len(meta.key), len(meta.parent),
                        meta.depth, length, layout, meta.key, meta.parent)


def unpack(raw: bytes | memoryview) -> Header | None:
    """The header at the start of ``raw``, or None when it is not one (never written, torn,
    another format)."""
    if len(raw) < TAG_AT + TAG_BYTES or bytes(raw[:8]) != MAGIC:
        return None
    fields = bytes(raw[:TAG_AT])
    _, gen, kind, klen, plen, depth, length, layout, key, parent = _FIELDS.unpack(fields)
    if kind >= len(KINDS) or not 0 < klen <= KEY_BYTES or plen > KEY_BYTES:
        return None
    meta = SlotMeta(key[:klen], parent[:plen], depth)
    return Header(gen, KINDS[kind], meta, length, layout, fields,
                  bytes(raw[TAG_AT:TAG_AT + TAG_BYTES]))


@dataclass(frozen=True)
class Recovered:
    """A slot a previous run left: its kind, slot number, what it holds and its
    generation (its header verified; its tag is checked when it is read)."""

    kind: str
    slot: int
    meta: SlotMeta
    generation: int
