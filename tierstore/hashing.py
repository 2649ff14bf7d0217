"""Chained page keys: ``h_0 = H(salt)``, ``h_i = H(h_{i-1} || tokens of page i as uint32 LE)``.

The salt folds in the namespace, the model fingerprint and the layout fingerprint, so two
namespaces (or two layouts) never produce the same page key. SHA-256 by default (a prefix cache
must not be poisonable by crafted collisions); xxh3-128 is the faster opt-in.

Where ``tierstore._c_chain`` is built (:mod:`tierstore.native`), the SHA-256 chain, the memo's
shared-page comparison and the common token conversions run compiled; the Python paths below
give byte-identical keys and the same errors (``TIERSTORE_PURE_PYTHON=1`` forces them).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import xxhash

from tierstore.errors import NamespaceError, TokenError
from tierstore.native import load

# chain / shared / narrow_i64 / pack_ints (tierstore/_c_chain.c), or None: the Python paths
_c = load("tierstore._c_chain")

HashName = Literal["sha256", "xxh3"]
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
# A tenant's namespace as the service hands it to the store: ``{tenant}|{namespace}``. No
# client namespace contains ``|`` and no tenant name does, so (tenant, namespace) pairs and
# plain namespaces never share a salt.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_MARK = "|"
_UINT32_MAX = 2**32 - 1
_I8, _U8, _U4 = np.dtype("<i8"), np.dtype("<u8"), np.dtype("<u4")


def check_namespace(namespace: object, *, scoped: bool = True) -> str:
    """Return ``namespace`` if well formed (1-128 chars of ``A-Za-z0-9._:@/-``, starting with a
    letter or digit; with ``scoped``, also a :func:`tenant_namespace`), else raise
    NamespaceError. The service checks what clients send with ``scoped=False``."""
    if scoped and type(namespace) is str and namespace in _CHECKED:  # (twice a request)
        return namespace
    if isinstance(namespace, str) and scoped and TENANT_MARK in namespace:
        tenant, _, rest = namespace.partition(TENANT_MARK)
        if _TENANT.fullmatch(tenant) and _NAMESPACE.fullmatch(rest):
            return _checked(namespace)
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise NamespaceError(
            f"namespace must be 1-128 characters of [A-Za-z0-9._:@/-] starting with a letter or "
            f"digit, got {namespace!r:.200}"
        )
    return _checked(namespace) if scoped else namespace


# Namespaces check_namespace accepted (scoped), so a repeat costs one set lookup instead of the
# regular expressions: exact ``str`` only (a subclass may hash or compare its own way), and a
# bounded number (a process sees a few; past the bound the rest are checked every time).
_CHECKED: set[str] = set()
_CHECKED_MAX = 4096


def _checked(namespace: str) -> str:
    if type(namespace) is str and len(_CHECKED) < _CHECKED_MAX:
        _CHECKED.add(namespace)
    return namespace


def tenant_namespace(tenant: str, namespace: str) -> str:
    """The namespace whose salt folds in ``tenant`` (``namespace`` itself for the open tenant
    ``""``): two tenants naming the same namespace get different page keys."""
    check_namespace(namespace, scoped=False)
    if not tenant:
        return namespace
    if not _TENANT.fullmatch(tenant):
        raise NamespaceError(f"tenant must be 1-64 characters of [A-Za-z0-9._-], got "
                             f"{tenant!r:.80}")
    return f"{tenant}{TENANT_MARK}{namespace}"


def as_tokens(tokens: object) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array (no copy when already one).

    Accepts a sequence of ints, a numpy integer array, a torch integer tensor, or packed
    little-endian uint32 ``bytes``; raises TokenError for anything else or out-of-range ids.
    One conversion and one range check for the whole array: no per-token Python work."""
    if type(tokens) is np.ndarray and tokens.ndim == 1:
        if tokens.dtype == _U4:
            return tokens
        if tokens.dtype == _I8:  # what engines hand over most (numpy's default integer)
            return _from_i8(tokens)
    elif (type(tokens) is list or type(tokens) is tuple) and _c is not None:
        out = np.empty(len(tokens), _U4)
        if _c.pack_ints(tokens, out):
            return out
        # not all plain ints in range: the general path below accepts or names the error
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
    if arr.dtype == _I8:
        return _from_i8(arr)
    if arr.size and _out_of_range(arr):
        raise TokenError(f"token ids must be in [0, 2**32), got range [{arr.min()}, {arr.max()}]")
    return arr.astype("<u4")


def _from_i8(arr: np.ndarray) -> np.ndarray:
    """A 1-D int64 array as uint32, range-checked: compiled in one pass where built and the
    array is contiguous; else one reduction (viewed unsigned, a negative id is above the range
    too, so it checks both ends) and one cast."""
    if _c is not None and arr.flags.c_contiguous:
        out = np.empty(len(arr), _U4)
        if _c.narrow_i64(arr, out):
            return out
    elif not arr.size or int(arr.view(_U8).max()) <= _UINT32_MAX:
        return arr.astype(_U4)
    raise TokenError(f"token ids must be in [0, 2**32), got range [{arr.min()}, {arr.max()}]")


def pack_prompt(tokens: np.ndarray, page: int, limit: int) -> bytes | None:
    """``_c_chain.pack_prompt``'s pure twin: the whole pages of a 1-D int64 or uint32 array of
    at most ``limit`` ids, every id in ``[0, 2**32)``, packed as uint32 LE bytes; None for
    anything else (the caller's checked path names what is wrong)."""
    if tokens.ndim != 1 or tokens.dtype not in (_I8, _U4) or len(tokens) > limit:
        return None
    if tokens.dtype == _I8 and tokens.size and int(tokens.view(_U8).max()) > _UINT32_MAX:
        return None
    return tokens[: len(tokens) // page * page].astype(_U4).tobytes()


def _out_of_range(arr: np.ndarray) -> bool:
    """Whether an integer array holds an id outside ``[0, 2**32)``: one reduction for 64-bit
    ids (viewed unsigned, a negative one is above the range too)."""
    if arr.dtype.itemsize == 8:
        return int(arr.view(arr.dtype.str.replace("i", "u")).max()) > _UINT32_MAX
    if arr.dtype.kind == "i":
        return int(arr.min()) < 0
    return False  # unsigned, at most 32 bits


class PageHasher:
    """Computes chained page keys for one (namespace, model, layout) salt.

    Keys are a pure function of the salt and the tokens, so the hasher remembers the keys of
    recent prompts (``memo_bytes`` of packed tokens at most, least recently used out): a prompt
    sharing leading pages with a remembered one (the same request's insert after its match, a
    shared system prompt) hashes only the pages after the shared run.

    ``native=False`` keeps this hasher on the Python path even where ``tierstore._c_chain`` is
    built (the keys are the same; benchmarks and tests compare the two)."""

    def __init__(
        self, model_fingerprint: str, layout_fingerprint: str, page_size: int,
        algorithm: HashName = "sha256", *, memo_bytes: int = 16 << 20, native: bool = True,
    ) -> None:
        if algorithm not in ("sha256", "xxh3"):
            raise ValueError(f"hash algorithm must be 'sha256' or 'xxh3', got {algorithm!r}")
        self.page_size = page_size
        self.algorithm = algorithm
        self._prefix = f"tierstore/v1|{model_fingerprint}|{layout_fingerprint}|".encode()
        self._digest = hashlib.sha256 if algorithm == "sha256" else xxhash.xxh3_128
        self._memo_bytes = memo_bytes
        self._memo_used = 0
        # (namespace, first page's packed tokens) -> (packed tokens, their page keys)
        self._memo: OrderedDict[tuple[str, bytes], tuple[bytes, tuple[bytes, ...]]] = \
            OrderedDict()
        self._roots: dict[str, bytes] = {}
        # the last call's (namespace, packed tokens, keys): a repeat skips the memo's lookups
        self._last: tuple[str, bytes, tuple[bytes, ...]] = ("", b"", ())
        # the compiled SHA-256 chain; xxh3 and the pure-Python path hash page by page below
        self._c = _c if native and algorithm == "sha256" else None
        self._pack = _c if native else None  # the compiled packers (any algorithm)

    def root(self, namespace: str) -> bytes:
        """``h_0``: the salt's hash for ``namespace``."""
        h = self._roots.get(namespace)
        if h is None:
            h = self._digest(self._prefix + check_namespace(namespace).encode()).digest()
            if len(self._roots) < 4096:
                self._roots[namespace] = h
        return h

    def prompt(self, tokens: object, namespace: object, limit: int
               ) -> tuple[int, list[bytes]] | None:
        """A request's token count and :meth:`pages` keys in one step, for the common call: a
        1-D int64 or uint32 numpy array of at most ``limit`` ids in range, and a namespace this
        hasher has used. None otherwise: the caller takes its checked path (``checks.tokens``,
        :func:`check_namespace`, :meth:`pages`), which names what is wrong. Same keys, same
        memo."""
        if type(tokens) is not np.ndarray or type(namespace) is not str \
                or namespace not in self._roots:  # (root() keeps only checked namespaces)
            return None
        packed = self._pack.pack_prompt(tokens, self.page_size, limit) \
            if self._pack is not None else pack_prompt(tokens, self.page_size, limit)
        if packed is None:
            return None
        return len(tokens), self._keys(packed, namespace) if packed else []

    def pages(self, tokens: np.ndarray, namespace: str) -> list[bytes]:
        """Keys of every full page of ``tokens`` (a trailing partial page gets none)."""
        n = len(tokens) // self.page_size
        if n == 0:
            return []
        packed = self._pack.pack(tokens, n * self.page_size) if self._pack is not None else None
        if packed is None:
            packed = tokens[: n * self.page_size].astype("<u4", copy=False).tobytes()
        return self._keys(packed, namespace)

    def _keys(self, packed: bytes, namespace: str) -> list[bytes]:
        """Keys of the (one or more) whole pages ``packed`` holds, through the memo."""
        step = self.page_size * 4
        n = len(packed) // step
        last = self._last
        if last[1] == packed and last[0] == namespace:
            # the prompt of the call before (an insert after its match): the memo would return
            # the same keys from the entry that call left most recently used, so nothing changes
            return list(last[2])
        memo_key = (namespace, packed[:step])
        seen = self._memo.get(memo_key)
        root = self.root(namespace) if seen is None else None
        shared, keys = self._c.extend(root, seen, packed, step) if self._c is not None \
            else self._extend(root, seen, packed, step)
        if shared == n:  # a remembered prompt starts with this one: nothing new to keep
            assert seen is not None, "without a remembered prompt nothing is shared"
            self._memo.move_to_end(memo_key)
            self._last = (namespace, packed, seen[1][:n])
            return keys
        self._last = (namespace, packed, self._remember(memo_key, packed, keys))
        return keys

    def _extend(self, root: bytes | None, seen: tuple[bytes, tuple[bytes, ...]] | None,
                packed: bytes, step: int) -> tuple[int, list[bytes]]:
        """``_c_chain.extend``'s twin (any algorithm): the keys of ``packed``'s whole pages,
        reusing ``seen``'s for the leading pages both share (how many: the first item), and
        chained from ``root`` when there is no ``seen``."""
        n = len(packed) // step
        shared = 0
        if seen is not None:
            seen_packed, seen_keys = seen
            limit = min(n, len(seen_keys))
            while shared < limit and packed[shared * step : (shared + 1) * step] \
                    == seen_packed[shared * step : (shared + 1) * step]:
                shared += 1
            keys = list(seen_keys[:shared])
        else:
            keys = []
        if shared < n:
            h = keys[-1] if keys else root
            assert h is not None, "a chain from nothing shared needs the root"
            digest = self._digest
            for i in range(shared, n):
                h = digest(h + packed[i * step : (i + 1) * step]).digest()
                keys.append(h)
        return shared, keys

    def _remember(self, memo_key: tuple[str, bytes], packed: bytes, keys: list[bytes]
                  ) -> tuple[bytes, ...]:
        """Keep ``keys`` (as an immutable copy: callers own the lists they get); returns it."""
        kept = tuple(keys)
        if len(packed) > self._memo_bytes // 4:
            return kept
        old = self._memo.pop(memo_key, None)
        if old is not None:
            self._memo_used -= len(old[0])
        self._memo[memo_key] = (packed, kept)
        self._memo_used += len(packed)
        while self._memo_used > self._memo_bytes:
            _, (gone, _) = self._memo.popitem(last=False)
            self._memo_used -= len(gone)
        return kept
