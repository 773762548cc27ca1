"""The worker actor's wiring, in one process: real pools, models, gRPC servers and coordinator.

`WorkerActor` is a plain class; given a plain `Coordinator` (not a Ray
handle) it calls it directly, so these tests exercise the event protocol
(ordered batches, resend, snapshot on resync), pulls, pushes and draining
without Ray. Heartbeats are made rare so that only explicit flushes report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from worker_kit import (
    BASE,
    HASHER,
    Prompts,
    check_pull_from_nowhere_computes,
    check_push_then_decode,
    two_workers,
)

from kvmesh.config import TransferConfig
from kvmesh.coordination import WorkerRegistration, WorkerReport
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import ConfigError, InvalidInput, RequestExpired, TransportError
from kvmesh.events import decode_batch
from kvmesh.requests import RouteOutcome, WorkerSpec
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.grpc_wire import WireChannel
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.peers import GrpcPeer
from kvmesh.worker.transfer_client import SyncPeerClient

CONFIG = BASE
_prompts = Prompts(7)
prompt, request = _prompts.prompt, _prompts.request


class Link:
    """The coordinator as a worker sees it: forwards to `target`, records and can fail reports."""

    def __init__(self, target: Coordinator) -> None:
        self.target = target
        self.batches: list[bytes] = []
        self.outcomes: list[RouteOutcome] = []
        self.fail_next = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def report(self, report: WorkerReport) -> Any:
        if self.fail_next:
            self.fail_next -= 1
            raise TransportError("injected: the coordinator is unreachable")
        self.batches.extend(report.batches)
        self.outcomes.extend(report.outcomes)
        return self.target.report(report)


@pytest.fixture()
def link() -> Link:
    return Link(Coordinator(CONFIG.coordinator))


@pytest.fixture()
def workers(link: Link) -> Iterator[list[WorkerActor]]:
    with two_workers(CONFIG, link) as made:
        yield made


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG.model)


def index_equals_pool(coordinator: Coordinator, worker: WorkerActor) -> bool:
    return coordinator.index.worker_pages(worker.worker_id) == frozenset(
        worker.pool.cached_hashes()
    )


def test_a_served_prompt_is_in_the_index_when_generate_returns(
    link: Link, workers: list[WorkerActor], model: TinyTransformer
) -> None:
    w0 = workers[0]
    tokens = prompt(4)
    result = w0.generate(request(tokens, 5))
    assert list(result.tokens) == model.generate(list(tokens), 5)
    hashes = HASHER.hash_prompt(tokens)
    assert link.target.match(hashes).pages == {"w0": 4}
    assert index_equals_pool(link.target, w0)


def test_batches_carry_one_incarnation_and_consecutive_seqs_starting_with_a_snapshot(
    link: Link, workers: list[WorkerActor]
) -> None:
    w0 = workers[0]
    for _ in range(3):
        w0.generate(request(prompt(2)))
    mine = [decode_batch(b) for b in link.batches if decode_batch(b).worker_id == "w0"]
    assert mine[0].snapshot
    assert [b.seq for b in mine] == list(range(len(mine)))
    assert {b.incarnation for b in mine} == {w0.incarnation}
    assert len(mine) >= 4


def test_a_failed_report_is_resent_and_the_index_catches_up(
    link: Link, workers: list[WorkerActor]
) -> None:
    w0 = workers[0]
    link.fail_next = 1
    tokens = prompt(3)
    w0.generate(request(tokens))  # its report fails: the batch stays queued
    assert link.target.match(HASHER.hash_prompt(tokens)).pages == {}
    assert w0.flush()  # resent, in order
    assert link.target.match(HASHER.hash_prompt(tokens)).pages == {"w0": 3}
    assert index_equals_pool(link.target, w0)
    assert link.target.stats().batches_stale == 0


def test_a_restarted_coordinator_gets_registration_and_a_snapshot(
    link: Link, workers: list[WorkerActor]
) -> None:
    w0 = workers[0]
    tokens = prompt(3)
    w0.generate(request(tokens))
    link.target = Coordinator(CONFIG.coordinator)  # state lost, as after a restart
    assert not w0.flush()  # UnknownWorker: registers again
    assert w0.flush()  # then sends its whole cached set
    assert link.target.match(HASHER.hash_prompt(tokens)).pages == {"w0": 3}
    assert index_equals_pool(link.target, w0)


def test_snapshot_rebuilds_an_index_that_lost_the_worker(
    link: Link, workers: list[WorkerActor]
) -> None:
    w0 = workers[0]
    w0.generate(request(prompt(5)))
    fresh = Coordinator(CONFIG.coordinator)
    fresh.register_worker(WorkerRegistration(WorkerId("w0"), w0.address, 63, w0.incarnation))
    result = fresh.rebuild_from_snapshots({WorkerId("w0"): w0.snapshot()})
    assert not result.failed
    assert index_equals_pool(fresh, w0)


def test_a_worker_pulls_the_pages_a_named_peer_holds_over_grpc(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    w0, w1 = workers
    shared = prompt(6)
    w0.generate(request(shared))
    tokens = shared + tuple(prompt(1))
    result = w1.generate(request(tokens, 4, promised_pull=6, peer_address=w0.address))
    assert (result.pages_pulled, result.pages_hit_local, result.pull_error) == (6, 0, None)
    assert list(result.tokens) == model.generate(list(tokens), 4)
    assert (w1.stats().pages_pulled, w1.stats().pulls_grpc) == (6, 1)


def test_a_pull_lands_in_place_over_the_one_fetch_engine_on_a_kept_connection(
    monkeypatch: pytest.MonkeyPatch, link: Link, model: TinyTransformer
) -> None:
    calls: list[str] = []
    real_call = WireChannel.call

    def call(self: WireChannel, *args: Any, **kwargs: Any) -> None:
        calls.append(self.address)
        real_call(self, *args, **kwargs)

    monkeypatch.setattr(WireChannel, "call", call)
    with two_workers(CONFIG, link) as (w0, w1):
        shared = prompt(6)
        w0.generate(request(shared))
        tokens = shared + tuple(prompt(1))
        result = w1.generate(request(tokens, 4, promised_pull=6, peer_address=w0.address))
        assert (result.pages_pulled, result.pull_error) == (6, None)
        assert list(result.tokens) == model.generate(list(tokens), 4)
        peer = w1.peers.get(w0.address)
        assert isinstance(peer, GrpcPeer)
        assert calls and set(calls) <= {w0.address}
        assert w1.stats().pulls_grpc == 1


def test_a_pull_from_an_unreachable_peer_computes_instead(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    check_pull_from_nowhere_computes(workers[1], _prompts, model)


def test_prefill_pushes_the_prompt_pages_and_the_decode_worker_continues_from_them(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    check_push_then_decode(*workers, _prompts, model)
    assert workers[0].stats().pushes_grpc == 1


def test_a_failed_push_is_reported_not_raised(workers: list[WorkerActor]) -> None:
    done = workers[0].prefill(request(prompt(2)), "127.0.0.1:1", b"\x00" * 16)
    assert done.pages_pushed == 0
    assert done.push_error is not None


def test_a_push_under_another_requests_ticket_or_a_used_one_is_refused(
    workers: list[WorkerActor],
) -> None:
    prefill, decode = workers
    mine, other = request(prompt(3)), request(prompt(3))
    before = decode.pool.cached_hashes()
    wrong = prefill.prefill(mine, decode.address, decode.expect_push(other))
    assert wrong.pages_pushed == 0 and "HashMismatch" in (wrong.push_error or "")
    ticket = decode.expect_push(mine)
    assert prefill.prefill(mine, decode.address, ticket).push_error is None
    again = prefill.prefill(request(prompt(3)), decode.address, ticket)  # one use only
    assert again.pages_pushed == 0 and "PermissionDenied" in (again.push_error or "")
    assert decode.pool.cached_hashes() - before == set(decode.hasher.hash_prompt(mine.token_ids))


def test_drain_marks_the_worker_draining_and_not_serving(
    link: Link, workers: list[WorkerActor]
) -> None:
    w0 = workers[0]
    assert w0.drain(timeout_s=5)
    assert link.target.registry_info(WorkerId("w0")).draining
    with SyncPeerClient(w0.address, CONFIG.transfer) as client:
        assert client.health() == "NOT_SERVING"
    assert w0.stats().draining


def test_reset_cache_empties_the_pool_and_the_index(link: Link, workers: list[WorkerActor]) -> None:
    w0 = workers[0]
    w0.generate(request(prompt(3)))
    w0.reset_cache()
    assert w0.pool.cached_hashes() == set()
    assert link.target.index.worker_pages(WorkerId("w0")) == frozenset()
    assert w0.stats().requests == 0


def test_stats_count_requests_and_pages(workers: list[WorkerActor]) -> None:
    w1 = workers[1]
    tokens = prompt(2)
    w1.generate(request(tokens))
    w1.generate(request(tokens))
    stats = w1.stats()
    assert stats.requests == 2
    assert (stats.pages_hit_local, stats.pages_computed, stats.prompt_pages) == (2, 4, 6)
    assert stats.page_hit_ratio == pytest.approx(2 / 6)
    assert stats.cached_pages == 2


def test_a_worker_refuses_to_bind_beyond_loopback_unless_asked(link: Link) -> None:
    remote = dataclasses.replace(CONFIG, transfer=TransferConfig(host="0.0.0.0"))
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0"):
        WorkerActor(WorkerSpec(WorkerId("exposed"), remote), link)


def test_a_request_past_its_deadline_is_stopped_counted_and_holds_nothing(
    workers: list[WorkerActor],
) -> None:
    w0 = workers[0]
    before = w0.stats()
    late = dataclasses.replace(request(prompt(3)), timeout_s=1e-9)  # over before it starts
    with pytest.raises(RequestExpired, match="passed its deadline before it started"):
        w0.generate(late)
    after = w0.stats()
    assert after.requests_cancelled == before.requests_cancelled + 1
    assert (after.requests, after.errors) == (before.requests, before.errors)
    assert (after.pages_used, after.cached_pages) == (0, before.cached_pages)
    w0.check_invariants()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timeout_s": -1.0}, "timeout_s must be a positive"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive"),
        ({"timeout_s": "5"}, "timeout_s must be a positive"),
        ({"caller_job": 7}, "caller_job must be"),
    ],
)
def test_a_bad_deadline_or_caller_is_refused_before_any_work(
    workers: list[WorkerActor], change: dict[str, Any], message: str
) -> None:
    w0 = workers[0]
    with pytest.raises(InvalidInput, match=message):
        w0.generate(dataclasses.replace(request(prompt(2)), **change))
    assert w0.stats().pages_used == 0 and w0.pool.cached_hashes() == set()
