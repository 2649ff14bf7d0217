"""Strided copy of N fixed-size byte blocks between slots of one or two byte buffers."""

from __future__ import annotations

import torch


def _check(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    nbytes: int,
) -> None:
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.dim() != 1 or dst.dim() != 1:
        raise ValueError("strided_copy: src and dst must be 1-D uint8 tensors")
    if src_index.shape != dst_index.shape or src_index.dim() != 1:
        raise ValueError(
            f"strided_copy: index shapes differ: {tuple(src_index.shape)} vs "
            f"{tuple(dst_index.shape)}"
        )
    if nbytes <= 0:
        raise ValueError(f"strided_copy: nbytes must be positive, got {nbytes}")


def strided_copy_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    *,
    nbytes: int,
    src_stride: int,
    dst_stride: int,
    src_offset: int = 0,
    dst_offset: int = 0,
) -> None:
    """Copy block i: ``src[src_offset + src_index[i]*src_stride :+ nbytes]`` to the same span of
    ``dst`` at ``dst_index[i]``. A negative index on either side skips the pair. All reads happen
    before all writes, so a batch within one buffer is correct even when sources and destinations
    interleave."""
    _check(src, dst, src_index, dst_index, nbytes)
    keep = (src_index >= 0) & (dst_index >= 0)
    if not bool(keep.all()):
        src_index, dst_index = src_index[keep], dst_index[keep]
    if src_index.numel() == 0:
        return
    src_rows = src.as_strided((_rows(src, src_offset, src_stride, nbytes), nbytes), (src_stride, 1),
                              src.storage_offset() + src_offset)
    dst_rows = dst.as_strided((_rows(dst, dst_offset, dst_stride, nbytes), nbytes), (dst_stride, 1),
                              dst.storage_offset() + dst_offset)
    src_index = src_index.to(src.device, torch.long)
    dst_index = dst_index.to(dst.device, torch.long)
    gathered = src_rows.index_select(0, src_index)
    dst_rows.index_copy_(0, dst_index, gathered.to(dst.device, non_blocking=True))


def _rows(buf: torch.Tensor, offset: int, stride: int, nbytes: int) -> int:
    """How many whole blocks of ``nbytes`` at ``stride`` fit in ``buf`` from ``offset``."""
    span = buf.numel() - offset
    return 0 if span < nbytes else (span - nbytes) // stride + 1


def strided_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    *,
    nbytes: int,
    src_stride: int,
    dst_stride: int,
    src_offset: int = 0,
    dst_offset: int = 0,
) -> None:
    """Dispatching entry point; see :func:`strided_copy_reference` for the contract."""
    strided_copy_reference(
        src, dst, src_index, dst_index, nbytes=nbytes, src_stride=src_stride,
        dst_stride=dst_stride, src_offset=src_offset, dst_offset=dst_offset,
    )
