"""Peers: one outcome per pull whatever the transport, and dist falling back to gRPC with its reason.

A real gRPC server on loopback holds the pages; the puller reaches it through
`Peers` over "grpc" or "dist". The dist links here cannot come up (no
coordinator, or a rendezvous the peer never joins), so every dist transfer
falls back; dist transfers that work are pinned in test_worker_links.py and
test_dist_transfer.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import REGISTRY
from worker_kit import proofs_for

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, PermissionDenied
from kvmesh.hashing import PageHasher
from kvmesh.rendezvous import DistRendezvous
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.dist_group import free_port
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.links import DistLinks, OpenRendezvous
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService, ProofBook
from kvmesh.worker.peers import TRANSPORTS, Peers, check_transport, transport_factory
from kvmesh.worker.transfer_server import ServerThread

PAGE = 4
SEED = "peers-test"
N = 12
CONFIG = TransferConfig(host="127.0.0.1", port=0, deadline_s=20, dist_connect_timeout_s=1.0)


def make_service() -> PageService:
    pool = PagePool(64, page_size=PAGE)
    store = KVStore(64, num_layers=2, num_kv_heads=2, head_dim=8, page_size=PAGE)
    return PageService(pool, store, PageHasher(PAGE, seed=SEED))


def tokens() -> list[int]:
    return [(7 + 3 * i) % 251 for i in range(N * PAGE)]


def proofs() -> ProofBook:
    return proofs_for(PageHasher(PAGE, seed=SEED), tokens())


def fill(service: PageService) -> list[PageHash]:
    """Cache N pages of seeded random KV under the real hash chain of `tokens()`."""
    hashes = service.hasher.hash_prompt(tokens())
    pool, store = service.pool, service.store
    pages = pool.get_new_pages(N)
    data = torch.randn((N, *store.page_shape), generator=torch.Generator().manual_seed(3))
    store.write_pages([p.page_id for p in pages], data.to(store.dtype))
    pool.cache_full_pages(pages, hashes, 0, N, tokens())
    pool.free_pages(list(reversed(pages)))
    service.take_events()
    return hashes


@pytest.fixture
def source() -> Iterator[tuple[str, PageService, list[PageHash]]]:
    service = make_service()
    hashes = fill(service)
    with ServerThread(service, CONFIG) as server:
        yield server.address, service, hashes


def same_bytes(a: PageService, b: PageService, hashes: list[PageHash]) -> bool:
    with a.pinned(hashes) as mine, b.pinned(hashes) as theirs:
        return all(
            x is not None
            and y is not None
            and torch.equal(a.store.read_page(x), b.store.read_page(y))
            for x, y in zip(mine, theirs, strict=True)
        )


def dist_peers(service: PageService, open_rendezvous: OpenRendezvous | None) -> Peers:
    transfer = _with_transport("dist")
    links = DistLinks(
        WorkerId("puller"), service, transfer, open_rendezvous=open_rendezvous, host="127.0.0.1"
    )
    return Peers(transfer, links=links)


def _with_transport(name: str) -> TransferConfig:
    return dataclasses.replace(CONFIG, transport=name)


def test_a_grpc_pull_lands_every_page_through_the_receiver_bit_exact(
    source: tuple[str, PageService, list[PageHash]],
) -> None:
    address, theirs, hashes = source
    mine = make_service()
    labels = {"worker": "w-grpc-pull", "direction": "pull", "transport": "grpc"}
    before = REGISTRY.get_sample_value("kvmesh_peer_transfers_total", labels) or 0.0
    peers = Peers(_with_transport("grpc"), worker="w-grpc-pull")
    try:
        outcome = peers.get(address).pull_into(mine.receiving(proofs()), hashes)
    finally:
        peers.close()
    assert (outcome.transport, outcome.inserted, outcome.error) == ("grpc", N, None)
    assert outcome.page_hashes == tuple(hashes)
    assert same_bytes(mine, theirs, hashes)
    assert peers.counts().pulls_grpc == 1  # read back from the named metric
    assert REGISTRY.get_sample_value("kvmesh_peer_transfers_total", labels) == before + 1
    assert mine.ref_counts() == [0] * 64


def test_a_pull_of_pages_the_receiver_cannot_prove_caches_none_and_says_why(
    source: tuple[str, PageService, list[PageHash]],
) -> None:
    address, _, hashes = source
    mine = make_service()
    peers = Peers(_with_transport("grpc"))
    try:
        outcome = peers.get(address).pull_into(mine.receiving(ProofBook({})), hashes)
    finally:
        peers.close()
    assert outcome.inserted == 0
    assert outcome.error is not None and "HashMismatch" in outcome.error
    assert mine.pool.cached_hashes() == set()


def test_a_pull_from_nowhere_is_an_outcome_with_its_error_not_a_raise() -> None:
    mine = make_service()
    peers = Peers(_with_transport("grpc"))
    try:
        outcome = peers.get(f"127.0.0.1:{free_port()}").pull_into(
            mine.receiving(proofs()), PageHasher(PAGE, seed=SEED).hash_prompt(tokens()), deadline_s=2
        )
    finally:
        peers.close()
    assert outcome.inserted == 0 and outcome.error is not None
    assert mine.pool.cached_hashes() == set()


def test_dist_falls_back_to_grpc_and_logs_why_when_the_rendezvous_fails(
    source: tuple[str, PageService, list[PageHash]], caplog: pytest.LogCaptureFixture
) -> None:
    address, theirs, hashes = source
    mine = make_service()

    def nobody_comes(_address: str) -> DistRendezvous:  # the serving rank never joins
        return DistRendezvous.for_workers(
            [WorkerId("puller"), WorkerId("server")], "127.0.0.1", free_port()
        )

    peers = dist_peers(mine, nobody_comes)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.worker.peers"):
            outcome = peers.get(address).pull_into(mine.receiving(proofs()), hashes)
    finally:
        peers.close()
    assert (outcome.transport, outcome.inserted, outcome.error) == ("grpc", N, None)
    assert outcome.fallback_reason is not None and "rendezvous" in outcome.fallback_reason
    assert any(
        "falling back to grpc" in r.getMessage() and "rendezvous" in r.getMessage()
        for r in caplog.records
    )
    assert same_bytes(mine, theirs, hashes)
    counts = peers.counts()
    assert (counts.pulls_dist, counts.pulls_grpc, counts.dist_fallbacks) == (0, 1, 1)
    assert mine.ref_counts() == [0] * 64


def test_dist_without_a_coordinator_falls_back_with_that_reason(
    source: tuple[str, PageService, list[PageHash]], caplog: pytest.LogCaptureFixture
) -> None:
    address, _, hashes = source
    mine = make_service()
    peers = dist_peers(mine, None)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.worker.peers"):
            outcome = peers.get(address).pull_into(mine.receiving(proofs()), hashes)
    finally:
        peers.close()
    assert (outcome.transport, outcome.inserted) == ("grpc", N)
    assert "no coordinator" in (outcome.fallback_reason or "")
    assert any("no coordinator" in r.getMessage() for r in caplog.records)


def test_a_dist_push_falls_back_to_grpc_and_is_still_refused_without_a_grant(
    source: tuple[str, PageService, list[PageHash]],
) -> None:
    address, _, _ = source
    pusher = make_service()
    hashes = fill(pusher)
    peers = dist_peers(pusher, None)
    try:
        with pytest.raises(PermissionDenied):
            peers.get(address).push(pusher, hashes, b"not a ticket")
    finally:
        peers.close()
    assert peers.counts().dist_fallbacks == 1
    assert pusher.ref_counts() == [0] * 64


def test_an_unknown_transport_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="choose one of"):
        transport_factory("carrier-pigeon")
    with pytest.raises(ConfigError, match="carrier-pigeon"):
        Peers(_with_transport("carrier-pigeon"))
    assert sorted(TRANSPORTS) == ["dist", "grpc"]


def test_torch_distributed_is_refused_under_the_production_profile() -> None:
    with pytest.raises(ConfigError, match="production profile needs transport='grpc'"):
        check_transport("dist", "production")
    check_transport("grpc", "production")
    check_transport("dist", "development")
