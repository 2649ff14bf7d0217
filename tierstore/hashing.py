"""Chained page keys: ``h_0 = H(salt)``, ``h_i = H(h_{i-1} || tokens of page i as uint32 LE)``.

The salt folds in the namespace, the model fingerprint and the layout fingerprint, so two
namespaces (or two layouts) never produce the same page key. SHA-256 by default (a prefix cache
must not be poisonable by crafted collisions); xxh3-128 is the faster opt-in.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import xxhash

from tierstore.errors import NamespaceError, TokenError

HashName = Literal["sha256", "xxh3"]
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_UINT32_MAX = 2**32 - 1


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` if well formed (1-128 chars of ``A-Za-z0-9._:@/-``, starting with a
    letter or digit), else raise NamespaceError."""
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise NamespaceError(
            f"namespace must be 1-128 characters of [A-Za-z0-9._:@/-] starting with a letter or "
            f"digit, got {namespace!r}"
        )
    return namespace


def as_tokens(tokens: object) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array (no copy when already one).

    Accepts a sequence of ints, a numpy integer array, a torch integer tensor, or packed
    little-endian uint32 ``bytes``; raises TokenError for anything else or out-of-range ids.
    One conversion and one range check for the whole array: no per-token Python work."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = memoryview(tokens).cast("B")
        if raw.nbytes % 4:
            raise TokenError(f"packed tokens need a multiple of 4 bytes, got {raw.nbytes}")
        return np.frombuffer(raw, dtype="<u4")
    if isinstance(tokens, torch.Tensor):
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, Sequence) and not isinstance(tokens, str):
        try:
            arr = np.asarray(tokens) if len(tokens) else np.zeros(0, dtype=np.uint32)
        except (ValueError, TypeError, OverflowError) as exc:
            raise TokenError(f"token ids must be a flat sequence of ints ({exc})") from None
    else:
        raise TokenError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TokenError(f"token ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.dtype == np.uint32:
        return arr.astype("<u4", copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _UINT32_MAX):
        raise TokenError(f"token ids must be in [0, 2**32), got range [{arr.min()}, {arr.max()}]")
    return arr.astype("<u4")


class PageHasher:
    """Computes chained page keys for one (namespace, model, layout) salt."""

    def __init__(
        self, model_fingerprint: str, layout_fingerprint: str, page_size: int,
        algorithm: HashName = "sha256",
    ) -> None:
        if algorithm not in ("sha256", "xxh3"):
            raise ValueError(f"hash algorithm must be 'sha256' or 'xxh3', got {algorithm!r}")
        self.page_size = page_size
        self.algorithm = algorithm
        self._prefix = f"tierstore/v1|{model_fingerprint}|{layout_fingerprint}|".encode()

    def _digest(self, data: bytes) -> bytes:
        if self.algorithm == "sha256":
            return hashlib.sha256(data).digest()
        return xxhash.xxh3_128_digest(data)

    def root(self, namespace: str) -> bytes:
        """``h_0``: the salt's hash for ``namespace``."""
        return self._digest(self._prefix + check_namespace(namespace).encode())

    def pages(self, tokens: np.ndarray, namespace: str) -> list[bytes]:
        """Keys of every full page of ``tokens`` (a trailing partial page gets none)."""
        n = len(tokens) // self.page_size
        packed = tokens[: n * self.page_size].astype("<u4", copy=False).tobytes()
        step = self.page_size * 4
        keys: list[bytes] = []
        h = self.root(namespace)
        for i in range(n):
            h = self._digest(h + packed[i * step : (i + 1) * step])
            keys.append(h)
        return keys
