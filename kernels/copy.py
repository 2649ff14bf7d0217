"""Strided copy of N fixed-size byte blocks (or N x rows of them) between slots of byte buffers.

Three implementations of one contract, :func:`strided_copy_reference`:

- the torch reference (the specification; gather into a temporary, then scatter);
- the host path (:mod:`kernels.host_copy`) for two CPU buffers;
- the CUDA kernel ``strided_copy.cu`` for device buffers and device <-> pinned host copies. The
  kernel reads and writes mapped pinned host memory directly (one launch, no bounce through the
  copy engine and no host-side scatter); a pageable host buffer takes the reference.

:func:`strided_copy` picks one. Like ``cudaMemcpyAsync``, a CUDA copy is only enqueued on the
current stream: synchronise (or record an event) before reading a pinned destination on the host.
"""

from __future__ import annotations

import torch

from kernels._cuda import Backend, cuda_ready, to_device
from kernels.errors import KernelArgumentError
from kernels.host_copy import copy_host
from kernels.layout import (
    CopyLayout,
    Side,
    check_buffers,
    has_hazard,
    kept_pairs,
    make_layout,
    ranges_intersect,
    slot_view,
    span_starts,
    word_size,
)

THREADS = 256
"""Threads per block; ``TS_THREADS`` in strided_copy.cu."""
CHUNK_BYTES = THREADS * 4 * 16
"""Bytes one block moves per pass (``TS_UNROLL`` 16-byte words per thread)."""
MAX_GRID = (1 << 20, 65535)
"""Launch caps; the kernel strides over whatever lies beyond them."""


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
    rows: int = 1,
    src_row_stride: int = 0,
    dst_row_stride: int = 0,
) -> None:
    """For every pair i and row r < ``rows``, copy ``nbytes`` from
    ``src[src_offset + src_index[i]*src_stride + r*src_row_stride:]`` to the same span of ``dst``
    at ``dst_offset + dst_index[i]*dst_stride + r*dst_row_stride``; ``dst`` changes, ``src`` does
    not (unless it is ``dst``).

    A negative index on either side skips the pair; a kept index whose span would leave its
    buffer raises :class:`~kernels.errors.KernelArgumentError`. All reads happen before all
    writes, so a batch within one buffer is correct even when sources and destinations
    interleave or overlap; two destinations that overlap each other leave either's bytes.
    Buffers are contiguous 1-D uint8 tensors on any devices; indices any integer dtype.
    """
    layout = make_layout(nbytes, src_stride, dst_stride, src_offset, dst_offset, rows,
                         src_row_stride, dst_row_stride)
    check_buffers(src, dst, src_index, dst_index)
    _reference(src, dst, src_index, dst_index, layout)


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
    rows: int = 1,
    src_row_stride: int = 0,
    dst_row_stride: int = 0,
    overlap: bool | None = None,
) -> None:
    """Copy as :func:`strided_copy_reference` does, with the fastest path for the devices: the
    CUDA kernel when a buffer is on CUDA and CuPy works (the other one on the same device or
    pinned host memory), the host path for two CPU buffers, the reference otherwise.

    ``overlap`` says whether some destination span may overlap a source span of another pair
    (only possible when ``src`` and ``dst`` share memory). ``None`` finds out: exactly, from the
    indices, when they are on the host; by staging every same-buffer batch when they are on a
    device (finding out would synchronise). ``False`` skips the check and the staging: pass it
    when the batch moves live blocks into free slots of the same geometry. ``True`` stages.
    Out-of-range indices raise, except device-resident ones on the CUDA path, which the kernel
    skips without touching memory (checking them would synchronise).
    """
    layout = make_layout(nbytes, src_stride, dst_stride, src_offset, dst_offset, rows,
                         src_row_stride, dst_row_stride)
    check_buffers(src, dst, src_index, dst_index)
    device = _kernel_device(src, dst)
    if device is not None:
        backend = cuda_ready("strided_copy", ("strided_copy",), device)
        if backend is not None:
            copy_on_device(src, dst, src_index, dst_index, layout, overlap=overlap,
                           backend=backend, device=device)
            return
    elif src.device.type == dst.device.type == "cpu":
        copy_host(src, dst, src_index, dst_index, layout, overlap=overlap)
        return
    _reference(src, dst, src_index, dst_index, layout)


def strided_copy_cuda(
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
    rows: int = 1,
    src_row_stride: int = 0,
    dst_row_stride: int = 0,
    overlap: bool | None = None,
) -> None:
    """The CUDA kernel alone, no fallback (what the GPU tests compare with the reference).

    Raises :class:`~kernels.errors.KernelArgumentError` when no buffer is on CUDA, the buffers
    are on two devices or the host one is not pinned, and RuntimeError without CuPy.
    """
    layout = make_layout(nbytes, src_stride, dst_stride, src_offset, dst_offset, rows,
                         src_row_stride, dst_row_stride)
    check_buffers(src, dst, src_index, dst_index)
    device = _kernel_device(src, dst)
    if device is None:
        raise KernelArgumentError(
            f"strided_copy_cuda: needs CUDA buffers or CUDA + pinned host, got {src.device} "
            f"(pinned={src.is_pinned()}) and {dst.device} (pinned={dst.is_pinned()})"
        )
    backend = cuda_ready("strided_copy", ("strided_copy",), device)
    if backend is None:
        raise RuntimeError("strided_copy_cuda: CuPy is missing or strided_copy.cu fails to load")
    copy_on_device(src, dst, src_index, dst_index, layout, overlap=overlap, backend=backend,
                   device=device)


def copy_on_device(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    layout: CopyLayout,
    *,
    overlap: bool | None,
    backend: Backend,
    device: torch.device,
) -> None:
    """Enqueue the kernel (twice, through a temporary on ``device``, when staging) for a
    validated call; ``backend`` supplies addresses and launches."""
    src_slots, dst_slots = layout.slots(src, dst)
    if _indices_on_host(src_index, dst_index):
        host_s, host_d = kept_pairs(src_index, dst_index, src_slots, dst_slots)
        if overlap is None:
            overlap = ranges_intersect(src, dst) and has_hazard(
                span_starts(src.data_ptr(), layout.src, layout.rows, host_s),
                span_starts(dst.data_ptr(), layout.dst, layout.rows, host_d),
                layout.nbytes,
            )
        s, d = torch.from_numpy(host_s), torch.from_numpy(host_d)
    else:
        s, d = src_index, dst_index
        if overlap is None:
            overlap = ranges_intersect(src, dst)
    if s.numel() == 0:
        return
    s, d = to_device(s, device, torch.int64), to_device(d, device, torch.int64)
    src_ptr, dst_ptr = backend.pointer(src), backend.pointer(dst)
    launch = _Launch(backend, device, layout.rows, layout.nbytes)
    if not overlap:
        launch(src_ptr, layout.src, src_slots, s, dst_ptr, layout.dst, dst_slots, d)
        return
    n = s.numel()
    temp = torch.empty(n * layout.rows * layout.nbytes, dtype=torch.uint8, device=device)
    keep = (s >= 0) & (d >= 0) & (s < src_slots) & (d < dst_slots)
    t = torch.where(keep, torch.arange(n, device=device), -1)
    staged = Side(0, layout.rows * layout.nbytes, layout.nbytes)
    temp_ptr = backend.pointer(temp)
    launch(src_ptr, layout.src, src_slots, s, temp_ptr, staged, n, t)
    launch(temp_ptr, staged, n, t, dst_ptr, layout.dst, dst_slots, d)


class _Launch:
    """One ``strided_copy`` launch per call, geometry fixed."""

    def __init__(self, backend: Backend, device: torch.device, rows: int, nbytes: int) -> None:
        self.backend, self.device, self.rows, self.nbytes = backend, device, rows, nbytes

    def __call__(
        self,
        src: int, src_side: Side, src_slots: int, src_index: torch.Tensor,
        dst: int, dst_side: Side, dst_slots: int, dst_index: torch.Tensor,
    ) -> None:
        n = src_index.numel()
        grid = copy_grid(n * self.rows, self.nbytes)
        self.backend.launch("strided_copy", "strided_copy", self.device, grid, THREADS, (
            src + src_side.offset, dst + dst_side.offset,
            self.backend.pointer(src_index), self.backend.pointer(dst_index),
            n, self.rows, self.nbytes, src_side.stride, dst_side.stride,
            src_side.row_stride, dst_side.row_stride, src_slots, dst_slots,
        ))


def copy_grid(items: int, nbytes: int) -> tuple[int, int]:
    """Blocks along the items and along one item's chunks."""
    return min(items, MAX_GRID[0]), min(-(-nbytes // CHUNK_BYTES), MAX_GRID[1])


def _indices_on_host(src_index: torch.Tensor, dst_index: torch.Tensor) -> bool:
    """Whether the indices can be read without synchronising a device."""
    return src_index.device.type == dst_index.device.type == "cpu"


def _kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device | None:
    """The CUDA device the kernel would run on, or None when the pair does not suit it."""
    devices = {t.device for t in (src, dst) if t.is_cuda}
    if len(devices) != 1:
        return None
    if any(not t.is_cuda and (t.device.type != "cpu" or not t.is_pinned()) for t in (src, dst)):
        return None
    return devices.pop()


def _reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    layout: CopyLayout,
) -> None:
    src_slots, dst_slots = layout.slots(src, dst)
    s, d = kept_pairs(src_index, dst_index, src_slots, dst_slots)
    if s.size == 0:
        return
    word = word_size(src, dst, layout)
    src_view = slot_view(src, layout.src, layout, src_slots, word)
    dst_view = slot_view(dst, layout.dst, layout, dst_slots, word)
    gathered = src_view.index_select(0, torch.from_numpy(s).to(src.device))
    dst_view.index_copy_(0, torch.from_numpy(d).to(dst.device), gathered.to(dst.device))
