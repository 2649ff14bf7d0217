"""Deterministic token blocks: every trace hash id becomes the same 512 token ids, always.

Token ``j`` of the block for hash id ``h`` is ``splitmix64(seed_mix ^ (h * 512 + j)) % vocab``:
a pure function of (seed, id, position), so shared ids give shared token prefixes, different
ids give different blocks (with overwhelming probability), and a whole request is generated in
one vectorized call (no per-block Python work, no cache of blocks to hold in memory).
"""

from __future__ import annotations

import numpy as np

from tierstore.replay.trace import BLOCK_TOKENS, TraceRequest

VOCAB = 151_643  # Qwen's regular vocabulary; any size > 1 works
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.uint64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on uint64 (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _M1
    z = (z ^ (z >> _U64(27))) * _M2
    return z ^ (z >> _U64(31))


def block_tokens(hash_ids: np.ndarray, *, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    """Token ids of the blocks ``hash_ids`` (any shape ``[n]``): ``uint32 [n, 512]``."""
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"hash ids must be non-negative, got {int(ids.min())}")
    mix = _splitmix64(np.asarray([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        x = (ids.astype(np.uint64)[:, None] * _U64(BLOCK_TOKENS) + _OFFSETS) ^ mix
        return (_splitmix64(x) % _U64(vocab)).astype(np.uint32)


def request_tokens(request: TraceRequest, *, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    """The prompt of ``request``: its blocks end to end, cut to ``input_length`` tokens
    (``uint32 [input_length]``)."""
    return block_tokens(request.hash_ids, seed=seed, vocab=vocab).reshape(-1)[
        : request.input_length]
