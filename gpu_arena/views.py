"""Tensor views of an arena's bytes, and device mirrors of its location tables.

Views never copy: slot rows of a pool, the same rows as 8-byte words (faster scatters), and
one field of every block (a layer's K, say) for kernels that index by slot. Built once per
pool and cached; they stay valid while blocks move, since they name slots, not blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_arena.pool import Pool
from gpu_arena.spec import ArenaError


class Views:
    """The cached views of one buffer, and per pool a device copy of ``loc``."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self._rows: dict[str, torch.Tensor] = {}
        self._wide: dict[str, torch.Tensor | None] = {}
        self._tables: dict[str, tuple[int, torch.Tensor]] = {}  # pool -> (stream, loc)

    def rows(self, p: Pool) -> torch.Tensor:
        """The pool's slots as ``[max_slots, unit]`` uint8 rows."""
        view = self._rows.get(p.name)
        if view is None:
            view = self._buf[p.origin : p.origin + p.max_slots * p.unit].view(p.max_slots, p.unit)
            self._rows[p.name] = view
        return view

    def wide(self, p: Pool) -> torch.Tensor | None:
        """The pool's slots as ``int64`` rows (units are 16-byte multiples), or None where the
        band's byte offset does not allow it (an accounting-only arena has no bytes)."""
        if p.name not in self._wide:
            view = None
            if self._buf.device.type != "meta" and p.unit % 8 == 0:
                try:
                    view = self.rows(p).view(torch.int64)
                except RuntimeError:
                    view = None
            self._wide[p.name] = view
        return self._wide[p.name]

    def field(self, p: Pool, dtype: torch.dtype, shape: Sequence[int],
              strides: Sequence[int] | None, offset: int) -> torch.Tensor:
        """A ``[max_slots, *shape]`` view of the field at ``offset`` bytes into each block;
        ``strides`` in elements (contiguous when None). ArenaError if it leaves the unit."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        shape = tuple(int(s) for s in shape)
        strides = tuple(int(s) for s in strides) if strides is not None else _contiguous(shape)
        if len(strides) != len(shape) or any(s <= 0 for s in shape):
            raise ArenaError(f"layer_view: shape {shape} and strides {strides} do not match")
        last = sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        extent = offset + (last + 1) * itemsize
        if offset < 0 or extent > p.unit or p.unit % itemsize or (p.origin + offset) % itemsize:
            raise ArenaError(
                f"layer_view on {p.name!r}: offset {offset} B + extent of {shape}/{strides} in "
                f"{dtype} ({extent} B) must fit the {p.unit} B unit at {itemsize}-byte alignment"
            )
        typed = self._buf.view(dtype)
        return typed.as_strided((p.max_slots, *shape), (p.unit // itemsize, *strides),
                                (p.origin + offset) // itemsize)

    def table(self, p: Pool) -> torch.Tensor:
        """``p.loc`` on the buffer's device. The mirror is patched in place on the current
        stream with only the entries changed since the last call (the pool logs them), so a
        resolve after a few allocations copies a few entries, not the table. A call from
        another stream gets a fresh copy: a kernel still queued on the old stream may be
        reading the old one."""
        device = self._buf.device
        if device.type in ("cpu", "meta"):  # meta: accounting only, tables stay on CPU
            return p.loc
        stream = torch.cuda.current_stream(device)
        cached = self._tables.get(p.name)
        if cached is None or cached[0] != stream.cuda_stream:
            table = p.loc.to(device)
            self._tables[p.name] = (stream.cuda_stream, table)
            p.start_log()
            return table
        p.patch(cached[1])
        return cached[1]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
