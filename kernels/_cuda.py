"""Loading and launching the ``.cu`` kernels through CuPy, on torch's current stream.

The wrappers in :mod:`kernels.copy` and :mod:`kernels.remap` talk to a :class:`Backend`: it turns
a tensor into the address a kernel dereferences and launches a named kernel. :class:`CupyBackend`
is the real one; tests substitute a host emulation of the same ``.cu`` sources. Tensors cross by
data pointer (not DLPack) because the host side of a device<->host copy is pinned host memory,
which has no CuPy array type; the kernels take every pointer as a 64-bit integer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kernels.errors import KernelArgumentError

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
NVRTC_OPTIONS = ("-std=c++17",)
_MAX_STREAMS = 64


class Backend(Protocol):
    """What a kernel wrapper needs from the device side."""

    def pointer(self, tensor: torch.Tensor) -> int:
        """The address of ``tensor``'s first element as the kernels' device sees it."""
        ...

    def launch(
        self,
        module: str,
        kernel: str,
        device: torch.device,
        grid: tuple[int, int],
        block: int,
        args: Sequence[int],
    ) -> None:
        """Enqueue ``kernel`` of ``module``.cu with 64-bit integer ``args`` on ``device``'s
        current torch stream; returns before it runs."""
        ...


def source(module: str) -> str:
    """The CUDA source text of ``kernels/<module>.cu``."""
    return (SOURCE_DIR / f"{module}.cu").read_text()


class CupyBackend:
    """Compiles each module once per device with NVRTC (CuPy caches the binary on disk too)."""

    def __init__(self, cupy: Any) -> None:
        self._cupy = cupy
        self._modules: dict[tuple[str, int], Any] = {}
        self._functions: dict[tuple[str, str, int], Any] = {}
        self._streams: dict[tuple[int, int], Any] = {}
        self._failed: set[tuple[str, int]] = set()

    def ready(self, module: str, kernels: Sequence[str], device: torch.device) -> bool:
        """Whether ``kernels`` of ``module`` compile for ``device``; a failure is logged once and
        remembered, so the callers fall back to the torch reference from then on."""
        index = _index(device)
        if (module, index) in self._failed:
            return False
        try:
            for kernel in kernels:
                self._function(module, kernel, index)
            self._stream(index)  # wrapping torch's stream must work too, or no launch would
        except Exception:
            log.warning("kernels: %s.cu failed to load on cuda:%d; using the torch reference",
                        module, index, exc_info=True)
            self._failed.add((module, index))
            return False
        return True

    def pointer(self, tensor: torch.Tensor) -> int:
        if tensor.is_cuda:
            return tensor.data_ptr()
        runtime = self._cupy.cuda.runtime
        attrs = runtime.pointerGetAttributes(tensor.data_ptr())
        if attrs.type != runtime.memoryTypeHost or not attrs.devicePointer:
            raise KernelArgumentError(
                f"kernels: host tensor at {tensor.data_ptr():#x} is not pinned (memory type "
                f"{attrs.type}); pass pinned memory or use the torch reference"
            )
        return int(attrs.devicePointer)

    def launch(
        self,
        module: str,
        kernel: str,
        device: torch.device,
        grid: tuple[int, int],
        block: int,
        args: Sequence[int],
    ) -> None:
        index = _index(device)
        function = self._function(module, kernel, index)
        packed = tuple(np.int64(a) for a in args)
        with self._cupy.cuda.Device(index), self._stream(index):
            function(grid, (block,), packed)

    def _function(self, module: str, kernel: str, index: int) -> Any:
        key = (module, kernel, index)
        function = self._functions.get(key)
        if function is None:
            with self._cupy.cuda.Device(index):
                raw = self._modules.get((module, index))
                if raw is None:
                    raw = self._cupy.RawModule(code=source(module), options=NVRTC_OPTIONS)
                    self._modules[(module, index)] = raw
                function = raw.get_function(kernel)  # compiles the module on first use
            self._functions[key] = function
        return function

    def _stream(self, index: int) -> Any:
        current = torch.cuda.current_stream(index)
        key = (index, current.cuda_stream)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= _MAX_STREAMS:
                self._streams.clear()
            cuda = self._cupy.cuda
            if hasattr(cuda, "ExternalStream"):  # CuPy 9 and later
                stream = cuda.ExternalStream(current.cuda_stream, index)
            else:  # a CuPy without it: the __cuda_stream__ protocol
                stream = cuda.Stream.from_external(current)
            self._streams[key] = stream
        return stream


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor on ``device`` without synchronising: a host
    tensor goes through pinned memory (a copy from pageable memory waits for the stream)."""
    t = t.to(dtype)
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True).contiguous()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def cupy_backend() -> CupyBackend | None:
    """The CuPy backend, or None when CuPy does not import (no GPU stack on this machine)."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        log.debug("kernels: cupy unavailable; CUDA tensors use the torch reference")
        return None
    return CupyBackend(cupy)


def cuda_ready(module: str, kernels: Sequence[str], device: torch.device) -> CupyBackend | None:
    """The backend when it can run ``kernels`` of ``module`` on ``device``, else None."""
    backend = cupy_backend()
    return backend if backend is not None and backend.ready(module, kernels, device) else None


def cuda_kernels_ready(device: torch.device | str | int | None = None) -> bool:
    """Whether :func:`kernels.strided_copy` and :func:`kernels.remap` will run their CUDA
    kernels on ``device`` (default: the current one); compiles them on first call."""
    if not torch.cuda.is_available():
        return False
    target = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    return (
        cuda_ready("strided_copy", ("strided_copy",), target) is not None
        and cuda_ready("remap", ("remap_t64_i64_o64",), target) is not None
    )
