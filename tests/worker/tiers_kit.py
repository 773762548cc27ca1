"""Real pools, KV stores and tiers for the tier tests: requests served page by page.

A page's KV is a function of its hash (`page_data`), so any page read back
from any tier can be compared bit for bit with what was written.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvmesh.events import KVEvent, PagesRemoved, PagesStored
from kvmesh.hashing import ExtraKeys, PageHasher, RequestHashes
from kvmesh.types import PageHash
from kvmesh.worker.cache_manager import KVCacheManager, Request
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.tiered_cache import TieredCache

PAGE_SIZE = 4


def make_store(num_pages: int, dtype: str = "float32") -> KVStore:
    """A small KV store: 2 layers, 1 KV head of 4 dims, pages of `PAGE_SIZE` tokens."""
    return KVStore(num_pages, 2, 1, 4, PAGE_SIZE, dtype)


def page_data(page_hash: PageHash, store: KVStore) -> torch.Tensor:
    """The KV a page of `page_hash` holds: random values seeded by the hash."""
    seed = int.from_bytes(hashlib.sha256(page_hash).digest()[:8], "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(store.page_shape, generator=gen).to(store.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


class TierRig:
    """A pool of `num_pages`, its KV store and tiers, and a manager serving requests."""

    def __init__(
        self,
        num_pages: int,
        *,
        dtype: str = "float32",
        disk_dir: Path | None = None,
        **tiers: Any,
    ) -> None:
        self.hasher = PageHasher(PAGE_SIZE)
        self.pool = PagePool(num_pages, page_size=PAGE_SIZE, medium="gpu")
        self.store = make_store(num_pages, dtype)
        if disk_dir is not None:
            tiers.setdefault("disk_dir", disk_dir)
            tiers.setdefault("disk_fsync", False)
        self.tiers = TieredCache(self.pool, self.store, **tiers)
        self.manager = KVCacheManager(self.pool, PAGE_SIZE, tiers=self.tiers)
        self._ids = itertools.count()
        self.hits: list[int] = []  # pages hit per request, in order

    def request(self, tokens: Sequence[int], salt: str | None = None) -> Request:
        keys = ExtraKeys(cache_salt=salt)
        return Request(f"r{next(self._ids)}", RequestHashes(self.hasher, tokens, keys))

    def serve(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Serve one prompt: hit (promoting), write the computed pages' KV, free. Returns
        the pages hit, after checking each hit page's bytes are the page's own."""
        req = self.request(tokens, salt)
        hit, n = self.manager.get_computed_pages(req)
        for page in hit:
            want = page_data(page.page_hash, self.store)  # type: ignore[arg-type]
            if not same_bits(self.store.read_page(page.page_id), want):
                raise AssertionError(f"page {page.page_hash.hex()[:12]} came back changed")  # type: ignore[union-attr]
        if self.manager.allocate_slots(req, len(tokens) - n, n, hit) is None:
            raise AssertionError("the pool could not hold the request")
        pages = self.manager.get_pages(req.request_id)
        full = req.page_hashes  # the last, partial page has no hash and is never cached
        for page, key in zip(pages[: len(full)], full, strict=True):
            if page not in hit:
                self.store.write_page(page.page_id, page_data(key, self.store))
        self.manager.free(req)
        self.hits.append(len(hit))
        return len(hit)


def prompt(seed: int, pages: int) -> list[int]:
    """`pages` full pages plus one token (so every page can be hit), distinct per seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages * PAGE_SIZE + 1,), generator=gen).tolist()


def replay_by_tier(events: Sequence[KVEvent], into: dict[str, set[PageHash]]) -> None:
    """Apply events per medium (what the coordinator's index keeps per worker)."""
    for ev in events:
        if isinstance(ev, PagesStored):
            into.setdefault(ev.medium or "gpu", set()).update(ev.page_hashes)
        elif isinstance(ev, PagesRemoved):
            into.setdefault(ev.medium or "gpu", set()).difference_update(ev.page_hashes)
        else:
            for held in into.values():
                held.clear()
