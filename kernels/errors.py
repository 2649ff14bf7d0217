"""The one exception the kernels raise for caller misuse."""

from __future__ import annotations

from tierstore.errors import UsageError


class KernelArgumentError(UsageError):
    """Arguments that do not fit their buffers or each other; the message carries the numbers."""
