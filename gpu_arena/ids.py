"""Validation of caller-supplied virtual ids, on a numpy view (a few ids cost a few µs)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu_arena.pool import Pool
from gpu_arena.spec import ArenaError

IdsLike = torch.Tensor | Sequence[int]


def checked_ids(p: Pool, ids: IdsLike, *, check: bool = True) -> torch.Tensor:
    """Validated 1-D CPU long tensor of ``ids``: in range, unique, live (when ``check``).
    The checks run on a numpy view: a few ids cost a few µs, not a few torch dispatches."""
    if isinstance(ids, torch.Tensor):
        t = ids.detach()
        bad_type = t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex
    else:
        a = np.asarray(ids)
        bad_type = a.dtype.kind not in "iu"
        if bad_type and a.size:
            raise ArenaError(f"pool {p.name!r}: ids must be a 1-D integer tensor, got "
                             f"{a.dtype} of shape {a.shape}")
        t = torch.from_numpy(a.astype(np.int64))
    if t.dim() != 1 or (t.numel() and bad_type):
        raise ArenaError(f"pool {p.name!r}: ids must be a 1-D integer tensor, got {t.dtype} "
                         f"of shape {tuple(t.shape)}")
    t = t.to("cpu", torch.long)
    if not check or t.numel() == 0:
        return t
    a = t.numpy()
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= p.max_slots:
        bad = a[(a < 0) | (a >= p.max_slots)]
        raise ArenaError(f"pool {p.name!r}: {bad.size} of {a.size} ids outside "
                         f"[0, {p.max_slots}), first {int(bad[0])}")
    unique = len(set(a.tolist())) if a.size <= 256 else int(np.unique(a).size)
    if unique != a.size:
        raise ArenaError(f"pool {p.name!r}: {a.size - unique} repeated ids")
    dead = p.loc_np[a] < 0
    if dead.any():
        raise ArenaError(f"pool {p.name!r}: {int(dead.sum())} of {a.size} ids are not "
                         f"live (already freed or never allocated), first {int(a[dead][0])}")
    return t
