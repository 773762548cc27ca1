"""`kv_aware`'s default placement (`ConversationPlacement`): conversations stay on the engine
that holds them, new ones go where fewer blocks were stored lately, and no engine takes every
new conversation for holding a prompt they all start with."""

from __future__ import annotations

import pytest

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.errors import ConfigError
from kvmesh.events import AllPagesCleared, PagesRemoved, PagesStored, make_batch
from kvmesh.gateway.config import EngineTarget, GatewayConfig
from kvmesh.gateway.routing import (
    MOVE_PRICE,
    PARTED_WAYS,
    EngineWork,
    Held,
    IndexRouter,
    PrefixBranches,
    make_router,
    parting_depth,
)
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId

A, B = WorkerId("engine-0"), WorkerId("engine-1")
BLOCK = 32


def h(*xs: int) -> list[PageHash]:
    return [PageHash(x.to_bytes(8, "big")) for x in xs]


def request(*blocks: int) -> RouteRequest:
    return RouteRequest(h(*blocks), len(blocks) * BLOCK + 5, page_size=BLOCK)


class Engines:
    """An index fed as two vLLM engines' events feed it: each stores the blocks of a prompt it
    did not hold, chained to the block before them."""

    def __init__(self, index: GlobalIndex | None = None) -> None:
        self.index = index if index is not None else GlobalIndex()
        self._seq: dict[WorkerId, int] = {A: -1, B: -1}

    def publish(
        self, engine: WorkerId, *events: PagesStored | PagesRemoved | AllPagesCleared
    ) -> None:
        self._seq[engine] += 1
        self.index.apply(make_batch(list(events), engine, "e", self._seq[engine]))

    def store(self, engine: WorkerId, hashes: list[PageHash]) -> None:
        held = self.index.worker_pages(engine) if engine in self.index.workers() else frozenset()
        k = 0
        while k < len(hashes) and hashes[k] in held:
            k += 1
        if k < len(hashes):
            parent = hashes[k - 1] if k else None
            self.publish(engine, PagesStored(tuple(hashes[k:]), parent, (), BLOCK))

    def serve(self, router: IndexRouter, req: RouteRequest, loads: list[WorkerLoad]) -> WorkerId:
        engine = router.route(req, loads, bytes(req.hashes[-1])).worker_id
        self.store(engine, list(req.hashes))
        return engine


def idle() -> list[WorkerLoad]:
    return [WorkerLoad(A), WorkerLoad(B)]


def kv_aware(engines: Engines, config: CoordinatorConfig | None = None) -> IndexRouter:
    router = make_router("kv_aware", engines.index, config or CoordinatorConfig())
    assert isinstance(router, IndexRouter) and router.conversations is not None
    return router


def new_conversations(
    router: IndexRouter, engines: Engines, n: int, system: tuple[int, ...] = (0,)
) -> list[WorkerId]:
    """`n` conversations sent one after the other (one client: the engines stay idle), each
    its first turn: the system prompt's blocks, then three of its own."""
    return [
        engines.serve(router, request(*system, 1000 * (c + 1), 1000 * (c + 1) + 1), idle())
        for c in range(n)
    ]


def test_one_client_no_longer_puts_every_conversation_on_the_engine_with_the_system_block() -> None:
    old = Engines()
    cost = make_router("kv_aware", old.index, CoordinatorConfig(), placement="cost")
    assert isinstance(cost, IndexRouter)
    before = new_conversations(cost, old, 12)
    assert len(set(before)) == 1
    engines = Engines()
    placed = new_conversations(kv_aware(engines), engines, 12)
    assert min(placed.count(A), placed.count(B)) >= 5


@pytest.mark.parametrize("queue_weight", [1.0, 4.0])
def test_an_engine_holding_only_a_long_shared_prompt_does_not_attract_every_new_conversation(
    queue_weight: float,
) -> None:
    """A's cache holds a 6-block system prompt that several conversations continued; B (just
    started, or restarted) holds nothing. The prompt is where prompts part: no affinity. With
    nothing queued the queue's weight changes nothing."""
    engines = Engines()
    # a gateway following the engines from their start
    router = kv_aware(engines, CoordinatorConfig(placement_queue_weight=queue_weight))
    system = (1, 2, 3, 4, 5, 6)
    for c in range(PARTED_WAYS):
        engines.store(A, h(*system, 500 + c))
    placed = new_conversations(router, engines, 8, system)
    assert placed.count(B) >= 4
    assert placed[0] == B  # A stored 9 blocks lately, B none: more than the prompt B lacks


def test_two_continuations_may_be_one_conversation_editing_its_turn_and_keep_affinity() -> None:
    engines = Engines()
    engines.store(B, h(0))
    engines.store(A, h(0, 7, 8, 9, 10))
    engines.store(A, h(0, 7, 8, 9, 11))  # the last turn asked again, differently
    router = kv_aware(engines)
    assert engines.serve(router, request(0, 7, 8, 9, 12, 13), idle()) == A


def test_a_follow_up_stays_on_its_engine_while_the_queue_there_is_worth_less_than_the_move() -> (
    None
):
    engines = Engines()
    engines.store(B, h(0))
    engines.store(A, h(0, *range(10, 20)))
    router = kv_aware(engines)
    req = request(0, *range(10, 22))
    gain_tokens = 10 * BLOCK  # A holds 11 blocks, 10 beyond B's one
    busy = WorkerLoad(A, active_prefill_tokens=MOVE_PRICE * gain_tokens)
    assert router.route(req, [busy, WorkerLoad(B)], b"k").worker_id == A
    busier = WorkerLoad(A, active_prefill_tokens=MOVE_PRICE * gain_tokens + 1)
    moved = router.route(req, [busier, WorkerLoad(B)], b"k")
    assert moved.worker_id == B
    assert moved.peer_id == A and moved.peer_pages == 10  # the decision names what it gave up


def test_a_follow_up_never_moves_to_an_engine_that_is_busy_too() -> None:
    engines = Engines()
    engines.store(B, h(0))
    engines.store(A, h(0, *range(10, 20)))
    router = kv_aware(engines)
    loads = [WorkerLoad(A, active_prefill_tokens=100_000), WorkerLoad(B, active_prefill_tokens=1)]
    assert router.route(request(0, *range(10, 22)), loads, b"k").worker_id == A


def test_new_conversations_go_where_fewer_blocks_were_stored_lately_not_by_count() -> None:
    engines = Engines()
    router = kv_aware(engines)
    for c in range(PARTED_WAYS):  # both engines have seen the system prompt part
        engines.store(A, h(0, 100 + c))
        engines.store(B, h(0, 200 + c))
    engines.store(A, h(0, *range(300, 340)))  # one long conversation on A
    placed = new_conversations(router, engines, 6)
    assert placed.count(B) >= 5  # B stored 40 blocks fewer: it takes conversations until level


def test_concurrent_new_conversations_part_from_the_prompt_being_prefilled() -> None:
    """Before any event arrives, a second new conversation shares only the first one's system
    block, which A is prefilling: it goes to idle B, not behind A's prefill."""
    engines = Engines()
    router = kv_aware(engines)
    first = request(0, 1000, 1001)
    prefilling = {A: [tuple(first.hashes)]}
    loads = [WorkerLoad(A, active_prefill_tokens=first.num_tokens), WorkerLoad(B)]
    second = router.route(request(0, 2000, 2001), loads, b"k", prefilling)
    assert second.worker_id == B
    held = router.overlaps(request(0, 2000, 2001), prefilling)
    assert isinstance(held, Held) and held.parts_at == 1 and held[A] == 1


def test_parting_depth_is_where_two_prompts_go_on_differently() -> None:
    assert parting_depth(h(0, 1, 2), {A: [tuple(h(0, 1, 5))]}) == 2
    assert parting_depth(h(0, 1), {A: [tuple(h(0, 1, 5))]}) == 0  # a prefix of it: one prompt
    assert parting_depth(h(0, 1, 2), {A: [tuple(h(0, 1))]}) == 0  # it extends the other
    assert parting_depth(h(0, 1, 2), {A: [tuple(h(9))], B: [tuple(h(0, 3))]}) == 1


def test_prefix_branches_count_continuations_the_caches_still_hold() -> None:
    engines = Engines()
    branches = PrefixBranches(engines.index)
    for c in range(PARTED_WAYS):
        engines.store(A if c % 2 else B, h(0, 1, 10 + c))
    assert branches.shared_depth(h(0, 1, 99), 2) == 2
    assert branches.shared_depth(h(0, 1, 99), 1) == 0  # held up to block 0 only
    engines.publish(B, PagesRemoved(tuple(h(10))))  # one continuation evicted everywhere
    assert branches.shared_depth(h(0, 1, 99), 2) == 0
    engines.store(A, h(0, 1, 10))
    assert branches.shared_depth(h(0, 1, 99), 2) == 2
    engines.publish(A, AllPagesCleared())
    engines.publish(B, AllPagesCleared())
    assert branches.shared_depth(h(0, 1, 99), 2) == 0


def test_engine_work_forgets_what_came_in_before_the_caches_last_fill() -> None:
    engines = Engines()
    work = EngineWork(engines.index)
    engines.store(A, h(*range(1, 11)))  # 10 blocks
    assert work.blocks(A) == 10
    engines.store(B, h(*range(100, 106)))
    assert (work.blocks(A), work.blocks(B)) == (10, 6)
    engines.publish(A, PagesRemoved(tuple(h(*range(1, 11)))))  # A evicted them: 6 held in all
    engines.store(B, h(*range(200, 204)))
    assert (work.blocks(A), work.blocks(B)) == (0, 10)  # the window is what the caches hold


def test_a_cleared_or_restarted_engine_starts_its_work_over() -> None:
    engines = Engines()
    work = EngineWork(engines.index)
    engines.store(A, h(1, 2, 3))
    engines.store(B, h(4, 5))
    engines.publish(A, AllPagesCleared())
    assert (work.blocks(A), work.blocks(B)) == (0, 2)
    engines.store(A, h(1, 2))
    engines.index.apply(make_batch([PagesStored(tuple(h(7)), None, (), BLOCK)], B, "new", 0))
    assert (work.blocks(A), work.blocks(B)) == (2, 1)  # B's new incarnation: its old work gone


def test_the_rule_before_stays_one_setting_away_and_bad_settings_are_refused() -> None:
    index = GlobalIndex()
    old = make_router("kv_aware", index, CoordinatorConfig(), placement="cost")
    assert isinstance(old, IndexRouter) and old.conversations is None
    history = make_router("approx_prefix", GlobalIndex(), CoordinatorConfig(), 384)
    assert history._inner.conversations is None  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="unknown placement 'sticky'"):
        make_router("kv_aware", index, CoordinatorConfig(), placement="sticky")
    with pytest.raises(ConfigError, match="kv_aware's rule, not 'round_robin'"):
        make_router("round_robin", index, CoordinatorConfig(), placement="conversations")
    with pytest.raises(ConfigError, match="kv_mesh places by its own cost"):
        make_router("kv_mesh", index, CoordinatorConfig(), placement="conversations")
    with pytest.raises(ConfigError, match="unknown placement 'x'"):
        GatewayConfig((EngineTarget("e", "http://127.0.0.1:1"),), placement="x")


def test_placement_queue_weight_trades_the_blocks_stored_lately_against_the_queue() -> None:
    """A stored 20 blocks lately and nothing is queued there; B stored one and has 8 blocks of
    prefill queued. At weight 1 (20 + 3 against 1 + 8 + 3) the new conversation goes to B;
    at 4 B's queue weighs 32 blocks and A's empty queue wins."""
    placed = {}
    for weight in (1.0, 4.0):
        engines = Engines()
        config = CoordinatorConfig(placement_queue_weight=weight)
        router = make_router("kv_aware", engines.index, config)
        engines.store(A, h(*range(100, 120)))
        engines.store(B, h(900))
        loads = [WorkerLoad(A), WorkerLoad(B, active_prefill_tokens=8 * BLOCK)]
        placed[weight] = router.route(request(7, 8, 9), loads, b"k").worker_id
    assert placed == {1.0: B, 4.0: A}


def test_a_negative_placement_queue_weight_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="placement_queue_weight"):
        CoordinatorConfig(placement_queue_weight=-1.0)
