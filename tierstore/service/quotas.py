"""Per-tenant accounting of storage-API values, for tenants with a byte quota.

Each value a tenant stores is charged its length plus ``ENTRY_OVERHEAD`` (so a flood of tiny
values is bounded too), oldest write first. Over quota, the tenant's own oldest values are
named for deletion; another tenant's never are. The accounting counts what this service wrote
since it started: a value Redis evicted on its own stays charged until the tenant's own
writes push it out (its deletion is then a no-op).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

ENTRY_OVERHEAD = 64  # bytes charged per value on top of its length
# Packed token ids the page quota keeps per tenant (its records); past them an insert is
# refused like one over the page quota, so the accounting itself stays bounded.
RECORD_BYTES = 64 << 20


class ValueQuota:
    """Bytes held per tenant (only tenants that are charged), and their keys oldest first."""

    def __init__(self) -> None:
        self._keys: dict[str, OrderedDict[str, int]] = {}
        self._bytes: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """Bytes charged to ``tenant`` now."""
        return self._bytes.get(tenant, 0)

    def make_room(self, tenant: str, limit: int, keys: Sequence[str],
                  sizes: Sequence[int]) -> tuple[int, list[str]]:
        """How many of ``keys`` (from the first) fit ``limit`` once the tenant's oldest other
        values are gone, and those values' keys (the caller deletes them, then calls
        :meth:`charge`). Nothing changes here."""
        batch = set(keys)
        held = self._keys.get(tenant, OrderedDict())
        # Keys of the batch replace their old values: those bytes come back.
        free = limit - self.held(tenant) + sum(held.get(k, 0) for k in batch)
        fits, need = 0, 0
        for size in sizes:
            if need + size + ENTRY_OVERHEAD > limit:
                break
            need += size + ENTRY_OVERHEAD
            fits += 1
        victims: list[str] = []
        for key, charged in held.items():
            if free >= need:
                break
            if key not in batch:
                victims.append(key)
                free += charged
        while fits and need > free:  # only the batch's own keys were left to give back
            fits -= 1
            need -= sizes[fits] + ENTRY_OVERHEAD
        return fits, victims

    def charge(self, tenant: str, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Record values now held under ``keys`` (the newest)."""
        held = self._keys.setdefault(tenant, OrderedDict())
        total = self._bytes.get(tenant, 0)
        for key, size in zip(keys, sizes, strict=True):
            total += size + ENTRY_OVERHEAD - held.pop(key, 0)
            held[key] = size + ENTRY_OVERHEAD
        self._bytes[tenant] = total

    def forget(self, tenant: str, keys: Sequence[str]) -> None:
        """Values under ``keys`` are gone (deleted, refused, or evicted for room)."""
        held = self._keys.get(tenant)
        if held is None:
            return
        self._bytes[tenant] -= sum(held.pop(k, 0) for k in keys)
        if not held:
            del self._keys[tenant], self._bytes[tenant]

    def check_integrity(self) -> None:
        for tenant, held in self._keys.items():
            assert self._bytes[tenant] == sum(held.values()), f"{tenant}: totals disagree"


class PageQuota:
    """Prefix pages each tenant inserted that may still be cached: a record per insert that
    added pages (its scoped namespace, packed tokens and how many of its trailing pages it
    added), oldest first. Over quota the insert is refused (429): prefix pages are shared by
    every prompt extending them, so evicting a tenant's own oldest would also cut its newer
    prompts. :meth:`refresh` drops records whose pages the store no longer holds."""

    def __init__(self, record_bytes: int = RECORD_BYTES) -> None:
        self.record_bytes = record_bytes
        self._records: dict[str, OrderedDict[tuple[str, bytes], int]] = {}
        self._pages: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """Pages charged to ``tenant`` now."""
        return self._pages.get(tenant, 0)

    def fits(self, tenant: str, limit: int, pages: int, tokens_bytes: int) -> bool:
        """Whether ``pages`` more (of a prompt of ``tokens_bytes``) fit ``tenant``'s quota and
        its records' byte bound."""
        return self.held(tenant) + pages <= limit and \
            self._bytes.get(tenant, 0) + tokens_bytes <= self.record_bytes

    def add(self, tenant: str, namespace: str, tokens: bytes, new_pages: int) -> None:
        """Charge ``new_pages`` (the trailing pages of ``tokens`` the insert added)."""
        records = self._records.setdefault(tenant, OrderedDict())
        key = (namespace, tokens)
        old = records.pop(key, None)
        records[key] = (old or 0) + new_pages
        self._pages[tenant] = self._pages.get(tenant, 0) + new_pages
        if old is None:
            self._bytes[tenant] = self._bytes.get(tenant, 0) + len(tokens)

    def refresh(self, tenant: str, cached_pages: Callable[[str, bytes], int],
                page_bytes: int) -> None:
        """Recount ``tenant``'s records against the store: ``cached_pages(namespace,
        tokens)`` is how many leading pages of ``tokens`` some tier still holds; a record
        keeps only its added pages that are among them."""
        records = self._records.get(tenant)
        if not records:
            return
        total = 0
        for key in list(records):
            n_pages = len(key[1]) // page_bytes
            kept = max(0, min(records[key], cached_pages(*key) - (n_pages - records[key])))
            if kept:
                records[key] = kept
                total += kept
            else:
                del records[key]
                self._bytes[tenant] -= len(key[1])
        self._pages[tenant] = total
