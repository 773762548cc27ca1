"""`--shared-prefix-blocks`: conversations placed where fewer blocks were computed (the
opt-in before `kv_aware`'s `conversations` placement, test_conversations.py).

Every prompt of the benchmark's trace starts with the service's system
block. Holding only that is no affinity: kv_aware with no load term sends
every new conversation to the engine that first cached it (the whole run on
one engine, docs/engines.md). With the placement, a request no engine holds
more of goes to the engine that has computed the fewest prompt blocks; a
follow-up whose prefix an engine holds is left to kv_aware's cost.
"""

from __future__ import annotations

import pytest

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.errors import ConfigError
from kvmesh.events import PagesStored, make_batch
from kvmesh.gateway.config import EngineTarget, GatewayConfig
from kvmesh.gateway.routing import BalancedPlacement, IndexRouter, Router, make_router
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId

A, B = WorkerId("engine-0"), WorkerId("engine-1")
SYSTEM = 0  # the block every prompt starts with


def h(*xs: int) -> list[PageHash]:
    return [PageHash(x.to_bytes(8, "big")) for x in xs]


def request(*blocks: int) -> RouteRequest:
    return RouteRequest(h(*blocks), len(blocks) * 32 + 5, page_size=32)


class Engines:
    """An index fed as the engines' events would feed it: what each routed request stored."""

    def __init__(self) -> None:
        self.index = GlobalIndex()
        self._seq = {A: -1, B: -1}

    def store(self, engine: WorkerId, hashes: list[PageHash]) -> None:
        self._seq[engine] += 1
        batch = make_batch(
            [PagesStored(tuple(hashes), None, (), 32)], engine, "e", self._seq[engine]
        )
        self.index.apply(batch)

    def serve(self, router: Router, req: RouteRequest, loads: list[WorkerLoad]) -> WorkerId:
        engine = router.route(req, loads, bytes(req.hashes[-1])).worker_id
        self.store(engine, list(req.hashes))
        return engine


def conversations(router: Router, engines: Engines, n: int, first: int = 0) -> list[WorkerId]:
    """`n` new conversations (numbered from `first`), each a first turn of two blocks after
    the system block; returns where each went."""
    loads = [WorkerLoad(A), WorkerLoad(B)]
    return [
        engines.serve(router, request(SYSTEM, 1000 + c, 2000 + c), loads)
        for c in range(first, first + n)
    ]


def test_without_a_load_term_kv_aware_sends_every_new_conversation_to_the_system_blocks_engine() -> (
    None
):
    engines = Engines()
    config = CoordinatorConfig(queue_weight=0.0)
    router = make_router("kv_aware", engines.index, config, placement="cost")
    assert len(set(conversations(router, engines, 8))) == 1


def test_new_conversations_go_where_fewer_blocks_were_computed() -> None:
    engines = Engines()
    router = IndexRouter(engines.index, "kv_aware", CoordinatorConfig(queue_weight=0.0), 1)
    placed = conversations(router, engines, 8)
    assert placed.count(A) == placed.count(B) == 4
    long_one = engines.serve(
        router, request(SYSTEM, *range(300, 320)), [WorkerLoad(A), WorkerLoad(B)]
    )
    other = B if long_one == A else A
    assert router.placement is not None
    assert router.placement.computed[long_one] > router.placement.computed[other] + 4
    assert conversations(router, engines, 2, first=8) == [other, other]


def test_a_follow_up_stays_with_the_engine_holding_its_prefix_whatever_was_computed() -> None:
    engines = Engines()
    router = make_router(
        "kv_aware", engines.index, CoordinatorConfig(queue_weight=0.0), shared_prefix_blocks=1
    )
    loads = [WorkerLoad(A), WorkerLoad(B)]
    engines.store(A, h(SYSTEM, 7, 8, 9))
    engines.store(B, h(SYSTEM))
    for turn in range(4):  # A computes ever more, yet holds the conversation
        assert engines.serve(router, request(SYSTEM, 7, 8, 9, *range(20, 22 + turn)), loads) == A


def test_the_shared_blocks_count_as_no_affinity_and_a_stale_engines_blocks_as_none() -> None:
    placement = BalancedPlacement(shared_prefix_blocks=2)
    fresh = [WorkerLoad(A), WorkerLoad(B)]
    assert placement.places({A: 2, B: 0}, fresh)
    assert not placement.places({A: 3}, fresh)
    assert placement.places({A: 3}, [WorkerLoad(A, stale=True), WorkerLoad(B)])


def test_a_restarted_engine_takes_the_next_new_conversations() -> None:
    engines = Engines()
    router = make_router(
        "kv_aware", engines.index, CoordinatorConfig(queue_weight=0.0), shared_prefix_blocks=1
    )
    conversations(router, engines, 4)
    router.forget(B)
    engines.index.remove_worker(B)
    assert conversations(router, engines, 2, first=4) == [B, B]


def test_approx_prefix_places_by_the_same_rule_when_asked() -> None:
    config = CoordinatorConfig(queue_weight=0.0)
    router = make_router("approx_prefix", GlobalIndex(), config, 384, shared_prefix_blocks=1)
    loads = [WorkerLoad(A), WorkerLoad(B)]
    placed = [router.route(request(SYSTEM, 100 + c), loads, bytes([c])).worker_id for c in range(6)]
    assert placed.count(A) == placed.count(B) == 3


def test_bad_shared_prefix_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="shared_prefix_blocks must be >= 0"):
        make_router("kv_aware", GlobalIndex(), CoordinatorConfig(), shared_prefix_blocks=-1)
    with pytest.raises(ConfigError, match="not 'round_robin'"):
        make_router("round_robin", GlobalIndex(), CoordinatorConfig(), shared_prefix_blocks=1)
    with pytest.raises(ConfigError, match="shared_prefix_blocks must be >= 1"):
        BalancedPlacement(0)
    with pytest.raises(ConfigError, match="shared_prefix_blocks must be >= 0"):
        GatewayConfig((EngineTarget("e", "http://127.0.0.1:1"),), shared_prefix_blocks=-2)
