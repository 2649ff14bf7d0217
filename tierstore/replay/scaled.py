"""The replay's payloads at scale (:mod:`tierstore.scaling` scales the layout).

Each scaled envelope has one ``uint8`` field spanning it and holds a payload derived from its
page key and kind (:func:`payload`), so every byte read back can be checked: a wrong page is an
error, not a miss.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

_KIND_TAG = {"kv": 0x00, "swa": 0x5A, "state": 0xA5}


def payload(keys: Sequence[bytes], kind: str, unit_bytes: int) -> torch.Tensor:
    """The envelopes the replay stores for pages ``keys`` of ``kind``: each page key's bytes
    repeated over ``unit_bytes``, XORed with a per-kind tag and the byte offset (so kinds and
    pages differ, and a shifted copy does not match). ``uint8 [len(keys), unit_bytes]``."""
    if not keys:
        return torch.empty((0, unit_bytes), dtype=torch.uint8)
    width = len(keys[0])
    base = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), width)
    reps = -(-unit_bytes // width)
    rows = np.broadcast_to(base[:, None, :], (len(keys), reps, width)).reshape(len(keys), -1)
    out = np.empty((len(keys), unit_bytes), dtype=np.uint8)
    np.bitwise_xor(rows[:, :unit_bytes], _mask(kind, unit_bytes), out=out)
    return torch.from_numpy(out)


@functools.lru_cache(maxsize=16)
def _mask(kind: str, unit_bytes: int) -> np.ndarray:
    offsets = (np.arange(unit_bytes, dtype=np.uint32) * 7 % 251).astype(np.uint8)
    return offsets ^ np.uint8(_KIND_TAG[kind])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two ``uint8 [n, unit]`` tensors hold the same bytes (compared 8 at a time when
    their rows allow: a uint8 compare is several times slower)."""
    if a.shape != b.shape:
        return False
    if a.dim() == 2 and a.shape[1] % 8 == 0 and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(a, b)
