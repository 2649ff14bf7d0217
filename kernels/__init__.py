"""Batched copy and remap primitives: a CUDA kernel each (CuPy), with a torch reference.

Callers pass torch tensors; the dispatchers (:func:`strided_copy`, :func:`remap`) pick the CUDA
kernel when the tensors live on a CUDA device and CuPy is importable, and a CPU path otherwise.
The references are the specification: tests compare every other path against them.
"""

from kernels._cuda import cuda_kernels_ready
from kernels.copy import strided_copy, strided_copy_cuda, strided_copy_reference
from kernels.errors import KernelArgumentError
from kernels.remap import remap, remap_cuda, remap_reference

__all__ = [
    "KernelArgumentError",
    "cuda_kernels_ready",
    "remap",
    "remap_cuda",
    "remap_reference",
    "strided_copy",
    "strided_copy_cuda",
    "strided_copy_reference",
]
