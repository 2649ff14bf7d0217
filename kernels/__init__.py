"""Batched copy and remap primitives: a CUDA kernel each (CuPy), with a torch reference.

Callers pass torch tensors; the dispatcher picks the CUDA kernel when the tensors live on a CUDA
device and CuPy is importable, and the torch reference otherwise. The references are the
specification: GPU tests compare the kernels against them.
"""

from kernels.copy import strided_copy, strided_copy_reference
from kernels.remap import remap, remap_reference

__all__ = ["remap", "remap_reference", "strided_copy", "strided_copy_reference"]
