"""torch.distributed links between worker actors, in one process: real gloo groups, real pools.

The workers take `TransferConfig.transport="dist"`. A link is opened the way
the coordinator actor opens it (`CoordinatorActor.dist_link`): the core hands
out a rendezvous on a store hosted here (`host_link_store`) and the serving
worker is asked to join (`WorkerActor.dist_accept`); the puller joins too.
Both ends live in this process, each group its own object.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from worker_kit import (
    BASE,
    HASHER,
    Prompts,
    check_pull_from_nowhere_computes,
    check_push_then_decode,
    two_workers,
)

from kvmesh.config import (
    SecurityConfig,
    TransferConfig,
)
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import ConfigError, InvalidInput, TransportError, UnknownWorker
from kvmesh.rendezvous import DistRendezvous, LinkBook, host_link_store
from kvmesh.requests import WorkerSpec
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.model import TinyTransformer

pytestmark = pytest.mark.timeout(120)

CONFIG = dataclasses.replace(
    BASE,
    transfer=TransferConfig(transport="dist", dist_timeout_s=10.0, dist_connect_timeout_s=10.0),
)
_prompts = Prompts(11)
prompt, request = _prompts.prompt, _prompts.request


class LinkingCoordinator:
    """A plain `Coordinator` plus `dist_link` as the coordinator actor does it, in-process."""

    def __init__(self, core: Coordinator, book: LinkBook) -> None:
        self.core = core
        self.book = book
        self.workers: dict[WorkerId, WorkerActor] = {}
        self.refuse: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    def dist_link(self, client_id: WorkerId, server_address: str) -> DistRendezvous:
        if self.refuse:
            raise TransportError(self.refuse)
        rdv, server = self.core.open_link(self.book, client_id, server_address)
        self.workers[server.worker_id].dist_accept(rdv)
        return rdv


@pytest.fixture(scope="module")
def link_store() -> Iterator[tuple[Any, LinkBook]]:
    store, book = host_link_store("127.0.0.1")
    yield store, book


@pytest.fixture()
def coordinator(link_store: tuple[Any, LinkBook]) -> LinkingCoordinator:
    return LinkingCoordinator(Coordinator(CONFIG.coordinator), link_store[1])


@pytest.fixture()
def workers(coordinator: LinkingCoordinator) -> Iterator[list[WorkerActor]]:
    with two_workers(CONFIG, coordinator) as made:
        coordinator.workers = {w.worker_id: w for w in made}
        yield made


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG.model)


def test_a_pull_goes_over_a_link_the_coordinator_opened(
    workers: list[WorkerActor], coordinator: LinkingCoordinator, model: TinyTransformer
) -> None:
    w0, w1 = workers
    shared = prompt(6)
    w0.generate(request(shared))
    tokens = shared + prompt(1)
    result = w1.generate(request(tokens, 4, promised_pull=6, peer_address=w0.address))
    assert (result.pages_pulled, result.pages_hit_local, result.pull_error) == (6, 0, None)
    assert list(result.tokens) == model.generate(list(tokens), 4)
    s1 = w1.stats()
    assert (s1.pulls_dist, s1.pulls_grpc, s1.dist_fallbacks, s1.links_opened) == (1, 0, 0, 1)
    assert w0.stats().links_served == 1
    assert coordinator.core.stats().links_opened == 1
    # The pulled pages are w1's own now, announced like any other (6 pulled, 1 computed).
    assert coordinator.core.match(HASHER.hash_prompt(tokens)).pages[WorkerId("w1")] == 7


def test_a_second_pull_reuses_the_open_link(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    w0, w1 = workers
    for _ in range(2):
        shared = prompt(3)
        w0.generate(request(shared))
        tokens = shared + prompt(1)
        result = w1.generate(request(tokens, 2, promised_pull=3, peer_address=w0.address))
        assert result.pages_pulled == 3
        assert list(result.tokens) == model.generate(list(tokens), 2)
    assert (w1.stats().pulls_dist, w1.stats().links_opened) == (2, 1)


def test_a_push_goes_over_a_link_and_the_decode_worker_continues_from_it(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    prefill, decode = workers
    # The push returns after the decode worker acknowledged: the pages are there at once.
    check_push_then_decode(prefill, decode, _prompts, model)
    assert (prefill.stats().pushes_dist, prefill.stats().pushes_grpc) == (1, 0)


def test_a_link_that_cannot_be_opened_falls_back_to_grpc_and_says_why(
    workers: list[WorkerActor],
    coordinator: LinkingCoordinator,
    model: TinyTransformer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    w0, w1 = workers
    coordinator.refuse = "injected: no link today"
    shared = prompt(4)
    w0.generate(request(shared))
    tokens = shared + prompt(1)
    with caplog.at_level(logging.WARNING):
        result = w1.generate(request(tokens, 3, promised_pull=4, peer_address=w0.address))
    assert result.pages_pulled == 4
    assert result.pull_error is None
    assert list(result.tokens) == model.generate(list(tokens), 3)
    s1 = w1.stats()
    assert (s1.pulls_dist, s1.pulls_grpc, s1.dist_fallbacks) == (0, 1, 1)
    assert "falling back to grpc" in caplog.text
    assert "injected: no link today" in caplog.text


def test_a_failed_push_link_falls_back_to_grpc(
    workers: list[WorkerActor], coordinator: LinkingCoordinator
) -> None:
    prefill, decode = workers
    coordinator.refuse = "injected: no link today"
    tokens = prompt(3)
    ask = request(tokens)
    done = prefill.prefill(ask, decode.address, decode.expect_push(ask))  # not used up by dist
    assert (done.pages_pushed, done.push_error) == (3, None)
    stats = prefill.stats()
    assert (stats.pushes_dist, stats.pushes_grpc, stats.dist_fallbacks) == (0, 1, 1)
    assert HASHER.hash_prompt(tokens)[-1] in decode.pool.cached_hashes()


def test_a_push_under_a_ticket_nobody_granted_caches_nothing_and_the_link_takes_the_next(
    workers: list[WorkerActor],
) -> None:
    """Over a link the pushed bytes come whatever the ticket: the decode worker receives
    them, refuses every page (counted), and the same link carries the next, granted push."""
    prefill, decode = workers
    tokens = prompt(3)
    hashes = set(HASHER.hash_prompt(tokens))
    refused = REGISTRY.get_sample_value(
        "kvmesh_transfer_refused_total", {"worker": "w1", "reason": "no_grant"}
    )
    prefill.prefill(request(tokens), decode.address, b"\x00" * 16)
    assert not hashes & decode.pool.cached_hashes()
    after = REGISTRY.get_sample_value(
        "kvmesh_transfer_refused_total", {"worker": "w1", "reason": "no_grant"}
    )
    assert (after or 0) == (refused or 0) + 1
    ask = request(tokens)
    done = prefill.prefill(ask, decode.address, decode.expect_push(ask))
    assert (done.pages_pushed, done.push_error) == (3, None)
    assert hashes <= decode.pool.cached_hashes()
    stats = prefill.stats()
    assert (stats.pushes_dist, stats.pushes_grpc, stats.dist_fallbacks) == (2, 0, 0)
    assert stats.links_opened == 1


def test_a_broken_link_is_replaced_by_a_fresh_one(workers: list[WorkerActor]) -> None:
    w0, w1 = workers
    for round_ in range(2):
        shared = prompt(2)
        w0.generate(request(shared))
        result = w1.generate(
            request(shared + prompt(1), 2, promised_pull=2, peer_address=w0.address)
        )
        assert result.pages_pulled == 2
        if round_ == 0:
            link = w1.links.current(w0.address)
            assert link is not None
            link.group.mark_broken("injected: the link broke")
    s1 = w1.stats()
    assert (s1.pulls_dist, s1.links_opened) == (2, 2)


def test_a_pull_from_an_unknown_address_computes_instead(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    check_pull_from_nowhere_computes(workers[1], _prompts, model)  # dist, then gRPC, fail


def test_open_link_names_both_ends_and_refuses_unknown_ones(
    workers: list[WorkerActor], coordinator: LinkingCoordinator
) -> None:
    w0, w1 = workers
    rdv, server = coordinator.core.open_link(coordinator.book, w1.worker_id, w0.address)
    assert server.worker_id == "w0"
    assert (rdv.rank_of(WorkerId("w1")), rdv.rank_of(WorkerId("w0")), rdv.world_size) == (0, 1, 2)
    again, _ = coordinator.core.open_link(coordinator.book, w1.worker_id, w0.address)
    assert again.prefix != rdv.prefix  # a fresh epoch: never meets an older link's keys
    with pytest.raises(UnknownWorker, match="no registered worker serves"):
        coordinator.core.open_link(coordinator.book, w1.worker_id, "127.0.0.1:1")
    with pytest.raises(UnknownWorker):
        coordinator.core.open_link(coordinator.book, WorkerId("nobody"), w0.address)
    with pytest.raises(InvalidInput, match="itself"):
        coordinator.core.open_link(coordinator.book, w0.worker_id, w0.address)


def test_a_worker_refuses_a_link_it_would_not_serve(
    workers: list[WorkerActor], coordinator: LinkingCoordinator
) -> None:
    w0, w1 = workers
    rdv, _ = coordinator.core.open_link(coordinator.book, w1.worker_id, w0.address)
    with pytest.raises(InvalidInput, match="serving rank"):
        w1.dist_accept(rdv)  # w1 is the client end of this link
    grpc_only = WorkerActor(
        WorkerSpec(WorkerId("g"), dataclasses.replace(CONFIG, transfer=TransferConfig()))
    )
    try:
        with pytest.raises(ConfigError, match="gRPC only"):
            grpc_only.dist_accept(rdv)
    finally:
        grpc_only.shutdown()


def test_an_unknown_transport_or_dist_under_the_production_profile_is_refused() -> None:
    odd = dataclasses.replace(CONFIG, transfer=TransferConfig(transport="carrier-pigeon"))
    with pytest.raises(ConfigError, match="unknown transport"):
        WorkerActor(WorkerSpec(WorkerId("x"), odd))
    prod = dataclasses.replace(CONFIG, security=SecurityConfig(profile="production"))
    with pytest.raises(ConfigError, match="production"):
        WorkerActor(WorkerSpec(WorkerId("y"), prod))
