"""One `RouteQuery` through every layer: in process, over shards, over the gRPC API.

A tenant's route (its fair-share term) and a host-tier promotion must come out
the same whichever layer answers: the sharded router weighs the tenant's share
from the shards' merged counts, and the gRPC API carries the tenant in and the
pages to promote out.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from api_kit import Loop, Served

from kvmesh.client.routing_client import RoutedTo, RoutingClient
from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.service import Coordinator
from kvmesh.coordinator.shards import ShardedCoordinator, shard_of
from kvmesh.errors import ConfigError, InvalidInput, NoWorkers
from kvmesh.events import PagesStored, encode_batch, make_batch
from kvmesh.load import WorkerLoad
from kvmesh.requests import ReportMark, RouteOutcome
from kvmesh.tenants import tenant_of
from kvmesh.types import PageHash, WorkerId

QUIET, NOISY = tenant_of("quiet-salt"), tenant_of("noisy-salt")
PAGE = 16


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def pages(tag: str, n: int) -> tuple[PageHash, ...]:
    return tuple(PageHash(f"{tag}-{i}".encode().ljust(16, b".")) for i in range(n))


def two_shard_workers() -> tuple[WorkerId, WorkerId]:
    """Two worker ids that two shards place apart, so a route must merge both shards."""
    ids = [WorkerId(f"w{i}") for i in range(20)]
    first = ids[0]
    other = next(w for w in ids if shard_of(w, 2) != shard_of(first, 2))
    return first, other


def crowded(core: Any, quiet_on: WorkerId, noisy_on: WorkerId) -> Any:
    """The noisy tenant holds 9 of the cluster's 10 pages, all on `noisy_on`, which also has
    two pages of prefill queued: without the share term a new prompt goes to `quiet_on`."""
    for wid in (quiet_on, noisy_on):
        core.register_worker(WorkerRegistration(wid, f"10.0.0.{len(wid)}:1", 100, "i"))
    for wid, tag, n, tenant in ((noisy_on, "n", 9, NOISY), (quiet_on, "q", 1, QUIET)):
        stored = PagesStored(pages(tag, n), None, (), PAGE, None, "gpu", tenant)
        core.report(WorkerReport(wid, [encode_batch(make_batch([stored], wid, "i", 0))]))
    core.report(
        WorkerReport(noisy_on, [], WorkerLoad(noisy_on, 2 * PAGE, free_pages=100, total_pages=100))
    )
    return core


def decisions(route: Any) -> list[tuple[str, int, float]]:
    new = pages("fresh", 3)
    out = []
    for tenant in (NOISY, QUIET, None):
        d = route(RouteQuery(new, 3 * PAGE, page_size=PAGE, tenant=tenant))
        held = d.matched_pages if isinstance(d, RoutedTo) else d.local_pages
        out.append((d.worker_id, held, round(d.cost, 9)))
    return out


def test_a_tenants_route_is_the_same_in_process_over_shards_and_over_grpc(loop: Loop) -> None:
    quiet_on, noisy_on = two_shard_workers()
    config = CoordinatorConfig(tenant_share_weight=2.0)
    single = crowded(Coordinator(config, rng=random.Random(0)), quiet_on, noisy_on)
    want = decisions(single.route)
    # the noisy tenant is over its share: it goes where it crowds; the others by load
    assert [w for w, _, _ in want] == [noisy_on, quiet_on, quiet_on]

    sharded_config = replace(config, index_shards=2)
    sharded = crowded(ShardedCoordinator(sharded_config, rng=random.Random(0)), quiet_on, noisy_on)
    assert decisions(sharded.route) == want

    for core in (
        crowded(Coordinator(config, rng=random.Random(0)), quiet_on, noisy_on),
        crowded(ShardedCoordinator(sharded_config, rng=random.Random(0)), quiet_on, noisy_on),
    ):
        served = Served(loop, core, TransferConfig())
        try:
            with RoutingClient(served.address) as client:
                got = decisions(lambda q: client.route(q))
        finally:
            served.stop()
        assert got == want


def test_without_the_share_term_a_tenant_routes_as_any_request() -> None:
    quiet_on, noisy_on = two_shard_workers()
    off = crowded(Coordinator(CoordinatorConfig(), rng=random.Random(0)), quiet_on, noisy_on)
    assert [w for w, _, _ in decisions(off.route)] == [quiet_on] * 3


def test_the_grpc_route_names_the_pages_to_promote_and_echoes_the_request_id(loop: Loop) -> None:
    core = Coordinator(CoordinatorConfig(host_hit_cost=0.25), rng=random.Random(0))
    wid = WorkerId("host-holder")
    core.register_worker(WorkerRegistration(wid, "10.0.0.9:1", 100, "i"))
    prompt = pages("p", 5)
    stored = PagesStored(prompt, None, (), PAGE, None, "cpu", None)
    core.report(WorkerReport(wid, [encode_batch(make_batch([stored], wid, "i", 0))]))
    query = RouteQuery(prompt, 5 * PAGE + 1, page_size=PAGE, request_id="req-7")
    want = core.route(replace(query, request_id=""))
    assert want.promote_pages == 5
    served = Served(loop, core, TransferConfig())
    try:
        with RoutingClient(served.address) as client:
            got = client.route(query)
    finally:
        served.stop()
    assert (got.worker_id, got.matched_pages, got.promote_pages) == (wid, 5, 5)
    assert got.request_id == "req-7"


def test_a_report_mark_travels_the_grpc_api_and_an_applied_one_does_not_hold_the_route(
    loop: Loop,
) -> None:
    core = Coordinator(CoordinatorConfig(), rng=random.Random(0))
    wid = WorkerId("w0")
    core.register_worker(WorkerRegistration(wid, "10.0.0.1:1", 100, "i"))
    prompt = pages("m", 3)
    core.report(
        WorkerReport(
            wid, [encode_batch(make_batch([PagesStored(prompt, None, (), PAGE)], wid, "i", 0))]
        )
    )
    assert core.reported([ReportMark(wid, "i", 0)])
    assert not core.reported([ReportMark(wid, "i", 1)])  # not sent yet
    assert core.reported([ReportMark(wid, "old", 9)])  # another start's: nothing to wait for
    assert core.reported([ReportMark(WorkerId("gone"), "i", 3)])  # not registered
    served = Served(loop, core, TransferConfig())
    try:
        with RoutingClient(served.address) as client:
            query = RouteQuery(prompt, 3 * PAGE + 1, page_size=PAGE)
            got = client.route(replace(query, after=(ReportMark(wid, "i", 0),)))
            assert got.matched_pages == 3
            with pytest.raises(InvalidInput, match="report mark incarnation"):
                ReportMark(wid, "", 0)
    finally:
        served.stop()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"page_size": 0}, "page_size must be positive"),
        ({"page_size": True}, "page_size must be an int"),
        ({"role": "janitor"}, "role must be one of"),
        ({"policy": ""}, "policy must be 1-256"),
        ({"request_id": "x" * 257}, "request_id must be 1-256"),
        ({"tenant": ""}, "tenant must be 1-256"),
        ({"after": ("w0",)}, "after must hold ReportMarks"),
    ],
)
def test_a_bad_route_query_is_refused_naming_its_field(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        RouteQuery(**{"hashes": pages("b", 1), "num_tokens": PAGE, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"worker_id": ""}, "worker_id must be 1-256"),
        ({"address": 5}, "address must be a string"),
        ({"capacity": -1}, "capacity"),
        ({"capacity": 2.5}, "capacity"),
        ({"incarnation": ""}, "incarnation must be 1-256"),
        ({"role": "boss"}, "role must be one of"),
        ({"actor_name": ""}, "actor_name must be 1-256"),
    ],
)
def test_a_bad_registration_is_refused_naming_its_field(
    fields: dict[str, Any], message: str
) -> None:
    base = {"worker_id": "w0", "address": "h:1", "capacity": 8, "incarnation": "i"}
    with pytest.raises(InvalidInput, match=message):
        WorkerRegistration(**{**base, **fields})


def test_objects_that_skipped_their_constructor_are_checked_where_they_land() -> None:
    """Ray unpickles arguments without running `__post_init__`: the coordinator checks
    them again, and a refused registration changes nothing."""
    coord = Coordinator(CoordinatorConfig())
    reg = pickle.loads(pickle.dumps(WorkerRegistration(WorkerId("w0"), "h:1", 8, "i")))
    object.__setattr__(reg, "capacity", -3)
    with pytest.raises(InvalidInput, match="capacity"):
        coord.register_worker(reg)
    assert coord.workers() == []
    query = RouteQuery(pages("c", 1), PAGE)
    object.__setattr__(query, "page_size", 0)
    with pytest.raises(InvalidInput, match="page_size"):
        query.check()
    with pytest.raises(ConfigError, match="known"):
        coord.route(RouteQuery(pages("c", 1), PAGE, policy="fastest"))


def test_a_query_keeps_its_hashes_as_a_tuple() -> None:
    hashes = list(pages("t", 2))
    query = RouteQuery(hashes, 2 * PAGE)
    hashes.append(PageHash(b"later"))
    assert query.hashes == pages("t", 2)


def halves_cluster(core: Any) -> Any:
    """A prefill worker holding prefix "a", a decode worker, and a busy worker of both roles."""
    for wid, role, tag in (("pre", "prefill", "a"), ("dec", "decode", "b"), ("any", "both", "c")):
        core.register_worker(
            WorkerRegistration(WorkerId(wid), f"10.1.0.{len(tag)}:1", 100, "i", role)
        )
        stored = PagesStored(pages(tag, 4), None, (), PAGE)
        core.report(
            WorkerReport(WorkerId(wid), [encode_batch(make_batch([stored], WorkerId(wid), "i", 0))])
        )
    core.report(
        WorkerReport(WorkerId("any"), [], WorkerLoad(WorkerId("any"), 8 * PAGE, 0, 100, 100))
    )
    return core


def test_a_split_query_answers_both_halves_of_a_disaggregated_request_in_one_call(
    loop: Loop,
) -> None:
    query = RouteQuery(pages("a", 4), 4 * PAGE + 1, page_size=PAGE, split=True)
    single = halves_cluster(Coordinator(CoordinatorConfig(), rng=random.Random(0)))
    d = single.route(query)
    assert d.decode is not None
    assert (d.worker_id, d.local_pages, d.decode.worker_id, d.decode.local_pages) == (
        "pre",
        4,
        "dec",
        0,
    )
    prefill, decode = query.halves()
    assert (prefill.role, decode.role, prefill.split) == ("prefill", "decode", False)
    assert single.route(prefill).worker_id == d.worker_id
    sharded = halves_cluster(
        ShardedCoordinator(CoordinatorConfig(index_shards=2), rng=random.Random(0))
    )
    assert sharded.route(query) == d
    served = Served(loop, single, TransferConfig())
    try:
        with RoutingClient(served.address) as client:
            got = client.route(query)
    finally:
        served.stop()
    assert got.decode is not None
    assert (got.worker_id, got.matched_pages, got.decode.worker_id) == ("pre", 4, "dec")
    assert got.decode.worker_address == "10.1.0.1:1"
    with pytest.raises(InvalidInput, match="split query asks for both roles"):
        replace(query, role="decode")


def test_a_report_over_grpc_carries_the_requests_outcomes(loop: Loop) -> None:
    core = Coordinator(CoordinatorConfig(), rng=random.Random(0))
    wid = WorkerId("engine-a")
    served = Served(loop, core, TransferConfig())
    try:
        with RoutingClient(served.address) as client:
            client.register(WorkerRegistration(wid, "http://engine-a:8000", 100, "boot"))
            batch = encode_batch(
                make_batch([PagesStored(pages("o", 2), None, (), PAGE)], wid, "boot", 0)
            )
            kept, missed = RouteOutcome(2, 0, 2, 0), RouteOutcome(2, 0, 1, 0)
            resync, results = client.report(WorkerReport(wid, [batch], None, [kept, missed]))
    finally:
        served.stop()
    assert (resync, results) == (False, ["applied"])
    stats = core.stats()
    assert (stats.results_recorded, stats.mismatches) == (2, 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"worker_id": ""}, "worker_id must be 1-256"),
        ({"batches": ["not bytes"]}, "an event batch must be bytes"),
        ({"load": {"free_pages": 3}}, "load must be a WorkerLoad"),
        ({"outcomes": [(1, 0, 1, 0)]}, "outcomes must be RouteOutcomes"),
    ],
)
def test_a_bad_report_is_refused_naming_its_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        WorkerReport(**{"worker_id": "w0", **fields})


def test_a_route_refused_over_grpc_is_raised_with_its_request_id(loop: Loop) -> None:
    served = Served(loop, Coordinator(CoordinatorConfig()), TransferConfig())
    try:
        with RoutingClient(served.address) as client, pytest.raises(NoWorkers) as refused:
            client.route(RouteQuery(pages("r", 2), 2 * PAGE, request_id="req-grpc-9"))
    finally:
        served.stop()
    assert refused.value.request_id == "req-grpc-9"
    assert "no worker" in str(refused.value).lower()
