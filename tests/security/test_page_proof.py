"""The page-proof breaks of issue 12, reproduced: forged pushes poison nothing, pushers
cannot flush other tenants' pages.

Before the fix a `PushPages` with empty token ids under the real hashes of a
prompt (any bytes, a matching checksum) was cached and announced; the
coordinator routed the victim's prompt to that worker, which answered with
wrong tokens, and other workers pulled the forged pages and spread them. Now
a push needs the receiving worker's grant for the request routed to it, and
every page is proven against the receiver's own request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, PoolConfig, TransferConfig
from kvmesh.errors import PermissionDenied, PoolExhausted
from kvmesh.hashing import ExtraKeys, MultiModalInput, PageHasher
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import (
    EvictionBudget,
    IncomingPage,
    PageService,
    ProofBook,
)
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

PAGE = 16
CONFIG = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=128))
WIRE = TransferConfig(deadline_s=5.0, retries=0)


def forged_pages(hasher: PageHasher, tokens: list[int], keys: ExtraKeys) -> list[IncomingPage]:
    """Junk KV under a prompt's real hashes, with a matching checksum and no token ids."""
    shape = (CONFIG.model.num_layers, 2, PAGE, CONFIG.model.num_kv_heads, CONFIG.model.head_dim)
    junk = torch.full(shape, 7.0, dtype=torch.float32).numpy().tobytes()
    hashes = hasher.hash_prompt(tokens, keys)
    return [
        IncomingPage(h, hashes[i - 1] if i else None, (), PageBlob.from_bytes(junk, "float32", shape))
        for i, h in enumerate(hashes)
    ]


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_forged_push_is_refused_never_announced_routed_to_or_pulled(
    fresh_cluster: Callable[..., KVMesh],
) -> None:
    mesh = fresh_cluster(num_workers=2, config=CONFIG, num_cpus=3)
    model = TinyTransformer(CONFIG.model)
    hasher = PageHasher.from_config(CONFIG.hash)  # the attacker knows the (default) seed
    cases: list[tuple[list[int], ExtraKeys]] = [
        ([(3 * i + 1) % 256 for i in range(5 * PAGE + 3)], ExtraKeys()),
        ([(5 * i + 2) % 256 for i in range(5 * PAGE + 3)], ExtraKeys(cache_salt="victim")),
        (
            [(7 * i + 3) % 256 for i in range(5 * PAGE + 3)],
            ExtraKeys(mm_inputs=(MultiModalInput("image-1", 4, 20),)),
        ),
    ]
    for worker in mesh.workers():
        with SyncPeerClient(worker["address"], WIRE) as client:
            for tokens, keys in cases:
                pages = forged_pages(hasher, tokens, keys)
                with pytest.raises(PermissionDenied):
                    client.push_pages(pages, b"")
                with pytest.raises(PermissionDenied):
                    client.push_pages(pages, b"\x01" * 16)
                assert client.lookup([p.page_hash for p in pages]) == [False] * len(pages)
    mesh.set_policy("round_robin")  # every worker serves the victims: any poison would show
    for tokens, keys in cases:
        decision = mesh.route(tokens, cache_salt=keys.cache_salt)
        assert decision.local_pages == 0 and decision.peer_pages == 0
        if keys.mm_inputs:  # the client API takes no media; the refusal above is the test
            continue
        for _ in range(2):
            result = mesh.generate(tokens, max_tokens=6, cache_salt=keys.cache_salt)
            assert list(result.tokens) == model.generate(tokens, 6)


# ------------------------------------------------------------ eviction cap


def make_service(num_pages: int, budget: int) -> PageService:
    pool = PagePool(num_pages, page_size=4)
    store = KVStore(num_pages, 1, 2, 4, 4)
    hasher = PageHasher(4, seed="cap-seed")
    return PageService(pool, store, hasher, evictions=EvictionBudget(budget, 3600.0))


def cache_tenant(service: PageService, tokens: list[int], keys: ExtraKeys) -> list[PageHash]:
    hashes = service.hasher.hash_prompt(tokens, keys)
    pages = service.pool.get_new_pages(len(hashes))
    service.pool.cache_full_pages(pages, hashes, 0, len(hashes), tokens, keys.lora_id)
    service.pool.free_pages(list(reversed(pages)))
    return hashes


def junk_push(service: PageService, client: SyncPeerClient, n: int, salt: str) -> Any:
    """A cluster member pushing `n` pages of a request it got a grant for (unique prompt)."""
    tokens = [(11 * i) % 250 for i in range(4 * n)]
    keys = ExtraKeys(cache_salt=salt)
    hashes = service.hasher.hash_prompt(tokens, keys)
    ticket = service.grants.grant(ProofBook.for_pages(hashes, tokens, keys, 4))
    store = service.store
    blob = PageBlob.from_bytes(bytes(store.page_nbytes), store.dtype_name, store.page_shape)
    return client.push_pages([IncomingPage(h, None, (), blob) for h in hashes], ticket)


@pytest.mark.parametrize(("budget", "quiet_left"), [(8, 32), (64, 0)], ids=["capped", "uncapped"])
def test_junk_pushes_cannot_evict_another_tenants_pages_beyond_the_cap(
    budget: int, quiet_left: int
) -> None:
    service = make_service(num_pages=41, budget=budget)  # 40 usable pages
    quiet = cache_tenant(service, list(range(160)), ExtraKeys(cache_salt="quiet"))
    assert len(quiet) == 40
    with ServerThread(service, WIRE) as server, SyncPeerClient(server.address, WIRE) as client:
        refused = 0
        for round_ in range(6):
            try:
                junk_push(service, client, 8, f"noisy-{round_}")
            except PoolExhausted:
                refused += 1
    held = sum(service.lookup(quiet))
    if budget < 40:
        assert held == 40 - budget == quiet_left  # exactly the cap was spent, then refused
        assert refused == 5
    else:  # without a real cap (a budget as big as the pool) plain LRU flushes the tenant
        assert held == quiet_left
        assert refused == 0
    service.check_invariants()
