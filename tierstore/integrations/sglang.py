"""SGLang HiCache L3 storage backend: pages live in a running ``tierstore serve``.

SGLang loads it without a patch (``backend_class(storage_config, kwargs)``)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "tierstore", "module_path": "tierstore.integrations.sglang",
        "class_name": "TierStoreHiCacheStorage", "url": "http://127.0.0.1:8080"}'

Pages are opaque bytes under SGLang's page hashes in the service's key-addressed storage API
(host LRU + Redis), in a namespace derived from the deployment (model, TP/PP/CP ranks, host-pool
layout) so that two deployments never read each other's pages. SGLang calls the backend from
its prefetch and backup threads; every request runs on the private event-loop thread of a
:class:`~tierstore.client.Client`. An unreachable or failing service turns into misses /
``False`` with a rate-limited log line — never an exception into SGLang.

Importing this module does not need SGLang; constructing the backend does.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch

from tierstore.hashing import check_namespace
from tierstore.integrations._io import ServiceIO
from tierstore.integrations._support import (
    TierStoreL3Config,
    _as_buffer,
    _Counters,
    _digest,
    _LogLimiter,
    _PoolInfo,
    _sanitize,
    _storage_metrics,
)
from tierstore.shm_client import copy_bytes

log = logging.getLogger(__name__)

SGLANG_IMPORT_ERROR: ImportError | None = None
try:
    from sglang.srt.mem_cache import hicache_storage as _sgl
except ImportError as exc:  # the optional extra is not installed: the class says so when used
    _sgl = None
    SGLANG_IMPORT_ERROR = exc

_Base: Any = _sgl.HiCacheStorage if _sgl is not None else object
KV, MAMBA = "kv", "mamba"  # SGLang's PoolName values (a str enum): KV keys stay bare
_MAX_TRACKED = 1 << 20  # keys remembered for clear()
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _shielded(default: Callable[..., Any]) -> Callable[[F], F]:
    """Any exception of the wrapped call becomes ``default(*args)`` and a log line: SGLang's
    storage threads must never see one."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: TierStoreHiCacheStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                self._counters.fail()
                self._log.warning("tierstore %s failed", fn.__name__, exc_info=True)
                return default(*args, **kwargs)

        return cast(F, inner)

    return wrap


def _keys_of(transfers: Sequence[Any], *_: Any, **__: Any) -> dict[Any, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers}


def _no_pages(keys: Sequence[str], *_: Any, **__: Any) -> list[Any]:
    return [False] * len(keys)


class TierStoreHiCacheStorage(_Base):
    """SGLang ``HiCacheStorage`` over ``tierstore serve``'s storage API.

    Values are SGLang flat data pages, byte for byte: the generic ``get``/``set`` path, the
    zero-copy ``*_v1`` path (pages read from / written into the registered host pool) and the
    hybrid ``*_v2`` path (one host pool per ``PoolTransfer``) share one format, so a page
    stored through one path reads back through another.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        if _sgl is None:
            raise ImportError("TierStoreHiCacheStorage needs SGLang: pip install --no-deps "
                              "sglang==0.5.23 && pip install 'tierstore[sglang]'"
                              ) from SGLANG_IMPORT_ERROR
        self.storage_config = storage_config
        self.config = TierStoreL3Config.from_mapping(
            {**(storage_config.extra_config or {}), **(kwargs or {})})
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self._pools: dict[str, _PoolInfo] = {}
        self._namespaces = self._derive_namespaces(None)
        self._log = _LogLimiter(self.config.log_interval_s)
        self._counters = _Counters(bool(storage_config.enable_storage_metrics))
        self._lock = threading.Lock()
        self._written: dict[tuple[str, str], None] = {}
        self._untracked = 0
        self._io = ServiceIO(self.config, self._counters, self._log)
        log.info("tierstore HiCache L3 at %s (%s, %s), namespace %s", self.config.url,
                 "reachable" if self._io.reachable else "NOT reachable yet: every page misses "
                 "until it is", self._io.mode, self.namespace)

    # ------------------------------------------------------------------ registration
    @property
    def namespace(self) -> str:
        """The namespace this rank's KV pages live in."""
        return self._ns(KV)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt the anchor host pool: its layout joins the namespace, v1 reads and writes it."""
        super().register_mem_pool_host(mem_pool_host)
        self._pools[KV] = _PoolInfo.of(mem_pool_host)
        self._namespaces = self._derive_namespaces(self._pools[KV])
        log.info("tierstore HiCache L3 namespace %s (host pool %s)", self.namespace,
                 type(mem_pool_host).__name__)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Adopt a v2 host pool (Mamba, SWA, ...); its geometry tags its pages' keys."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools[str(host_pool_name)] = _PoolInfo.of(host_pool)

    def _derive_namespaces(self, anchor: _PoolInfo | None) -> tuple[str, str]:
        """(per-rank, rank-shared) namespaces. MLA KV is replicated across TP ranks, so its
        pages are shared by rank; everything else (and Mamba state always) is per rank."""
        sc = self.storage_config
        shard = {"pp": (sc.pp_rank, sc.pp_size), "cp": (sc.attn_cp_rank, sc.attn_cp_size),
                 "dcp": (getattr(sc, "dcp_rank", 0), getattr(sc, "dcp_size", 1))}
        common = {"format": 1, "model": sc.model_name, "mla": sc.is_mla_model, **shard,
                  "page_first": sc.is_page_first_layout,
                  "logical_page_size": getattr(sc, "logical_page_size", None),
                  "split_heads": getattr(sc, "should_split_heads", False),
                  "tp_lcm_size": getattr(sc, "tp_lcm_size", None),
                  "host_pool": None if anchor is None else anchor.digest}
        tail = "".join(f"-{k}{r}of{n}" for k, (r, n) in shard.items() if n > 1)
        out = []
        for tp in ((sc.tp_rank, sc.tp_size), None):
            label = (f"tp{tp[0]}of{tp[1]}" if tp else "shared") + tail
            digest = _digest({**common, "tp": tp})[:12]
            room = 128 - len(self.config.namespace) - len(label) - len(digest) - 3
            model = _sanitize(sc.model_name or "model", max(8, min(48, room)))
            out.append(check_namespace(f"{self.config.namespace}/{model}/{label}.{digest}"))
        return out[0], out[1]

    def _ns(self, pool: str) -> str:
        shared = self.storage_config.is_mla_model and pool != MAMBA
        return self._namespaces[1] if shared else self._namespaces[0]

    def _key(self, key: str, pool: str, info: _PoolInfo | None) -> str:
        if pool == KV or info is None:
            return key
        return f"{key}.{pool}.{info.digest}"

    # ------------------------------------------------------------------ requests
    @property
    def transport(self) -> str:
        """``shm`` while pages move through the service's shared segment, else ``http``."""
        return self._io.mode

    def _store(self, ns: str, keys: Sequence[str], sizes: Sequence[int],
               fill: Callable[[int, torch.Tensor], None], blob: Callable[[int], Any]
               ) -> list[bool]:
        """Store value ``i`` under ``keys[i]`` (see ``ServiceIO.write``) and remember it for
        :meth:`clear`; per key whether the service holds it now."""
        stored = self._io.write(ns, keys, sizes, fill, blob)
        self._track(ns, [k for k, ok in zip(keys, stored, strict=True) if ok])
        return stored

    def _track(self, ns: str, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                if len(self._written) < _MAX_TRACKED:
                    self._written[(ns, k)] = None
                elif (ns, k) not in self._written:
                    self._untracked += 1

    # ------------------------------------------------------------------ generic path
    @_shielded(lambda key, *_, **__: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """The page under ``key`` (copied into ``target_location`` when given), or None."""
        return self.batch_get([key], [target_location])[0]

    @_shielded(lambda keys, *_, **__: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        """Pages of ``keys`` (None where missing), each copied into its target tensor when
        ``target_locations`` gives one, else a fresh tensor."""
        started = time.perf_counter()
        targets = list(target_locations or [None] * len(keys))
        sizes = [t.numel() * t.element_size() if isinstance(t, torch.Tensor) else
                 self._pools[KV].page_bytes if KV in self._pools else 0 for t in targets]
        out: list[torch.Tensor | None] = [None] * len(keys)

        def take(i: int, value: torch.Tensor) -> bool:
            out[i] = self._to_tensor(value, targets[i])
            return out[i] is not None

        self._io.read(self._ns(KV), keys, sizes, take)
        self._counters.record("get", len(keys), sum(t is not None for t in out),
                              sum(t.numel() * t.element_size() for t in out if t is not None),
                              time.perf_counter() - started)
        return out

    def _to_tensor(self, value: torch.Tensor, target: Any) -> torch.Tensor | None:
        """``value`` (uint8, valid only now) copied into ``target`` or a fresh tensor."""
        if isinstance(target, torch.Tensor):
            if target.numel() * target.element_size() != value.numel():
                self._log.warning("tierstore page of %d bytes does not fit a %d-byte target",
                                  value.numel(), target.numel() * target.element_size())
                return None
            if target.is_contiguous():
                copy_bytes(target.view(-1).view(torch.uint8), value)
            else:
                target.copy_(value.view(target.dtype).view(target.shape))
            return target
        info = self._pools.get(KV)
        if info is not None and value.numel() == info.page_bytes:
            return value.view(info.dtype).clone()
        return value.clone()

    @_shielded(lambda *_, **__: False)
    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store one page (a tensor or bytes); True when the service holds it."""
        return self.batch_set([key], [value])

    @_shielded(lambda *_, **__: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store pages in order (parent first); True when the service holds every one."""
        if values is None or len(values) != len(keys) or any(v is None for v in values):
            self._log.warning("tierstore batch_set needs one value per key (%d keys, %s values)",
                              len(keys), None if values is None else
                              sum(v is not None for v in values))
            return False
        started = time.perf_counter()
        flat = [_as_bytes(v) for v in values]

        def fill(i: int, view: torch.Tensor) -> None:
            copy_bytes(view, flat[i])

        sizes = [t.numel() for t in flat]
        stored = self._store(self._ns(KV), keys, sizes, fill, lambda i: _as_buffer(flat[i]))
        self._counters.record("set", len(keys), sum(stored), sum(sizes),
                              time.perf_counter() - started)
        return all(stored)

    @_shielded(lambda *_, **__: False)
    def exists(self, key: str) -> bool:
        """Whether the service holds ``key``."""
        return self._io.count(self._ns(KV), [key]) == 1

    @_shielded(lambda *_, **__: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (0 when unreachable)."""
        return self._io.count(self._ns(KV), keys)

    # ------------------------------------------------------------------ host-pool paths
    @_shielded(_no_pages)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
                     ) -> list[bool]:
        """Read pages straight into the registered host pool at ``host_indices``."""
        return self._load(KV, list(keys), host_indices)

    @_shielded(_no_pages)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
                     ) -> list[bool]:
        """Write the registered host pool's pages at ``host_indices`` under ``keys``."""
        return self._save(KV, list(keys), host_indices)

    @_shielded(_keys_of)
    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        """Per transfer, read its pages into its pool's host memory; per-page success."""
        return {t.name: self._load(str(t.name), list(t.keys or []), t.host_indices)
                for t in transfers}

    @_shielded(_keys_of)
    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        """Per transfer, write its pool's host pages under its keys; per-page success."""
        return {t.name: self._save(str(t.name), list(t.keys or []), t.host_indices)
                for t in transfers}

    def _offsets(self, pool: str, keys: list[str], host_indices: Any) -> list[int] | None:
        info = self._pools.get(pool)
        if info is None:
            self._log.warning("tierstore: no host pool registered as %r", pool)
            return None
        if host_indices is None or host_indices.numel() != len(keys) * info.page_size:
            self._log.warning("tierstore %s: %d keys need %d host indices, got %s", pool,
                              len(keys), len(keys) * info.page_size,
                              None if host_indices is None else host_indices.numel())
            return None
        return [int(i) for i in host_indices[::info.page_size].tolist()]

    def _load(self, pool: str, keys: list[str], host_indices: Any) -> list[bool]:
        started = time.perf_counter()
        offsets = self._offsets(pool, keys, host_indices)
        if offsets is None:
            return [False] * len(keys)
        info = self._pools[pool]

        def take(i: int, value: torch.Tensor) -> bool:
            if value.numel() != info.page_bytes:
                self._log.warning("tierstore %s page %s has %d bytes, expected %d", pool,
                                  keys[i], value.numel(), info.page_bytes)
                return False
            info.pool.set_from_flat_data_page(offsets[i], value.view(info.dtype))
            return True

        loaded = self._io.read(self._ns(pool), [self._key(k, pool, info) for k in keys],
                               [info.page_bytes] * len(keys), take)
        self._counters.record("get", len(keys), sum(loaded), sum(loaded) * info.page_bytes,
                              time.perf_counter() - started)
        return loaded

    def _save(self, pool: str, keys: list[str], host_indices: Any) -> list[bool]:
        started = time.perf_counter()
        offsets = self._offsets(pool, keys, host_indices)
        if offsets is None:
            return [False] * len(keys)
        info = self._pools[pool]

        def fill(i: int, view: torch.Tensor) -> None:
            _copy_page(info.pool, offsets[i], view, info.dtype)

        def blob(i: int) -> memoryview:
            return _as_buffer(info.pool.get_data_page(offsets[i], flat=True))

        stored = self._store(self._ns(pool), [self._key(k, pool, info) for k in keys],
                             [info.page_bytes] * len(keys), fill, blob)
        self._counters.record("set", len(keys), sum(stored), len(keys) * info.page_bytes,
                              time.perf_counter() - started)
        return stored

    # ------------------------------------------------------------------ hybrid existence
    @_shielded(lambda *_, **__: _sgl.PoolTransferResult.empty())
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None,
                        extra_info: Any = None) -> Any:
        """Every KV prefix length at which every pool can be restored, as SGLang's own
        backends answer it (its caller intersects the sets of all ranks).

        ``all_pages`` pools must hold every page of the prefix; ``trailing_pages`` pools only
        the last ``len(transfer.keys)`` pages before its end (Mamba state, SWA window), so a
        prefix length counts only when its KV pages are stored too. Pool pages live under the
        KV page hashes of ``keys``. One existence request per pool (per ``max_batch`` keys).
        """
        keys = list(keys)
        kv_pages = self._io.count(self._ns(KV), keys)
        hits: dict[Any, int] = {_sgl.PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            info = self._pools.get(name)
            if info is None:
                self._log.warning("tierstore: no host pool registered as %r", name)
                restorable = []
                break
            ns, pool_keys = self._ns(name), [self._key(k, name, info) for k in keys[:kv_pages]]
            if transfer.hit_policy == _sgl.PoolHitPolicy.ALL_PAGES:
                own = set(range(1, self._io.count(ns, pool_keys) + 1))
            elif transfer.hit_policy == _sgl.PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or []))
                own = _window_ends(self._io.present(ns, pool_keys), window)
            else:
                self._log.warning("tierstore: hit policy %s is not supported (pool %s)",
                                  transfer.hit_policy, name)
                own = set()
            if own:
                hits[transfer.name] = max(own)
            restorable = [p for p in restorable if p in own]
        return _sgl.PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    # ------------------------------------------------------------------ control
    @_shielded(lambda *_, **__: False)
    def clear(self) -> bool:
        """Delete every page this backend stored (the storage API has no namespace-wide
        delete); False when some could not be deleted or were past the tracking limit."""
        with self._lock:
            written, self._written = list(self._written), {}
            untracked, self._untracked = self._untracked, 0
        by_ns: dict[str, list[str]] = {}
        for ns, key in written:
            by_ns.setdefault(ns, []).append(key)
        ok = untracked == 0
        for ns, keys in by_ns.items():
            ok = self._io.delete(ns, keys) and ok
        log.info("tierstore HiCache L3: cleared %d pages%s", len(written),
                 f" ({untracked} stored past the tracking limit remain)" if untracked else "")
        return ok

    @_shielded(lambda *_, **__: None)
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (per-batch lists since the last call, filled when storage
        metrics are on) with the cumulative counters as ``.tierstore``."""
        with self._counters.lock:
            lists = {k: list(v) for k, v in self._counters.lists.items()}
            for v in self._counters.lists.values():
                v.clear()
            totals = dict(self._counters.totals)
        metrics = _storage_metrics(lists)
        metrics.tierstore = totals
        return metrics

    def close(self) -> None:
        """Unmap the shared segment, close the client and its event-loop thread."""
        self._io.close()


def _window_ends(present: Sequence[bool], window: int) -> set[int]:
    """Prefix lengths ``p`` whose last ``min(window, p)`` pages are all present."""
    ends, run = set(), 0
    for p, here in enumerate(present, 1):
        run = run + 1 if here else 0
        if run >= min(window, p):
            ends.add(p)
    return ends


def _as_bytes(value: Any) -> torch.Tensor:
    """A flat ``uint8`` CPU tensor over a tensor's (or bytes-like) bytes, no copy if possible."""
    if isinstance(value, torch.Tensor):
        return value.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    view = _as_buffer(value)
    return torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else \
        torch.empty(0, dtype=torch.uint8)


def _copy_page(pool: Any, index: int, out: torch.Tensor, dtype: torch.dtype) -> None:
    """Host-pool page ``index`` as its flat data page into ``out`` (uint8): one strided copy
    from the page's own view when the pool exposes one of the page's size (the flat page is
    that view flattened), else through ``get_data_page(flat=True)``."""
    page = pool.get_data_page(index, flat=False)
    if isinstance(page, torch.Tensor) and page.dtype == dtype and \
            page.numel() * page.element_size() == out.numel():
        flat = out.view(dtype).view(page.shape)
        if page.dim() > 1 and not page.is_contiguous() and all(p.is_contiguous() for p in page):
            for dst, src in zip(flat, page, strict=True):  # e.g. page_first: K block, V block
                copy_bytes(dst, src)
        else:
            copy_bytes(flat, page)
    else:
        copy_bytes(out, _as_bytes(pool.get_data_page(index, flat=True)))
