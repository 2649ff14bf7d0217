"""The CUDA kernels against the torch reference, bit for bit (needs a GPU and CuPy)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kernels
from kernels.copy import CHUNK_BYTES


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and CuPy"),
]


def _place(t: torch.Tensor, where: str) -> torch.Tensor:
    if where == "cuda":
        return t.cuda()
    if where == "pinned":
        return t.pin_memory()
    return t.clone()


def _run(
    case: Any, fn: Callable[..., None], src_at: str, dst_at: str, index_at: str = "cpu",
    **extra: Any,
) -> torch.Tensor:
    """``dst`` (on the host) after ``fn`` copied the case between buffers placed as asked."""
    src = _place(case.src, src_at)
    dst = src if case.dst is case.src else _place(case.dst, dst_at)
    device = "cuda" if index_at == "cuda" else "cpu"
    fn(src, dst, case.src_index.to(device), case.dst_index.to(device), **case.kwargs, **extra)
    torch.cuda.synchronize()
    return dst.cpu()


@pytest.mark.parametrize(("src_at", "dst_at"),
                         [("cuda", "cuda"), ("cuda", "pinned"), ("pinned", "cuda")])
@pytest.mark.parametrize("align", [1, 4, 16])
@pytest.mark.parametrize("index_at", ["cpu", "cuda"])
def test_kernel_matches_reference_between_buffers(
    copy_case, src_at: str, dst_at: str, align: int, index_at: str
) -> None:
    rng = random.Random(zlib.crc32(f"{src_at}{dst_at}{align}{index_at}".encode()))
    for _ in range(25):
        case = copy_case(rng, same_buffer=False, max_nbytes=3 * CHUNK_BYTES, align=align)
        got = _run(case, kernels.strided_copy_cuda, src_at, dst_at, index_at)
        assert torch.equal(got, case.expected()), case.kwargs


@pytest.mark.parametrize("index_at", ["cpu", "cuda"])
@pytest.mark.parametrize("overlap", [None, True])
def test_kernel_same_buffer_batches(copy_case, index_at: str, overlap: bool | None) -> None:
    rng = random.Random(17)
    for _ in range(40):
        case = copy_case(rng, same_buffer=True, max_nbytes=2 * CHUNK_BYTES,
                         align=rng.choice([1, 16]))
        got = _run(case, kernels.strided_copy_cuda, "cuda", "cuda", index_at, overlap=overlap)
        assert torch.equal(got, case.expected()), case.kwargs


def test_interleaved_compaction_in_one_buffer() -> None:
    """Every slot k moves to k+1 (a chain) with device indices: staged, so still correct."""
    buf = torch.arange(64, dtype=torch.uint8).repeat_interleave(4096).cuda()
    expected = buf.cpu()
    kernels.strided_copy_reference(expected, expected, torch.arange(0, 63), torch.arange(1, 64),
                                   nbytes=4096, src_stride=4096, dst_stride=4096)
    kernels.strided_copy(buf, buf, torch.arange(0, 63, device="cuda"),
                         torch.arange(1, 64, device="cuda"), nbytes=4096, src_stride=4096,
                         dst_stride=4096)
    torch.cuda.synchronize()
    assert torch.equal(buf.cpu(), expected)


@pytest.mark.parametrize("nbytes", [16 << 10, 2 << 20])
@pytest.mark.parametrize("skew", [0, 4, 1])
@pytest.mark.parametrize(("src_at", "dst_at"),
                         [("cuda", "cuda"), ("cuda", "pinned"), ("pinned", "cuda")])
def test_large_envelopes(nbytes: int, skew: int, src_at: str, dst_at: str) -> None:
    n, slots = 24, 64
    gen = torch.Generator().manual_seed(nbytes + skew)
    src = torch.randint(0, 256, (slots * nbytes + 64,), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (slots * nbytes + 64,), dtype=torch.uint8, generator=gen)
    s = torch.randperm(slots, generator=gen)[:n]
    d = torch.randperm(slots, generator=gen)[:n]
    kw = dict(nbytes=nbytes, src_stride=nbytes, dst_stride=nbytes, src_offset=skew,
              dst_offset=16)
    expected = dst.clone()
    kernels.strided_copy_reference(src, expected, s, d, **kw)
    gsrc, gdst = _place(src, src_at), _place(dst, dst_at)
    kernels.strided_copy_cuda(gsrc, gdst, s.cuda(), d.cuda(), **kw)
    torch.cuda.synchronize()
    assert torch.equal(gdst.cpu(), expected)


def test_device_indices_out_of_range_are_skipped() -> None:
    src = torch.arange(256, dtype=torch.uint8).cuda()
    dst = torch.zeros(256, dtype=torch.uint8).cuda()
    s = torch.tensor([1, 99, 2, -1], device="cuda")
    d = torch.tensor([0, 1, 400, 3], device="cuda")
    kernels.strided_copy_cuda(src, dst, s, d, nbytes=16, src_stride=16, dst_stride=16)
    torch.cuda.synchronize()
    expected = torch.zeros(256, dtype=torch.uint8)
    expected[:16] = torch.arange(16, 32, dtype=torch.uint8)
    assert torch.equal(dst.cpu(), expected)


def test_runs_on_the_current_stream(copy_case) -> None:
    case = copy_case(random.Random(3), same_buffer=False, max_nbytes=CHUNK_BYTES, max_pairs=10,
                     negative=0.0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = case.src.to("cuda", non_blocking=True)
        dst = case.dst.to("cuda", non_blocking=True)
        kernels.strided_copy_cuda(src, dst, case.src_index, case.dst_index, **case.kwargs)
        got = dst.to("cpu", non_blocking=True)
    stream.synchronize()
    assert torch.equal(got, case.expected())


def test_dispatcher_uses_the_kernel_and_falls_back_for_pageable(copy_case) -> None:
    rng = random.Random(9)
    for where in ("cuda", "cpu"):
        case = copy_case(rng, same_buffer=False, max_nbytes=5000)
        got = _run(case, kernels.strided_copy, "cuda", where)
        assert torch.equal(got, case.expected())


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("out_dtype", [None, torch.int32, torch.int64])
def test_remap_matches_reference(
    table_dtype: torch.dtype, ids_dtype: torch.dtype, page_size: int,
    out_dtype: torch.dtype | None,
) -> None:
    gen = torch.Generator().manual_seed(page_size)
    for size in (0, 1, 1000):
        table = torch.randint(-3, 100_000, (size,), dtype=table_dtype, generator=gen)
        ids = torch.randint(-5, size + 5, (5000,), dtype=ids_dtype, generator=gen)
        expected = kernels.remap_reference(table, ids, sink=3, page_size=page_size,
                                           out_dtype=out_dtype)
        for ids_at in ("cpu", "cuda"):
            got = kernels.remap_cuda(table.cuda(), ids.to(ids_at), sink=3, page_size=page_size,
                                     out_dtype=out_dtype)
            assert got.is_cuda and got.dtype == expected.dtype
            assert torch.equal(got.cpu(), expected)


def test_remap_into_out() -> None:
    table = torch.tensor([4, -1, 2], device="cuda")
    out = torch.empty(6, dtype=torch.int64, device="cuda")
    got = kernels.remap(table, torch.tensor([2, 1, 7], device="cuda"), sink=0, page_size=2,
                        out=out)
    assert got is out
    assert out.tolist() == [4, 5, 0, 0, 0, 0]
