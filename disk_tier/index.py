"""The checkpointed index: what a cleanly closed tier held, so that a clean restart reads one
file instead of every slot's header.

Written at close (``index.bin``: a header, one fixed row per held slot, a MAC over both with
the tier's key); read at open and deleted before the tier is used, so after a crash there is
no index and the tier scans. Rows are trusted as far as the MAC goes: each slot is still
verified when it is read, so a stale row can only cost a miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Mapping

import numpy as np

from disk_tier.slot import KEY_BYTES, KINDS, Recovered, SlotMeta
from remote_tier.mac import TAG_BYTES, Mac

log = logging.getLogger(__name__)

NAME = "index.bin"
_MAGIC = b"TSDIDX01"
_HEAD = struct.Struct(">8s16sQQ")  # magic, layout hash, next generation, rows
_ROW = np.dtype([("kind", "u1"), ("klen", "u1"), ("plen", "u1"), ("slot", ">u4"),
                 ("depth", ">u4"), ("gen", ">u8"), ("key", "u1", (KEY_BYTES,)),
                 ("parent", "u1", (KEY_BYTES,))])
_MAC_KEY = b"tierstore disk index"


def save(where: str, mac: Mac, layout: bytes, next_gen: int,
         held: Mapping[str, Mapping[int, SlotMeta]], gens: Mapping[str, Mapping[int, int]]
         ) -> None:
    """Write the index of ``held`` ({kind: {slot: meta}}, generations ``gens``) to ``where``
    (atomically)."""
    entries = [(KINDS.index(kind), slot, meta, gens[kind].get(slot, 0))
               for kind, slots in held.items() for slot, meta in slots.items()]
    rows = np.zeros(len(entries), _ROW)  # filled a column at a time: rows one by one are slow
    if entries:
        rows["kind"] = [e[0] for e in entries]
        rows["slot"] = [e[1] for e in entries]
        rows["depth"] = [e[2].depth for e in entries]
        rows["gen"] = [e[3] for e in entries]
        rows["klen"] = [len(e[2].key) for e in entries]
        rows["plen"] = [len(e[2].parent) for e in entries]
        rows["key"] = np.frombuffer(b"".join(e[2].key.ljust(KEY_BYTES, b"\0")
                                             for e in entries), np.uint8).reshape(-1, KEY_BYTES)
        rows["parent"] = np.frombuffer(b"".join(e[2].parent.ljust(KEY_BYTES, b"\0")
                                                for e in entries),
                                       np.uint8).reshape(-1, KEY_BYTES)
    n = len(entries)
    head = _HEAD.pack(_MAGIC, layout, next_gen, n)
    body = rows.tobytes()
    tmp = where + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head + body + mac.sign(_MAC_KEY, head, body))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, where)


def take(where: str, mac: Mac, layout: bytes) -> tuple[list[Recovered], int] | None:
    """The slots and next generation of the index at ``where``, which is deleted first;
    None when there is none or it does not verify."""
    try:
        with open(where, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(where)  # used once: a crash from here on leaves no stale index
    if len(raw) < _HEAD.size + TAG_BYTES:
        return None
    head, body, tag = raw[:_HEAD.size], raw[_HEAD.size:-TAG_BYTES], raw[-TAG_BYTES:]
    magic, lay, next_gen, n = _HEAD.unpack(head)
    if (magic != _MAGIC or lay != layout or len(body) != n * _ROW.itemsize
            or not mac.verify(_MAC_KEY, head, body, tag)):
        log.warning("disk tier index %s does not verify; scanning the slots instead", where)
        return None
    rows = np.frombuffer(body, _ROW)
    keys, parents = rows["key"].tobytes(), rows["parent"].tobytes()
    out = []
    columns = (rows[c].tolist() for c in ("kind", "slot", "depth", "gen", "klen", "plen"))
    for i, (kind, slot, depth, gen, klen, plen) in enumerate(zip(*columns, strict=True)):
        at = i * KEY_BYTES
        if kind >= len(KINDS) or not 0 < klen <= KEY_BYTES or plen > KEY_BYTES:
            return None  # a row no writer makes (the MAC verified: a bug, not damage)
        meta = SlotMeta(keys[at:at + klen], parents[at:at + plen], depth)
        out.append(Recovered(KINDS[kind], slot, meta, gen))
    return out, next_gen
