"""``kv_mesh``: one cost for route, pull through the mesh and recomputation.

The index is fed as the engines' events would feed it; the router is the
gateway's (`make_router`), the policy the coordinator's `kv_aware`.
"""

from __future__ import annotations

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.events import PagesStored, make_batch
from kvmesh.gateway.routing import POLICY_NAMES, make_router
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId

BLOCK = 32
A, B = WorkerId("engine-a"), WorkerId("engine-b")
HASHES = [PageHash(bytes([i]) * 8) for i in range(1, 21)]  # a 20-block prompt


def index_holding(engine: WorkerId, blocks: int) -> GlobalIndex:
    index = GlobalIndex()
    stored = PagesStored(tuple(HASHES[:blocks]), None, (), BLOCK)
    index.apply(make_batch([stored], engine, "engine", 0))
    index.apply(make_batch([], B if engine == A else A, "engine", 0))
    return index


def request() -> RouteRequest:
    return RouteRequest(HASHES, len(HASHES) * BLOCK + 5, page_size=BLOCK)


def busy(engine: WorkerId, queued_tokens: int) -> list[WorkerLoad]:
    other = B if engine == A else A
    return [WorkerLoad(engine, active_prefill_tokens=queued_tokens), WorkerLoad(other)]


def test_kv_mesh_is_a_gateway_policy() -> None:
    assert "kv_mesh" in POLICY_NAMES


def test_a_busy_engine_holding_the_prefix_loses_to_an_idle_one_that_pulls_it() -> None:
    index = index_holding(A, 20)
    config = CoordinatorConfig()
    loads = busy(A, queued_tokens=12 * BLOCK)  # A has 12 blocks of prefill queued
    mesh = make_router("kv_mesh", index, config).route(request(), loads, b"k")
    assert (mesh.worker_id, mesh.local_pages, mesh.peer_id, mesh.peer_pages) == (B, 0, A, 20)
    assert mesh.policy == "kv_mesh"
    # without the mesh the same state keeps the request queued behind the holder
    plain = make_router("kv_aware", index, config).route(request(), loads, b"k")
    assert plain.worker_id == A


def test_an_idle_holder_keeps_its_prefix_and_nothing_is_pulled() -> None:
    index = index_holding(A, 20)
    decision = make_router("kv_mesh", index, CoordinatorConfig()).route(
        request(), busy(A, 0), b"k"
    )
    assert (decision.worker_id, decision.local_pages) == (A, 20)
