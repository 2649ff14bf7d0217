"""Shared pieces of the kernel tests: random copy cases, and a host emulation of the ``.cu``
sources (compiled with g++, one CUDA thread after another) that stands in for CuPy on CPU."""

from __future__ import annotations

import ctypes
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import kernels
from kernels.build import sources

_PRELUDE = """
struct EmuDim3 { unsigned int x, y, z; };
static EmuDim3 blockIdx, threadIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
// A launch argument: converts to the integer or pointer type of the parameter it fills.
struct EmuArg {
    long long v;
    operator long long() const { return v; }
    template <typename T> operator T*() const { return reinterpret_cast<T*>(v); }
};
"""

_DRIVER = """
extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned bx, const long long* a) {{
    gridDim = {{gx, gy, 1}};
    blockDim = {{bx, 1, 1}};
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x)
            for (unsigned t = 0; t < bx; ++t) {{
                blockIdx = {{x, y, 0}};
                threadIdx = {{t, 0, 0}};
                {name}({args});
            }}
}}
"""

_ARITY = {"strided_copy": 13, "remap": 7}


class EmulatedBackend:
    """A :class:`kernels._cuda.Backend` whose "device" is the CPU: CPU tensors' addresses, and
    each launch runs every thread of the grid in turn. Valid because the kernels use no shared
    memory and no barriers. Counts launches per kernel."""

    def __init__(self, libs: dict[str, ctypes.CDLL]) -> None:
        self._libs = libs
        self.launches: dict[str, int] = {}

    def pointer(self, tensor: torch.Tensor) -> int:
        assert tensor.device.type == "cpu", tensor.device
        return tensor.data_ptr()

    def launch(
        self,
        module: str,
        kernel: str,
        device: torch.device,
        grid: tuple[int, int],
        block: int,
        args: Sequence[int],
    ) -> None:
        assert len(args) == _ARITY[module], (kernel, len(args))
        assert 0 < grid[0] < 1 << 31 and 0 < grid[1] <= 65535, grid
        packed = (ctypes.c_longlong * len(args))(*[_signed(a) for a in args])
        getattr(self._libs[module], f"emu_{kernel}")(grid[0], grid[1], block, packed)
        self.launches[kernel] = self.launches.get(kernel, 0) + 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _kernel_names(text: str) -> list[str]:
    names = re.findall(r"^TS_REMAP_ENTRY\((\w+)", text, re.MULTILINE)
    names += re.findall(r'extern "C" __global__ void __launch_bounds__\(\w+\)\s*(\w+)\(', text)
    return names


@pytest.fixture(scope="session")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> EmulatedBackend:
    """The ``.cu`` sources built for the host; skips without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot emulate the CUDA kernels on the host")
    out = tmp_path_factory.mktemp("emu")
    (out / "prelude.h").write_text(_PRELUDE)
    libs: dict[str, ctypes.CDLL] = {}
    for source in sources():
        text = source.read_text()
        names = _kernel_names(text)
        assert names, f"no kernels found in {source}"
        args = ", ".join(f"EmuArg{{a[{i}]}}" for i in range(_ARITY[source.stem]))
        drivers = "".join(_DRIVER.format(name=n, args=args) for n in names)
        unit = out / f"{source.stem}.cpp"
        unit.write_text(f'#include "prelude.h"\n#include "{source}"\n{drivers}')
        lib = out / f"lib{source.stem}.so"
        proc = subprocess.run(
            [gxx, "-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC",
             "-o", str(lib), str(unit)],
            capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        libs[source.stem] = ctypes.CDLL(str(lib))
    return EmulatedBackend(libs)


@dataclass
class CopyCase:
    """Arguments of one strided copy; ``dst is src`` for a same-buffer batch."""

    src: torch.Tensor
    dst: torch.Tensor
    src_index: torch.Tensor
    dst_index: torch.Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)

    def expected(self) -> torch.Tensor:
        """What ``dst`` holds after the reference runs on copies of the buffers."""
        src = self.src.clone()
        dst = src if self.dst is self.src else self.dst.clone()
        kernels.strided_copy_reference(src, dst, self.src_index, self.dst_index, **self.kwargs)
        return dst

    def run(self, fn: Callable[..., None], **extra: Any) -> torch.Tensor:
        """``dst`` after ``fn`` runs on copies of the buffers."""
        src = self.src.clone()
        dst = src if self.dst is self.src else self.dst.clone()
        fn(src, dst, self.src_index, self.dst_index, **self.kwargs, **extra)
        return dst


def make_copy_case(
    rng: random.Random,
    *,
    same_buffer: bool,
    max_nbytes: int = 64,
    align: int = 1,
    max_pairs: int = 10,
    negative: float = 0.15,
) -> CopyCase:
    """A random batch: destinations unique and non-overlapping, sources anywhere (they may
    overlap each other and, in one buffer, the destinations); some pairs skipped."""
    nbytes = rng.randint(1, max(1, max_nbytes // align)) * align
    rows = rng.choice([1, 1, 2, 3])
    dst_row_stride = nbytes + rng.choice([0, 0, align, 16 * align]) if rows > 1 else 0
    dst_extent = (rows - 1) * dst_row_stride + nbytes
    dst_stride = dst_extent + rng.choice([0, 0, align, 4 * align])
    src_row_stride = rng.randint(0, 2 * nbytes // align) * align if rows > 1 else 0
    src_extent = (rows - 1) * src_row_stride + nbytes
    src_stride = rng.randint(1, (src_extent + 64) // align + 1) * align
    src_offset = rng.randint(0, 40) * align
    dst_offset = rng.randint(0, 40) * align
    src_slots, dst_slots = rng.randint(1, 12), rng.randint(1, 12)
    src_size = src_offset + (src_slots - 1) * src_stride + src_extent + rng.randint(0, 9)
    dst_size = dst_offset + (dst_slots - 1) * dst_stride + dst_extent + rng.randint(0, 9)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if same_buffer:
        size = max(src_size, dst_size)
        src = dst = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        src_slots = (size - src_offset - src_extent) // src_stride + 1
        dst_slots = (size - dst_offset - dst_extent) // dst_stride + 1
    else:
        src = torch.randint(0, 256, (src_size,), dtype=torch.uint8, generator=gen)
        dst = torch.randint(0, 256, (dst_size,), dtype=torch.uint8, generator=gen)
    n = rng.randint(0, min(dst_slots, max_pairs))
    d = rng.sample(range(dst_slots), n)
    s = [rng.randrange(src_slots) for _ in range(n)]
    for k in range(n):
        if rng.random() < negative:
            s[k] = -rng.randint(1, 3)
        elif rng.random() < negative:
            d[k] = -1
    dtype = rng.choice([torch.int32, torch.int64])
    return CopyCase(
        src, dst, torch.tensor(s, dtype=dtype), torch.tensor(d, dtype=dtype),
        dict(nbytes=nbytes, src_stride=src_stride, dst_stride=dst_stride,
             src_offset=src_offset, dst_offset=dst_offset, rows=rows,
             src_row_stride=src_row_stride, dst_row_stride=dst_row_stride),
    )


@pytest.fixture(scope="session")
def copy_case() -> Callable[..., CopyCase]:
    """:func:`make_copy_case`, for tests in this directory."""
    return make_copy_case
