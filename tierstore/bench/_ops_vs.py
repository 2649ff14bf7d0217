"""Other engines' prefix caches driven by ``bench ops``'s loop (``--vs vllm,sglang``), and the
floor every row runs (:class:`DictFloor`).

Each adapter runs one request the way its engine's scheduler does: look the prompt up, allocate
the blocks the hit did not cover, cache the computed blocks, free the request. None of these
engines is a dependency: :func:`make_systems` returns a reason instead of a system when one is
not importable, and the bench prints it.

- ``vllm-hybrid``: vLLM's ``KVCacheManager`` with a full-attention group and a sliding-window
  group (its hybrid coordinator), blocks hashed with its default ``sha256``; the pool holds two
  blocks per cached page (one per group), the same bytes as the store's KV + SWA pages.
- ``vllm-1group``: the same manager with one full-attention group over all layers.
- ``sglang-radix``: SGLang's ``RadixCache`` (full attention only) over a token-granular pool
  of the same pages, paged at the layout's page size.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from tierstore.hashing import PageHasher
from tierstore.layout import ModelLayout

ENGINES = ("vllm", "sglang")


class System(Protocol):
    """One engine's cache under the loop."""

    name: str

    def step(self, prompt: np.ndarray) -> None: ...

    def evictions(self) -> int: ...


class DictFloor:
    """The floor: chained page hashes in an OrderedDict (LRU order) over a free list of ids."""

    def __init__(self, hasher: PageHasher, capacity_pages: int, name: str = "floor") -> None:
        self.name = name
        self.hasher = hasher
        self.pages: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(capacity_pages))
        self._evictions = 0

    def step(self, prompt: np.ndarray) -> None:
        keys = self.hasher.pages(prompt.astype("<u4"), "default")
        hit = 0
        for k in keys:
            if k not in self.pages:
                break
            self.pages.move_to_end(k)
            hit += 1
        need = len(keys) - hit
        while len(self.free) < need:
            self.free.append(self.pages.popitem(last=False)[1])
            self._evictions += 1
        for k in keys[hit:]:
            self.pages[k] = self.free.pop()

    def evictions(self) -> int:
        return self._evictions


def make_systems(engines: list[str], layout: ModelLayout, pages: int
                 ) -> tuple[list[System], dict[str, str]]:
    """The adapters for ``engines`` sized to ``pages`` cached pages, and a reason per system
    that could not be built (engine not installed, API mismatch)."""
    systems: list[System] = []
    skipped: dict[str, str] = {}
    for engine in engines:
        if engine == "vllm":
            for hybrid in (True, False):
                name = "vllm-hybrid" if hybrid else "vllm-1group"
                if hybrid and layout.swa is None:
                    skipped[name] = f"{layout.name} has no sliding-window layers"
                    continue
                try:
                    systems.append(VllmSystem(layout, pages, hybrid))
                except ImportError as e:
                    skipped[name] = f"vLLM is not importable here: {e}"
                except Exception as e:  # an API this adapter does not know
                    skipped[name] = f"vLLM's KVCacheManager: {type(e).__name__}: {e}"
        elif engine == "sglang":
            try:
                systems.append(SglangSystem(layout, pages))
            except ImportError as e:
                skipped["sglang-radix"] = f"SGLang's RadixCache is not importable here: {e}"
            except Exception as e:  # an API this adapter does not know
                skipped["sglang-radix"] = f"SGLang's RadixCache: {type(e).__name__}: {e}"
        else:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return systems, skipped


class VllmSystem:
    """vLLM's v1 ``KVCacheManager`` as its scheduler drives it for one prefill request."""

    def __init__(self, layout: ModelLayout, pages: int, hybrid: bool) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        self.name = "vllm-hybrid" if hybrid else "vllm-1group"
        block = layout.page_size
        # The block manager counts blocks; the bytes per block do not enter its bookkeeping.
        common: dict[str, Any] = {"block_size": block, "num_kv_heads": 1, "head_size": 64,
                                  "dtype": torch.bfloat16}
        full = FullAttentionSpec(**common)
        if hybrid:
            assert layout.sliding_window is not None
            swa = SlidingWindowSpec(**common, sliding_window=layout.sliding_window)
            groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], swa)]
            num_blocks = 2 * pages  # a KV and an SWA block per cached page, shared pool
        else:
            groups = [KVCacheGroupSpec(["full"], full)]
            num_blocks = pages
        tensors = [KVCacheTensor(size=full.page_size_bytes * num_blocks, layers=["full", "swa"],
                                 layer_stride=0, block_stride=full.page_size_bytes)]
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                               kv_cache_groups=groups)
        max_len = 1 << 20
        self.manager = KVCacheManager(config, max_model_len=max_len, scheduler_block_size=block,
                                      hash_block_size=block, enable_caching=True)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block, hash_fn)
        self._params = SamplingParams(max_tokens=1)
        self._request = Request
        self._count = 0
        self._evictions = 0
        pool = self.manager.block_pool
        evict = pool._maybe_evict_cached_block

        def counted(block: Any) -> bool:  # the bench's own count; vLLM keeps none
            evicted = evict(block)
            self._evictions += bool(evicted)
            return evicted

        pool._maybe_evict_cached_block = counted  # type: ignore[method-assign]

    def step(self, prompt: np.ndarray) -> None:
        self._count += 1
        request = self._request(str(self._count), prompt.tolist(), self._params, None,
                                block_hasher=self._hasher)
        manager = self.manager
        hit, computed, _ = manager.get_computed_blocks(request)
        got = manager.allocate_slots(request, request.num_tokens - computed,
                                     num_new_computed_tokens=computed, new_computed_blocks=hit)
        if got is not None:
            request.num_computed_tokens = request.num_tokens
        manager.free(request)

    def evictions(self) -> int:
        return self._evictions


class SglangSystem:
    """SGLang's ``RadixCache``: match, allocate token slots (evicting leaves), insert, unlock."""

    def __init__(self, layout: ModelLayout, pages: int) -> None:
        _import_radix_cache()
        import torch
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.name = "sglang-radix"
        self.page = layout.page_size
        tokens = pages * self.page
        self._torch = torch
        self.allocator = PagedTokenToKVPoolAllocator(tokens, self.page, torch.int64, "cpu",
                                                     _NullKVPool(tokens), False)
        self.cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                                token_to_kv_pool_allocator=self.allocator,
                                                page_size=self.page))
        self._key, self._match, self._insert = RadixKey, MatchPrefixParams, InsertParams
        self._evict = EvictParams
        self._evictions = 0

    def step(self, prompt: np.ndarray) -> None:
        from array import array

        cache, allocator = self.cache, self.allocator
        key = self._key(array("q", prompt.tolist()))
        m = cache.match_prefix(self._match(key=key))
        node, hit = m.last_device_node, m.device_prefix_len
        prefix = cache.path_device_indices(node)[:hit]
        cache.inc_lock_ref(node)
        need = len(prompt) - hit
        if allocator.available_size() < need:
            cache.evict(self._evict(num_tokens=need))
            self._evictions += 1
        fresh = allocator.alloc(need)
        if fresh is not None:
            value = self._torch.cat([prefix.to(self._torch.int64), fresh])
            cache.insert(self._insert(key=key, value=value))
        cache.dec_lock_ref(node)

    def evictions(self) -> int:
        return self._evictions


class _NullKVPool:
    """The byte pool behind SGLang's allocator: the cache's bookkeeping never reads it."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the bench's KV pool has no bytes ({name})")


def _import_radix_cache() -> None:
    """Import SGLang's radix cache, or raise ImportError with why not (0.5.23's import chain
    reaches every model config, and some need torchvision)."""
    try:
        importlib.import_module("sglang.srt.mem_cache.radix_cache")
    except Exception as e:
        raise ImportError(f"{type(e).__name__}: {e}") from None
