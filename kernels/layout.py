"""Where the blocks of a strided copy live: slot arithmetic, bounds and overlap checks.

Shared by the torch reference, the host fast path and the CUDA wrapper so that all three agree on
which items exist, which are skipped and when a batch within one buffer needs staging.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.errors import KernelArgumentError

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class Side:
    """One side of a copy: item (i, r) starts at ``offset + index[i]*stride + r*row_stride``."""

    offset: int
    stride: int
    row_stride: int

    def num_slots(self, numel: int, extent: int) -> int:
        """How many slot indices keep an item's whole extent inside a buffer of ``numel`` bytes."""
        span = numel - self.offset
        return 0 if span < extent else (span - extent) // self.stride + 1


@dataclass(frozen=True)
class CopyLayout:
    """Validated geometry of one batched copy: ``rows`` items of ``nbytes`` per index pair."""

    nbytes: int
    rows: int
    src: Side
    dst: Side

    def __post_init__(self) -> None:
        if self.nbytes <= 0 or self.rows <= 0:
            raise KernelArgumentError(
                f"strided_copy: nbytes and rows must be positive, got {self.nbytes}, {self.rows}"
            )
        for name, side in (("src", self.src), ("dst", self.dst)):
            if side.offset < 0 or side.stride <= 0 or side.row_stride < 0:
                raise KernelArgumentError(
                    f"strided_copy: {name} offset {side.offset} and row stride "
                    f"{side.row_stride} must be >= 0 and stride {side.stride} > 0"
                )

    @property
    def src_extent(self) -> int:
        """Bytes from a source slot's first row to the end of its last row."""
        return (self.rows - 1) * self.src.row_stride + self.nbytes

    @property
    def dst_extent(self) -> int:
        """Bytes from a destination slot's first row to the end of its last row."""
        return (self.rows - 1) * self.dst.row_stride + self.nbytes

    def slots(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int]:
        """Valid slot counts of the source and destination buffers."""
        return (
            self.src.num_slots(src.numel(), self.src_extent),
            self.dst.num_slots(dst.numel(), self.dst_extent),
        )


def make_layout(
    nbytes: int,
    src_stride: int,
    dst_stride: int,
    src_offset: int,
    dst_offset: int,
    rows: int,
    src_row_stride: int,
    dst_row_stride: int,
) -> CopyLayout:
    """Build the layout of a call; with one row the row strides are unused and read as 0."""
    if rows == 1:
        src_row_stride = dst_row_stride = 0
    return CopyLayout(
        nbytes,
        rows,
        Side(src_offset, src_stride, src_row_stride),
        Side(dst_offset, dst_stride, dst_row_stride),
    )


def check_buffers(
    src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor
) -> None:
    """Raise unless both buffers are contiguous 1-D uint8 and the indices pair up."""
    for name, buf in (("src", src), ("dst", dst)):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise KernelArgumentError(
                f"strided_copy: {name} must be a contiguous 1-D uint8 tensor, got "
                f"{buf.dtype} of shape {tuple(buf.shape)}"
            )
    if src_index.dim() != 1 or src_index.shape != dst_index.shape:
        raise KernelArgumentError(
            f"strided_copy: index shapes differ or are not 1-D: {tuple(src_index.shape)} vs "
            f"{tuple(dst_index.shape)}"
        )
    for name, index in (("src_index", src_index), ("dst_index", dst_index)):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise KernelArgumentError(f"strided_copy: {name} must be integer, got {index.dtype}")


def kept_pairs(
    src_index: torch.Tensor, dst_index: torch.Tensor, src_slots: int, dst_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs that are not skipped, as int64 numpy arrays on the host.

    Raises :class:`KernelArgumentError` when a kept index is past its buffer's last slot.
    Reading device-resident indices synchronises. Host index math runs in numpy throughout:
    it is single-threaded, and torch's multi-threaded CPU ops stall for milliseconds when the
    other core of a 2-core machine is busy (a 64 Ki-element sort: 180 ms against 0.2 ms).
    """
    s = src_index.cpu().numpy().astype(np.int64, copy=False)
    d = dst_index.cpu().numpy().astype(np.int64, copy=False)
    keep = (s >= 0) & (d >= 0)
    if not keep.all():
        s, d = s[keep], d[keep]
    for name, index, limit in (("src", s, src_slots), ("dst", d, dst_slots)):
        if index.size and int(index.max()) >= limit:
            raise KernelArgumentError(
                f"strided_copy: {name} index {int(index.max())} out of range: the buffer holds "
                f"{limit} slots"
            )
    return s, d


def span_starts(base: int, side: Side, rows: int, index: np.ndarray) -> np.ndarray:
    """Absolute start address of every item (i, r), row-major."""
    starts = index * side.stride + (base + side.offset)
    if rows == 1:
        return starts
    offs = np.arange(rows, dtype=np.int64) * side.row_stride
    return (starts[:, None] + offs).reshape(-1)


def ranges_intersect(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two 1-D byte buffers on one device overlaps at all."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    return a.data_ptr() < b.data_ptr() + b.numel() and b.data_ptr() < a.data_ptr() + a.numel()


def has_hazard(reads: np.ndarray, writes: np.ndarray, nbytes: int) -> bool:
    """Whether some item writes bytes that another item reads (spans of ``nbytes`` from the
    start addresses of :func:`span_starts`).

    An item whose source and destination are the same address is a no-op and is ignored: it
    writes back the bytes it read. Overlaps between two destinations are undefined behaviour of
    the copy and are not looked for.
    """
    r, w = reads, writes
    moving = r != w
    if not moving.all():
        r, w = r[moving], w[moving]
    if r.size == 0:
        return False
    ordered = np.sort(r)
    # First read start past (w - nbytes); it overlaps [w, w + nbytes) iff it starts before the end.
    pos = np.searchsorted(ordered, w - (nbytes - 1))
    nearest = ordered[np.minimum(pos, ordered.size - 1)]
    return bool(((pos < ordered.size) & (nearest < w + nbytes)).any())


def word_size(src: torch.Tensor, dst: torch.Tensor, layout: CopyLayout) -> int:
    """The widest element (8, 4, 2 or 1 bytes) dividing every size and address of a copy:
    gathering rows of int64 runs several times faster than rows of uint8."""
    sizes = [layout.nbytes, src.numel(), dst.numel(), src.storage_offset(), dst.storage_offset(),
             src.data_ptr(), dst.data_ptr()]
    for side in (layout.src, layout.dst):
        sizes += [side.offset, side.stride, side.row_stride]
    return next(w for w in _WORDS if all(v % w == 0 for v in sizes))


def slot_view(
    buf: torch.Tensor, side: Side, layout: CopyLayout, slots: int, word: int
) -> torch.Tensor:
    """``buf`` as [slots, rows, nbytes/word] elements of ``word`` bytes (items may overlap)."""
    words = buf.view(_WORDS[word])
    return words.as_strided(
        (slots, layout.rows, layout.nbytes // word),
        (side.stride // word, side.row_stride // word, 1),
        words.storage_offset() + side.offset // word,
    )
