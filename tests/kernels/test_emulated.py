"""The ``.cu`` kernels and their wrappers, run on the host through a g++ emulation of the grid,
against the torch reference: the kernels' logic without a GPU."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kernels
from kernels import copy as kcopy
from kernels.copy import CHUNK_BYTES, copy_on_device
from kernels.layout import check_buffers, make_layout
from kernels.remap import remap_on_device, remap_reference


def _device_copy(backend: Any) -> Callable[..., None]:
    def run(src, dst, src_index, dst_index, *, overlap=None, **kw):  # type: ignore[no-untyped-def]
        full = dict(src_offset=0, dst_offset=0, rows=1, src_row_stride=0, dst_row_stride=0)
        layout = make_layout(**_layout_args({**full, **kw}))
        check_buffers(src, dst, src_index, dst_index)
        copy_on_device(src, dst, src_index, dst_index, layout, overlap=overlap,
                       backend=backend, device=torch.device("cpu"))
    return run


@pytest.mark.parametrize("align", [1, 4, 16])
@pytest.mark.parametrize("same_buffer", [False, True])
def test_kernel_matches_reference(emulated, copy_case, align: int, same_buffer: bool) -> None:
    rng = random.Random(1000 * align + same_buffer)
    run = _device_copy(emulated)
    for _ in range(40):
        case = copy_case(rng, same_buffer=same_buffer, max_nbytes=3 * CHUNK_BYTES // 2,
                         align=align, max_pairs=6)
        assert torch.equal(case.run(run), case.expected()), case.kwargs



def test_grid_stride_loops_cover_items_and_chunks(emulated, copy_case, monkeypatch) -> None:
    monkeypatch.setattr(kcopy, "MAX_GRID", (3, 2))
    rng = random.Random(7)
    run = _device_copy(emulated)
    for _ in range(30):
        case = copy_case(rng, same_buffer=rng.random() < 0.5, max_nbytes=3 * CHUNK_BYTES,
                         align=rng.choice([1, 16]), max_pairs=8)
        assert torch.equal(case.run(run), case.expected()), case.kwargs


def test_device_indices_skip_out_of_range_and_stage(emulated, copy_case, monkeypatch) -> None:
    """Indices the host may not read: out-of-range pairs are skipped by the kernel, and a
    same-buffer batch is staged through a temporary (two launches)."""
    monkeypatch.setattr(kcopy, "_indices_on_host", lambda *_: False)
    rng = random.Random(11)
    run = _device_copy(emulated)
    for _ in range(30):
        case = copy_case(rng, same_buffer=rng.random() < 0.5, max_nbytes=200, max_pairs=8)
        if case.src_index.numel() == 0:
            continue
        src_slots, dst_slots = make_layout(**_layout_args(case.kwargs)).slots(case.src, case.dst)
        s, d = case.src_index.clone(), case.dst_index.clone()
        s[0], d[-1] = src_slots + rng.randint(0, 3), dst_slots + 5
        in_range = (s < src_slots) & (d < dst_slots)
        expected = type(case)(case.src, case.dst, torch.where(in_range, s, -1), d, case.kwargs)
        before = emulated.launches.get("strided_copy", 0)
        got = type(case)(case.src, case.dst, s, d, case.kwargs).run(run)
        assert torch.equal(got, expected.expected()), case.kwargs
        launched = emulated.launches["strided_copy"] - before
        assert launched == (2 if case.dst is case.src else 1)


def _layout_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("nbytes", "src_stride", "dst_stride", "src_offset", "dst_offset", "rows",
             "src_row_stride", "dst_row_stride")
    return {k: kwargs[k] for k in names}


@pytest.mark.parametrize(
    ("overlap", "hazard", "launches"),
    [(None, False, 1), (None, True, 2), (False, False, 1), (True, False, 2)],
)
def test_staging_follows_overlap(
    emulated, overlap: bool | None, hazard: bool, launches: int
) -> None:
    buf = torch.randint(0, 256, (64 * 32,), dtype=torch.uint8)
    # Moves 3 -> 0 and 4 -> 1; with hazard, 0 -> 3 reads what 3 -> 0's neighbour writes.
    src = torch.tensor([3, 4, 0] if hazard else [3, 4, 5])
    dst = torch.tensor([0, 1, 3] if hazard else [0, 1, 2])
    expected = buf.clone()
    kernels.strided_copy_reference(expected, expected, src, dst, nbytes=64, src_stride=64,
                                   dst_stride=64)
    before = emulated.launches.get("strided_copy", 0)
    got = buf.clone()
    _device_copy(emulated)(got, got, src, dst, nbytes=64, src_stride=64, dst_stride=64,
                           overlap=overlap)
    assert emulated.launches["strided_copy"] - before == launches
    assert torch.equal(got, expected)


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ids_dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_remap_kernel_matches_reference(
    emulated, monkeypatch, table_dtype: torch.dtype, ids_dtype: torch.dtype, page_size: int
) -> None:
    # ``kernels.remap`` the attribute is the function; the module is in sys.modules.
    monkeypatch.setattr(importlib.import_module("kernels.remap"), "MAX_BLOCKS", 2)
    gen = torch.Generator().manual_seed(page_size)
    for size in (0, 1, 37):
        table = torch.randint(-3, 1000, (size,), dtype=table_dtype, generator=gen)
        ids = torch.randint(-5, size + 5, (300,), dtype=ids_dtype, generator=gen)
        for out_dtype in (None, torch.int32, torch.int64):
            expected = remap_reference(table, ids, sink=7, page_size=page_size,
                                       out_dtype=out_dtype)
            got = remap_on_device(table, ids, 7, page_size, None, expected.dtype,
                                  backend=emulated)
            assert got.dtype == expected.dtype
            assert torch.equal(got, expected)
