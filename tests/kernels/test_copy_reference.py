"""The strided-copy reference (the specification) against a plain Python loop over bytes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import KernelArgumentError


def naive_copy(
    src: bytearray, dst: bytearray, si: list[int], di: list[int], kw: dict[str, Any]
) -> None:
    """Gather every kept item's bytes first, then write them: the contract, spelled out."""
    n, rows = kw["nbytes"], kw["rows"]
    staged = []
    for s, d in zip(si, di, strict=True):
        if s < 0 or d < 0:
            continue
        for r in range(rows):
            a = kw["src_offset"] + s * kw["src_stride"] + r * kw["src_row_stride"]
            staged.append((d, r, bytes(src[a : a + n])))
    for d, r, data in staged:
        b = kw["dst_offset"] + d * kw["dst_stride"] + r * kw["dst_row_stride"]
        dst[b : b + n] = data


def _naive_expected(case: Any) -> torch.Tensor:
    src = bytearray(case.src.numpy().tobytes())
    dst = src if case.dst is case.src else bytearray(case.dst.numpy().tobytes())
    naive_copy(src, dst, case.src_index.tolist(), case.dst_index.tolist(), case.kwargs)
    return torch.frombuffer(bytearray(dst), dtype=torch.uint8)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), same_buffer=st.booleans(), align=st.sampled_from([1, 8]))
def test_reference_matches_naive_loop(copy_case, seed: int, same_buffer: bool, align: int) -> None:
    case = copy_case(random.Random(seed), same_buffer=same_buffer, align=align)
    assert torch.equal(case.run(kernels.strided_copy_reference), _naive_expected(case))


def test_interleaved_same_buffer_batch_reads_before_writing() -> None:
    """Slot k moves to k+1 for every k: a forward loop of copies would smear slot 0."""
    buf = torch.arange(8, dtype=torch.uint8).repeat_interleave(4)
    kernels.strided_copy_reference(buf, buf, torch.arange(0, 7), torch.arange(1, 8),
                                   nbytes=4, src_stride=4, dst_stride=4)
    assert buf.view(8, 4)[:, 0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6]


def test_overlapping_spans_slide_within_one_buffer() -> None:
    """One 10-byte block moved 3 bytes up: source and destination overlap."""
    buf = torch.arange(16, dtype=torch.uint8)
    kernels.strided_copy_reference(buf, buf, torch.tensor([0]), torch.tensor([0]), nbytes=10,
                                   src_stride=16, dst_stride=16, dst_offset=3)
    assert buf.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 15]


def test_rows_copy_per_layer_slices() -> None:
    """Two layers of 2-byte rows per slot, laid out layer-major: rows stride by a layer."""
    src = torch.arange(24, dtype=torch.uint8)  # 2 layers x 3 slots x 4 bytes
    dst = torch.zeros(12, dtype=torch.uint8)  # 3 slots x (2 layers x 2 bytes)
    kernels.strided_copy_reference(src, dst, torch.tensor([2, 0]), torch.tensor([0, 2]),
                                   nbytes=2, src_stride=4, dst_stride=4, rows=2,
                                   src_row_stride=12, dst_row_stride=2)
    assert dst.tolist() == [8, 9, 20, 21, 0, 0, 0, 0, 0, 1, 12, 13]


def test_all_pairs_skipped_changes_nothing() -> None:
    buf = torch.arange(32, dtype=torch.uint8)
    kernels.strided_copy_reference(buf, buf, torch.tensor([-1, 2]), torch.tensor([1, -5]),
                                   nbytes=8, src_stride=8, dst_stride=8)
    kernels.strided_copy_reference(buf, buf, torch.tensor([], dtype=torch.long),
                                   torch.tensor([], dtype=torch.long), nbytes=8, src_stride=8,
                                   dst_stride=8)
    assert torch.equal(buf, torch.arange(32, dtype=torch.uint8))


@pytest.mark.parametrize("fn", [kernels.strided_copy_reference, kernels.strided_copy])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(src_index=[4], dst_index=[0]), "src index 4 out of range: the buffer holds 4"),
        (dict(src_index=[0], dst_index=[4]), "dst index 4 out of range"),
        (dict(dst_offset=1, dst_index=[3]), "dst index 3 out of range: the buffer holds 3"),
        (dict(rows=2, src_row_stride=8), "src index 3 out of range: the buffer holds 3"),
        (dict(nbytes=0), "nbytes and rows must be positive"),
        (dict(src_stride=0), "stride 0 > 0"),
        (dict(src_index=[0, 1]), "index shapes differ"),
        (dict(src=torch.zeros(4, 8, dtype=torch.uint8)), "contiguous 1-D uint8"),
        (dict(dst=torch.zeros(32, dtype=torch.int32)), "contiguous 1-D uint8"),
    ],
)
def test_misuse_raises_with_numbers(fn: Any, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = dict(src=torch.zeros(32, dtype=torch.uint8),
                                dst=torch.zeros(32, dtype=torch.uint8), src_index=[3],
                                dst_index=[3], nbytes=8, src_stride=8, dst_stride=8)
    args.update(kwargs)
    src_index = torch.tensor(args.pop("src_index"))
    dst_index = torch.tensor(args.pop("dst_index"))
    with pytest.raises(KernelArgumentError, match=match):
        fn(args.pop("src"), args.pop("dst"), src_index, dst_index, **args)


def test_float_indices_are_rejected() -> None:
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(KernelArgumentError, match="must be integer"):
        kernels.strided_copy(buf, buf, torch.tensor([0.0]), torch.tensor([1]), nbytes=8,
                             src_stride=8, dst_stride=8)
