"""``TierStore``: the library entry point (L1 = the unified arena)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future

import torch

from gpu_arena import Arena, IntegrityError, PoolSpec
from host_tier import HostTier
from tierstore.checks import Blocks, InputChecks
from tierstore.config import StoreConfig
from tierstore.errors import LeaseError, ShapeError
from tierstore.eviction import make_policy, victims
from tierstore.hashing import PageHasher, check_namespace
from tierstore.layout import ModelLayout
from tierstore.movement import DIRECTIONS, TierMovement
from tierstore.radix import Node, RadixIndex, Segment
from tierstore.remote import Probe, RemoteBridge
from tierstore.results import Allocation, InsertResult, Lease, MatchResult, StoreStats

log = logging.getLogger(__name__)

KINDS = ("kv", "swa", "state")
_ANCHOR = {"state": "low", "swa": "float", "kv": "high"}
_EMPTY = torch.empty(0, dtype=torch.long)


class TierStore(InputChecks, TierMovement):
    """A prefix cache for one model layout over one unified arena (L1), optionally backed by
    host memory (L2) and Redis (L3).

    Engines call :meth:`match` when a request arrives (and hold the lease while reading the
    prefix), :meth:`allocate` for the blocks the request computes (evicting cached prefixes as
    the stopping rule says), :meth:`insert` when it finishes (handing the blocks to the cache),
    and :meth:`release`. Bad input raises a :class:`~tierstore.errors.TierStoreError` and changes
    nothing.
    """

    def __init__(self, layout: ModelLayout, config: StoreConfig) -> None:
        self.layout = layout
        self.config = config
        envelopes = layout.envelopes()
        self.kinds = tuple(k for k in KINDS if k in envelopes)
        shares = dict(config.pool_shares or ())
        pools = [PoolSpec(k, envelopes[k].nbytes, _ANCHOR[k],  # type: ignore[arg-type]
                          max_bytes=int(config.capacity_bytes * shares[k]) if k in shares
                          else None) for k in self.kinds]
        self.arena = Arena(config.capacity_bytes, pools, config.device)
        self.host = HostTier(config.host_capacity_bytes, pools) \
            if config.host_capacity_bytes else None
        self.remote = RemoteBridge(config.remote, layout.fingerprint) if config.remote else None
        self.index = RadixIndex()
        self.hasher = PageHasher(layout.name, layout.fingerprint, layout.page_size,
                                 config.hash_algorithm)
        self.policy = make_policy(config.eviction)
        retention = config.swa_retention
        if retention == "auto":
            retention = "window" if layout.state is not None else "all"
        self._swa_window_only = retention == "window"
        self._owned: dict[str, set[int]] = {k: set() for k in self.kinds}
        self._outstanding = dict.fromkeys(self.kinds, 0)
        self._tick = 0
        self._requests = self._requests_hit = self._tokens_queried = self._tokens_hit = 0
        self._evictions = 0
        self._evicted = dict.fromkeys(self.kinds, 0)
        self._moved = dict.fromkeys(DIRECTIONS, 0)
        self._pending = []
        # Background L3 discovery (best_effort), by the first page the index did not know.
        self._probing: dict[bytes, tuple[list[bytes], int, Future[Probe]]] = {}
        self._hit_tokens = {"l1": 0, "l2": 0, "l3": 0}
        self._hit_requests = {"l1": 0, "l2": 0, "l3": 0, "miss": 0}

    def close(self) -> None:
        """Stop the L3 connection thread (the arenas need no closing)."""
        if self.remote is not None:
            self.remote.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== lookup
    def match(self, tokens: object, namespace: str = "default", *, priority: int = 0
              ) -> MatchResult:
        """The longest usable cached prefix of ``tokens``, brought into L1 and locked with a
        lease (when non-empty).

        A prefix of P pages is usable when its KV pages are present in some tier, a state
        checkpoint sits at exactly P (models with recurrent layers), and the SWA pages of the
        window before P are present (models with SWA layers). Parts in L2/L3 are promoted into
        L1, evicting per the stopping rule; if they cannot be, the result falls back to what L1
        alone serves."""
        toks = self._tokens(tokens)
        keys = self.hasher.pages(toks, check_namespace(namespace))
        self._pump()
        self._pump_probes()
        best_effort = self.config.prefetch == "best_effort"
        timeout = self.config.prefetch_timeout_s if self.config.prefetch == "timeout" else None
        if self.remote is not None:
            if best_effort:
                self._discover_later(keys)
            else:
                self._discover(keys, timeout)
        self._requests += 1
        self._tokens_queried += len(toks)
        tiers: tuple[int, ...] = (1, 2) if best_effort else (1, 2, 3)
        if best_effort and self.remote is not None:
            deeper = self._usable(self.index.walk(keys), (1, 2, 3))[0]
            if deeper > self._usable(self.index.walk(keys), tiers)[0]:
                self._prefetch(keys, deeper)
        for _ in range(4):
            path = self.index.walk(keys)
            pages, found = self._usable(path, tiers)
            if pages == 0:
                break
            node = self.index.node_ending_at(_cut(path, pages))
            self.index.lock(node, +1)
            path = self.index.walk(keys[:pages])
            status, sources = self._promote(path, pages, timeout)
            if status == "ok":
                return self._hit(node, path, pages, found, sources, priority)
            self.index.lock(node, -1)
            if status == "no_room":  # L1 cannot take the lower tiers' part: serve L1 alone
                tiers = (1,)
            elif status == "unavailable":  # Redis is down or slow: serve L1 + L2 this time
                tiers = (1, 2)
            # "partial": entries missing in L3 are now marked absent there; plan again
        self._hit_requests["miss"] += 1
        _, found = self._usable(self.index.walk(keys), tiers)
        return MatchResult(0, 0, _EMPTY, _EMPTY, None, None, found)

    def _hit(self, node: Node, path: list[Segment], pages: int, found: int,
             sources: dict[int, int], priority: int) -> MatchResult:
        """Build the result of a promoted, locked prefix and count it per tier."""
        self._touch(node, priority, hit=True)
        page = self.layout.page_size
        self._requests_hit += 1
        self._tokens_hit += pages * page
        for tier in (1, 2, 3):
            self._hit_tokens[f"l{tier}"] += sources[tier] * page
        deepest = 3 if sources[3] else 2 if sources[2] else 1
        self._hit_requests[f"l{deepest}"] += 1
        if self.config.write_policy == "write_through_selective":
            for n in self.index.path_to(node):
                if n.hits == self.config.write_through_hits:
                    self._backup(n)
        kv = [v for seg in path for v in seg.node.kv[: seg.pages]]
        swa = [v for seg in path for v in seg.node.swa[: seg.pages]]
        state = node.state if self.layout.state is not None else None
        tiers = {f"l{t}": sources[t] * page for t in (1, 2, 3)}
        return MatchResult(pages * page, pages, torch.tensor(kv, dtype=torch.long),
                           torch.tensor(swa, dtype=torch.long), state, Lease(node, self), found,
                           tiers)

    def peek(self, tokens: object, namespace: str = "default", *, tiers: tuple[int, ...] = (1,)
             ) -> int:
        """Tokens of ``tokens`` that are cached now in ``tiers`` (default L1 only) under the
        hybrid rule. Changes nothing: no lease, no promotion, no use recorded, no counters."""
        toks = self._tokens(tokens)
        path = self.index.walk(self.hasher.pages(toks, check_namespace(namespace)))
        return self._usable(path, tiers)[0] * self.layout.page_size

    def _usable(self, path: list[Segment], tiers: tuple[int, ...]) -> tuple[int, int]:
        """Deepest prefix length (pages) the hybrid match rule accepts, and the consecutive KV
        pages present; an entry counts as present when one of ``tiers`` holds it."""
        def present(values: list[list[int]]) -> list[bool]:
            return [any(v >= 0 for v in vs) for vs in zip(*values, strict=True)]

        kv = [p for seg in path for p in present(
            [seg.node.col("kv", t)[: seg.pages] for t in tiers])]
        found = next((i for i, ok in enumerate(kv) if not ok), len(kv))
        swa = [p for seg in path for p in present(
            [seg.node.col("swa", t)[: seg.pages] for t in tiers])]
        window = self.layout.swa_window_pages()

        def window_ok(end: int) -> bool:
            return self.layout.swa is None or all(swa[max(0, end - window):end])

        if self.layout.state is not None:
            for seg in reversed(path):
                n = seg.node
                if (seg.pages == len(n.keys) and any(n.checkpoint(t) >= 0 for t in tiers)
                        and n.end <= found and window_ok(n.end)):
                    return n.end, found
            return 0, found
        end = found
        while end > 0 and not window_ok(end):
            end -= 1
        return end, found

    def _discover(self, keys: list[bytes], timeout: float | None) -> None:
        """Learn pages that L3 holds beyond what the index knows (written by another instance
        or before a restart) and hang them into the index as L3-resident."""
        assert self.remote is not None
        known = sum(seg.pages for seg in self.index.walk(keys))
        if known < len(keys):
            probe = self.remote.probe(keys[known:], self._probe_kinds(), timeout)
            if probe is not None:
                self._learn(keys, known, probe)

    def _discover_later(self, keys: list[bytes]) -> None:
        """:meth:`_discover` without waiting (``best_effort``): the probe runs in the
        background and :meth:`_pump_probes` files what it found, so a later match can
        prefetch those pages."""
        assert self.remote is not None
        known = sum(seg.pages for seg in self.index.walk(keys))
        if known == len(keys) or keys[known] in self._probing:
            return
        self._probing[keys[known]] = (keys, known,
                                      self.remote.submit_probe(keys[known:], self._probe_kinds()))

    def _pump_probes(self) -> None:
        """File background probes that have finished, if the index still ends where it did."""
        for first, (keys, known, future) in list(self._probing.items()):
            if not future.done():
                continue
            del self._probing[first]
            try:
                probe = future.result()
            except Exception as exc:  # a failed probe is only a missed chance
                log.info("L3 discovery probe failed: %s", exc)
                continue
            if sum(seg.pages for seg in self.index.walk(keys)) == known:
                self._learn(keys, known, probe)

    def _probe_kinds(self) -> list[str]:
        return [k for k in ("swa", "state") if k in self.kinds]

    def _learn(self, keys: list[bytes], known: int, probe: Probe) -> None:
        """Hang the pages a probe found after the first ``known`` pages of ``keys`` into the
        index as L3-resident: one node per checkpoint, so each sits at a node's end."""
        found = probe.found
        if found == 0:
            return
        rest = keys[known : known + found]
        swa = probe.present.get("swa", [False] * found)
        ends = [found]
        if self.layout.state is not None:
            ends = [i + 1 for i, ok in enumerate(probe.present["state"]) if ok]
            if not ends:
                return  # KV without any checkpoint cannot serve a hybrid match
        parent = self.index.node_ending_at(self.index.walk(keys[:known]))
        start = 0
        for end in ends:
            parent = self.index.extend(parent, rest[start:end], kv3=[1] * (end - start),
                                       swa3=[1 if ok else -1 for ok in swa[start:end]])
            if self.layout.state is not None:
                parent.state3 = 1
            start = end

    def demote_idle(self, idle_s: float) -> int:
        """Demote from L1 every unlocked prefix unused for ``idle_s`` seconds (to L2 / L3 when
        present, else drop it), deepest first; returns how many nodes left L1. An idle loop
        or the service calls this to keep L1 for hot prefixes."""
        cutoff = time.monotonic() - idle_s
        demoted = 0
        for node in victims(self.index, self.policy,
                            lambda n: n.holds(1) and n.used_at <= cutoff):
            self._evict_l1(node)
            demoted += 1
        return demoted

    def release(self, lease: Lease) -> None:
        """Unlock a matched prefix. Releasing twice, or another store's lease, raises."""
        if not isinstance(lease, Lease) or lease.owner is not self:
            raise LeaseError("lease does not belong to this store")
        if lease.released:
            raise LeaseError("lease already released")
        lease.released = True
        self.index.lock(lease.node, -1)

    # ============================================================= allocation
    def allocate(self, demand: Mapping[str, int]) -> Allocation | None:
        """Fresh blocks ({kind: count}) for a running request, evicting unlocked cached
        prefixes per the stopping rule; ``None`` when even evicting everything unlocked cannot
        make room (what was evicted stays evicted)."""
        demand = self._demand(demand)
        if not self._make_room(demand):
            return None
        blocks = {}
        for kind, n in demand.items():
            ids = self.arena.alloc(kind, n)
            assert ids is not None, f"can_alloc promised {demand}, {kind} failed"
            blocks[kind] = ids
            self._outstanding[kind] += n
        return Allocation(blocks)

    def free(self, kind: str, ids: Blocks) -> None:
        """Return blocks from :meth:`allocate` that will not be inserted."""
        ids_t = self._ids(kind, ids)
        if self._owned[kind].intersection(ids_t.tolist()):
            raise ShapeError(f"{kind}: ids belong to the cache, not to the caller")
        self.arena.free(kind, ids_t)
        self._outstanding[kind] -= ids_t.numel()

    # ================================================================= insert
    def insert(self, tokens: object, namespace: str = "default", *, kv: Blocks = None,
               swa: Blocks = None, state: Blocks | int = None, priority: int = 0
               ) -> InsertResult:
        """Cache the full pages of ``tokens``.

        Each of ``kv`` (one per page), ``swa`` (the *last* ``len(swa)`` pages) and ``state``
        (one checkpoint at exactly ``len(tokens)``, which must then be page-aligned) is either
        L1 ids from :meth:`allocate` / a match (ownership passes to the cache; duplicates of
        cached pages are freed) or envelope bytes, a ``uint8`` tensor ``[n, envelope bytes]``
        (copied into fresh blocks, evicting as needed; ``stored=False`` when they do not fit).
        """
        toks = self._tokens(tokens)
        ns = check_namespace(namespace)
        n_pages = len(toks) // self.layout.page_size
        given = {k: self._blocks(k, v) for k, v in (("kv", kv), ("swa", swa))}
        given["state"] = self._blocks("state", [state] if isinstance(state, int) else state)
        self._check_counts(given, n_pages, len(toks))
        keys = self.hasher.pages(toks, ns)
        path = self.index.walk(keys)
        cached = sum(s.pages for s in path)
        for kind, blocks in given.items():
            if blocks is not None and blocks.dtype == torch.long:
                self._check_ids(kind, blocks, path, n_pages)

        # Bytes: copy into fresh blocks first, so a shortfall changes nothing.
        need = self._bytes_demand(given, path, n_pages)
        demand = {k: int(m.sum()) for k, m in need.items() if int(m.sum())}
        if demand:
            anchor = self.index.node_ending_at(path) if path else None
            if anchor is not None:
                self.index.lock(anchor, +1)
            try:
                if not self._make_room(demand):
                    return InsertResult(False, 0, cached, False, 0, 0)
            finally:
                if anchor is not None:
                    self.index.lock(anchor, -1)
            path = self.index.walk(keys)  # the anchor was locked: the path is intact
        for kind, mask in need.items():
            data = given[kind]
            assert data is not None
            ids = self._store_bytes(kind, data, mask)
            given[kind] = ids if kind != "state" or int(ids[0]) >= 0 else None
        result, end = self._link(keys, path, given, n_pages, cached, priority)
        if self.config.write_policy == "write_through" and end is not self.index.root:
            for node in self.index.path_to(end):
                self._backup(node)
        return result

    def _link(self, keys: list[bytes], path: list[Segment], given: dict[str, torch.Tensor | None],
              n_pages: int, cached: int, priority: int) -> tuple[InsertResult, Node]:
        """Hang the given ids into the tree; ids the cache did not already own pass from the
        caller to the cache, and those it does not keep are freed. Returns the result and the
        node ending at the inserted prefix."""
        handed = {k: sum(1 for i in (v.tolist() if v is not None else [])
                         if i >= 0 and i not in self._owned[k])
                  for k, v in given.items() if k in self.kinds}
        kv_ids, swa_ids = _padded(given["kv"], n_pages), _padded(given["swa"], n_pages)
        state_ids = given["state"]
        end = self.index.node_ending_at(path)
        path = self.index.walk(keys[:cached])  # a split above re-cut the last node
        # A hybrid match can only end at a checkpoint: SWA pages outside the window before one
        # are never read, so (with window retention) they are not kept.
        has_checkpoint = state_ids is not None or (cached == n_pages and end.state >= 0)
        keep_from = 0
        if self._swa_window_only:
            keep_from = n_pages - self.layout.swa_window_pages() if has_checkpoint else n_pages
        spare: dict[str, list[int]] = {k: [] for k in self.kinds}
        dropped = 0
        pos = 0
        for seg in path:  # pages already cached keep the cache's ids; SWA tombstones refill
            n = seg.node
            for j in range(seg.pages):
                p = pos + j
                if kv_ids[p] >= 0 and n.kv[j] < 0:  # cached elsewhere or lost: take it
                    n.kv[j] = kv_ids[p]
                    self._owned["kv"].add(kv_ids[p])
                elif kv_ids[p] >= 0 and kv_ids[p] != n.kv[j]:
                    spare["kv"].append(kv_ids[p])
                if swa_ids[p] >= 0 and swa_ids[p] != n.swa[j]:
                    if n.swa[j] < 0 and p >= keep_from:
                        n.swa[j] = swa_ids[p]
                        self._owned["swa"].add(swa_ids[p])
                    else:
                        spare["swa"].append(swa_ids[p])
            pos += seg.pages
        if cached < n_pages:
            new_swa = swa_ids[cached:]
            for i, sid in enumerate(new_swa):
                if sid >= 0 and cached + i < keep_from:
                    spare["swa"].append(sid)
                    new_swa[i] = -1
                    dropped += 1
            end = self.index.extend(end, keys[cached:], kv=kv_ids[cached:], swa=new_swa)
            for kind, ids in (("kv", end.kv), ("swa", end.swa)):
                if kind in self._owned:
                    self._owned[kind].update(i for i in ids if i >= 0)
        checkpoint = False
        if state_ids is not None:
            sid = int(state_ids[0])
            if end.state < 0:
                end.state = sid
                self._owned["state"].add(sid)
                checkpoint = True
            elif end.state != sid:
                spare["state"].append(sid)
        for kind, ids in spare.items():
            if ids:
                self.arena.free(kind, ids)
        for kind, count in handed.items():
            self._outstanding[kind] -= count
        self._touch(end, priority, hit=False)
        duplicates = sum(len(v) for v in spare.values()) - dropped
        result = InsertResult(True, n_pages - cached, cached, checkpoint, duplicates, dropped)
        return result, end

    # ============================================================= inspection
    def stats(self) -> StoreStats:
        """Counters since start and occupancy now."""
        return StoreStats(self._requests, self._requests_hit, self._tokens_queried,
                          self._tokens_hit, self._evictions, dict(self._evicted),
                          self.index.num_nodes, self.index.num_pages, self.arena.stats(),
                          self.config.stop_rule, dict(self._hit_tokens),
                          dict(self._hit_requests), dict(self._moved),
                          self.host.arena.stats() if self.host else None,
                          self.remote.stats() if self.remote else None)

    def check_integrity(self) -> None:
        """Raise IntegrityError if the arena, the index or their agreement is broken: every id
        in the index is live, owned once, and live = cached + handed out."""
        self.arena.check_integrity()
        self.index.check_integrity()
        seen: dict[str, list[int]] = {k: [] for k in self.kinds}
        for n in self.index.nodes():
            for kind, ids in (("kv", n.kv), ("swa", n.swa), ("state", [n.state])):
                if kind in seen:
                    seen[kind] += [i for i in ids if i >= 0]
        for kind in self.kinds:
            ids = seen[kind]
            if len(ids) != len(set(ids)) or set(ids) != self._owned[kind]:
                raise IntegrityError(f"{kind}: index ids and owned set disagree")
            live = self.arena.num_live(kind)
            if live != len(ids) + self._outstanding[kind]:
                raise IntegrityError(f"{kind}: {live} live blocks != {len(ids)} cached + "
                                     f"{self._outstanding[kind]} handed out")
            if ids:
                self.arena.resolve(kind, ids)  # raises if any is not live
        if self.host is not None:
            self.host.check_integrity()
            for kind in self.kinds:
                held = [v for n in self.index.nodes() for v in (
                    [n.state2] if kind == "state" else n.col(kind, 2)) if v >= 0]
                if len(held) != len(set(held)) or len(held) != self.host.arena.num_live(kind):
                    raise IntegrityError(f"{kind}: L2 holds {self.host.arena.num_live(kind)} "
                                         f"blocks, the index names {len(held)}")

    # =============================================================== helpers
    def _touch(self, node: Node, priority: int, *, hit: bool) -> None:
        self._tick += 1
        self.index.touch(node, float(self._tick), priority, hit=hit, wall=time.monotonic())

def _cut(path: list[Segment], pages: int) -> list[Segment]:
    """The first ``pages`` pages of ``path``."""
    out, left = [], pages
    for seg in path:
        if left <= 0:
            break
        out.append(Segment(seg.node, min(seg.pages, left)))
        left -= seg.pages
    return out


def _padded(ids: torch.Tensor | None, n_pages: int) -> list[int]:
    """Per-page ids for pages ``[0, n_pages)``; given ids cover the trailing pages."""
    if ids is None:
        return [-1] * n_pages
    return [-1] * (n_pages - len(ids)) + [int(i) for i in ids]
