"""Blocks an engine is prefilling count as held: the next request with that prefix goes beside.

The engine's KV events name a prompt's blocks only after its prefill; a
router reading nothing else would place a second request with the same new
prefix by load alone, and two engines would compute and cache it.
"""

from __future__ import annotations

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.events import PagesStored, make_batch
from kvmesh.gateway.config import EngineTarget
from kvmesh.gateway.engines import EnginePool
from kvmesh.gateway.routing import make_router, with_prefilling
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId

A, B = WorkerId("engine-0"), WorkerId("engine-1")


def h(*xs: int) -> list[PageHash]:
    return [PageHash(x.to_bytes(8, "big")) for x in xs]


def test_a_prefilling_prompt_counts_its_common_prefix_only_and_never_lowers_an_overlap() -> None:
    got = with_prefilling({A: 3}, h(1, 2, 3, 4, 5), {A: [h(1, 2)], B: [h(1, 2, 9), h(1, 2, 3, 4)]})
    assert got == {A: 3, B: 4}
    assert with_prefilling({}, h(1, 2), {A: [h(7, 8)]}) == {}


def test_the_pool_lists_what_each_engine_prefills_until_its_prefill_is_done() -> None:
    pool = EnginePool([EngineTarget(str(A), "http://a"), EngineTarget(str(B), "http://b")])
    first = pool.begin(pool[A], 64, h(1, 2))
    second = pool.begin(pool[A], 32, h(1, 2, 3))
    pool.begin(pool[B], 0)  # no hashes: nothing to list
    assert pool.prefilling() == {A: [tuple(h(1, 2)), tuple(h(1, 2, 3))]}
    first.prefill_done()
    first.close()  # idempotent beside prefill_done
    assert pool.prefilling() == {A: [tuple(h(1, 2, 3))]}
    assert pool.prefilling(exclude={A}) == {}
    second.close()
    assert pool.prefilling() == {}
    assert pool[A].inflight_prefill_tokens == 0 and pool[A].inflight_requests == 0


def test_kv_aware_sends_a_request_beside_the_engine_prefilling_its_prefix() -> None:
    index = GlobalIndex()
    index.apply(make_batch([PagesStored(tuple(h(50)), None, (), 32)], B, "b", 0))
    router = make_router("kv_aware", index, CoordinatorConfig(queue_weight=0.0))
    request = RouteRequest(h(1, 2, 3, 4), 4 * 32 + 5, page_size=32)
    loads = [WorkerLoad(A), WorkerLoad(B)]
    picks = {router.route(request, loads, bytes([k])).worker_id for k in range(16)}
    assert picks == {A, B}  # nothing held anywhere: ties split
    beside = {
        router.route(request, loads, bytes([k]), {B: [h(1, 2, 3)]}).worker_id for k in range(16)
    }
    assert beside == {B}
