"""Virtual id -> physical slot translation (and per-token slot indices for pages).

:func:`remap_reference` is the specification; ``remap.cu`` does the same in one launch for a
table on CUDA; :func:`remap` picks one. Nothing is read outside ``table`` and ``ids``.
"""

from __future__ import annotations

import torch

from kernels._cuda import Backend, cuda_ready, to_device
from kernels.errors import KernelArgumentError

THREADS = 256
"""Threads per block; ``TS_REMAP_THREADS`` in remap.cu."""
MAX_BLOCKS = 1 << 16
"""Launch cap; the kernel strides over the rest."""

_BITS = {torch.int32: 32, torch.int64: 64}
_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_LIMITS = {torch.int32: (-(1 << 31), (1 << 31) - 1), torch.int64: (-(1 << 63), (1 << 63) - 1)}


def remap_reference(
    table: torch.Tensor,
    ids: torch.Tensor,
    *,
    sink: int,
    page_size: int = 1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return ``table[ids]`` on ``table``'s device; an id out of ``[0, len(table))`` or whose
    entry is negative maps to ``sink``.

    With ``page_size > 1`` the result is per token: ``slot * page_size + t`` for t in the page
    (an invalid page maps every token to ``sink``), shape ``[len(ids) * page_size]``. The result
    has ``out_dtype``: by default the table's dtype for pages, int64 for tokens. ``out``, when
    given, receives the result and is returned; nothing else changes.
    """
    dtype = _check(table, ids, sink, page_size, out, out_dtype)
    ids = ids.to(table.device, torch.int64)
    size = table.numel()
    valid = (ids >= 0) & (ids < size)
    if size:
        slots = table.index_select(0, ids.clamp(0, size - 1)).to(torch.int64)
    else:
        slots = torch.full_like(ids, -1)
    valid &= slots >= 0
    if page_size > 1:
        offs = torch.arange(page_size, device=table.device, dtype=torch.int64)
        slots = slots.unsqueeze(1) * page_size + offs
        valid = valid.unsqueeze(1)
    result = torch.where(valid, slots, sink).reshape(-1).to(dtype)
    if out is None:
        return result
    return out.copy_(result)


def remap(
    table: torch.Tensor,
    ids: torch.Tensor,
    *,
    sink: int,
    page_size: int = 1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`remap_reference`'s result, from the CUDA kernel when ``table`` is on CUDA and CuPy
    works (enqueued on the current stream, no synchronisation), from the reference otherwise."""
    if table.is_cuda:
        dtype = _check(table, ids, sink, page_size, out, out_dtype)
        backend = cuda_ready("remap", (_kernel_name(table, ids, dtype),), table.device)
        if backend is not None:
            return remap_on_device(table, ids, sink, page_size, out, dtype, backend=backend)
    return remap_reference(table, ids, sink=sink, page_size=page_size, out=out,
                           out_dtype=out_dtype)


def remap_cuda(
    table: torch.Tensor,
    ids: torch.Tensor,
    *,
    sink: int,
    page_size: int = 1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The CUDA kernel alone, no fallback; raises RuntimeError without CuPy."""
    if not table.is_cuda:
        raise KernelArgumentError(f"remap_cuda: table must be on CUDA, got {table.device}")
    dtype = _check(table, ids, sink, page_size, out, out_dtype)
    backend = cuda_ready("remap", (_kernel_name(table, ids, dtype),), table.device)
    if backend is None:
        raise RuntimeError("remap_cuda: CuPy is missing or remap.cu fails to load")
    return remap_on_device(table, ids, sink, page_size, out, dtype, backend=backend)


def remap_on_device(
    table: torch.Tensor,
    ids: torch.Tensor,
    sink: int,
    page_size: int,
    out: torch.Tensor | None,
    dtype: torch.dtype,
    *,
    backend: Backend,
) -> torch.Tensor:
    """Enqueue one ``remap.cu`` launch for checked arguments; ``backend`` supplies addresses and
    launches on ``table``'s device. Returns ``out`` or a new tensor."""
    device = table.device
    ids = to_device(ids, device, ids.dtype if ids.dtype in _BITS else torch.int64)
    table = table.contiguous()
    total = ids.numel() * page_size
    if out is None:
        out = torch.empty(total, dtype=dtype, device=device)
    if total == 0:
        return out
    blocks = min(-(-total // THREADS), MAX_BLOCKS)
    backend.launch("remap", _kernel_name(table, ids, dtype), device, (blocks, 1), THREADS, (
        backend.pointer(table), backend.pointer(ids), backend.pointer(out),
        table.numel(), ids.numel(), page_size, sink,
    ))
    return out


def _kernel_name(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> str:
    return f"remap_t{_BITS[table.dtype]}_i{_BITS.get(ids.dtype, 64)}_o{_BITS[dtype]}"


def _check(
    table: torch.Tensor,
    ids: torch.Tensor,
    sink: int,
    page_size: int,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.dtype:
    """Raise on misuse; return the result dtype."""
    if table.dim() != 1 or table.dtype not in _BITS:
        raise KernelArgumentError(
            f"remap: table must be 1-D int32 or int64, got {table.dtype} {tuple(table.shape)}"
        )
    if ids.dim() != 1 or ids.dtype not in _ID_DTYPES:
        raise KernelArgumentError(
            f"remap: ids must be 1-D signed integers, got {ids.dtype} {tuple(ids.shape)}"
        )
    if page_size < 1:
        raise KernelArgumentError(f"remap: page_size must be >= 1, got {page_size}")
    default = table.dtype if page_size == 1 else torch.int64
    dtype = default if out_dtype is None else out_dtype
    if dtype not in _BITS:
        raise KernelArgumentError(f"remap: out_dtype must be int32 or int64, got {dtype}")
    low, high = _LIMITS[dtype]
    if not low <= sink <= high:
        raise KernelArgumentError(f"remap: sink {sink} does not fit {dtype}")
    if out is not None and (
        out.dtype != dtype or out.device != table.device or out.dim() != 1
        or out.numel() != ids.numel() * page_size or not out.is_contiguous()
    ):
        raise KernelArgumentError(
            f"remap: out must be a contiguous 1-D {dtype} tensor of {ids.numel() * page_size} "
            f"on {table.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return dtype
