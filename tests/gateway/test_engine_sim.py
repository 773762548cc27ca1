"""`kvmesh bench placement`: the gateway's routing in front of simulated engines whose block
pools publish vLLM's KV events; what the simulation shows of each placement rule."""

from __future__ import annotations

import pytest

from kvmesh.app.cli import main
from kvmesh.benchmarks.engine_sim import (
    EngineSpeed,
    SimBlockPool,
    SimTurn,
    Simulation,
    _Job,
    policy_router,
    sim_turns,
    simulate,
)
from kvmesh.benchmarks.engine_slices import trace_slice
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.errors import ConfigError
from kvmesh.gateway.config import EngineTarget
from kvmesh.gateway.engines import EnginePool
from kvmesh.trace import load_trace
from kvmesh.types import PageHash

BLOCK = 32


@pytest.fixture(scope="module")
def turns() -> list[SimTurn]:
    picked = trace_slice(load_trace(), 80, 8, (4096 - 4) // BLOCK, "fitting-requests")
    return sim_turns(picked, BLOCK, full_blocks=False)


def job(*blocks: int, tokens: int | None = None) -> _Job:
    hashes = tuple(PageHash(b.to_bytes(8, "big")) for b in blocks)
    n = tokens if tokens is not None else len(blocks) * BLOCK + 3
    pool = EnginePool([EngineTarget("e", "http://e")])
    ticket = pool.begin(pool.up()[0], n, hashes)
    return _Job(0, SimTurn(0, tuple(range(n)), hashes), ticket, 0.0)


def test_the_pool_evicts_a_finished_prompts_tail_first_and_publishes_each_change() -> None:
    published: list[list[dict]] = []
    pool = SimBlockPool(capacity=6, block_tokens=BLOCK, publish=published.append)
    first = job(1, 2, 3)
    pool.schedule(first, max_tokens=4)
    pool.prefilled(first)
    pool.release(first)
    assert list(pool.free) == [first.turn.hashes[2], first.turn.hashes[1], first.turn.hashes[0]]
    second = job(7, 8, 9)  # 4 blocks with its partial one, 3 free: one of the first's goes
    pool.schedule(second, max_tokens=4)
    assert published[-1] == [{"type": "BlockRemoved", "block_hashes": [3]}]
    assert first.turn.hashes[0] in pool.free  # the head outlived the tail
    stored = published[0][0]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [1, 2, 3]
    assert stored["parent_block_hash"] is None and len(stored["token_ids"]) == 3 * BLOCK


def test_a_hit_never_covers_the_last_prompt_token() -> None:
    pool = SimBlockPool(capacity=10, block_tokens=BLOCK, publish=lambda events: None)
    first = job(1, 2, tokens=2 * BLOCK)
    pool.schedule(first, max_tokens=1)
    pool.prefilled(first)
    pool.release(first)
    again = job(1, 2, tokens=2 * BLOCK)
    pool.schedule(again, max_tokens=1)
    assert again.hit_blocks == 1  # the last block is computed again for its last token


def test_the_index_holds_exactly_what_each_simulated_engine_caches(turns: list[SimTurn]) -> None:
    index = GlobalIndex()
    router = policy_router("kv_aware", index, 64)
    sim = Simulation(turns, router, index, engine_blocks=64, clients=4)
    result = sim.run("kv_aware")
    assert result.requests == len(turns) == sum(result.engine_requests.values())
    for engine in sim.engines.values():
        cached = set(engine.pool.free) | set(engine.pool.used)
        assert index.worker_pages(engine.worker_id) == cached
        assert len(cached) <= 64
    index.check_invariants()


def test_the_simulation_is_deterministic(turns: list[SimTurn]) -> None:
    assert simulate(turns, "kv_aware") == simulate(turns, "kv_aware")


def test_with_one_client_the_rule_before_hot_spots_and_the_default_does_not(
    turns: list[SimTurn],
) -> None:
    before = simulate(turns, "kv_aware[placement=cost]", clients=1)
    now = simulate(turns, "kv_aware", clients=1)
    assert before.max_share == 1.0  # the engine that first cached the system block took all
    assert now.max_share <= 0.6
    assert now.engine_prefix_hit_rate > before.engine_prefix_hit_rate


def test_on_the_bench_slice_the_default_leaves_a_fifth_less_work_than_the_history_router() -> None:
    """The bench's default slice and engines (250 requests, 2 x 384 blocks, 4 clients)."""
    picked = trace_slice(load_trace(), 250, 8, (4096 - 4) // BLOCK, "fitting-requests")
    default = sim_turns(picked, BLOCK, full_blocks=False)
    kv = simulate(default, "kv_aware")
    history = simulate(default, "approx_prefix")
    rr = simulate(default, "round_robin")
    assert kv.engine_prefix_hit_rate >= 0.64
    assert history.computed_tokens >= 1.2 * kv.computed_tokens
    assert rr.computed_tokens > history.computed_tokens
    assert kv.max_share <= 0.6


def test_bad_policy_labels_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'sticky' is no CoordinatorConfig field"):
        policy_router("kv_aware[sticky=1]", GlobalIndex(), 64)
    with pytest.raises(ConfigError, match="write NAME"):
        policy_router("kv_aware[queue_weight=0", GlobalIndex(), 64)
    with pytest.raises(ConfigError, match="unknown routing policy 'nope'"):
        policy_router("nope", GlobalIndex(), 64)
    with pytest.raises(ConfigError, match="unknown placement"):
        policy_router("kv_aware[placement=sticky]", GlobalIndex(), 64)
    with pytest.raises(ConfigError, match="prefill rate must be positive"):
        EngineSpeed(prefill_tokens_per_ms=0)


def test_bench_placement_prints_each_policy_and_the_work_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["bench", "placement", "--requests", "40", "--policies", "kv_aware,round_robin"]) == 0
    )
    out = capsys.readouterr().out
    assert "kv_aware " in out and "round_robin " in out
    assert "prompt tokens computed, round_robin / kv_aware = " in out


def test_the_open_loop_sends_each_turn_at_its_arrival_or_after_its_predecessor(
    turns: list[SimTurn],
) -> None:
    slow = simulate(turns, "kv_aware", rate=0.5)
    fast = simulate(turns, "kv_aware", rate=50.0)
    assert slow.requests == fast.requests == len(turns)
    assert slow.requests_per_s < 0.6  # arrivals set the pace: about 0.5 a second
    assert fast.ttft_mean_ms > slow.ttft_mean_ms  # queues form only when arrivals crowd


def test_bench_placement_with_trace_arrivals_calibrates_the_rate_on_round_robin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "placement", "--requests", "40", "--arrival", "trace", "--load", "0.5"]
    assert main([*argv, "--policies", "kv_aware"]) == 0
    assert "open loop at " in capsys.readouterr().out
