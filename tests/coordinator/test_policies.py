"""Routing policies on hand-built overlaps and loads."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.policies import (
    REGISTRY,
    KVAwarePolicy,
    Policies,
    RouteRequest,
    WorkerLoad,
    candidates,
    make_policy,
)
from kvmesh.errors import ConfigError, NoWorkers
from kvmesh.types import PageHash, WorkerId

W0, W1, W2, W3 = (WorkerId(f"w{i}") for i in range(4))
PAGE = 16


def hashes(n: int, tag: str = "h") -> list[PageHash]:
    return [PageHash(f"{tag}-{i}".encode()) for i in range(n)]


def req(n_pages: int = 10, tag: str = "h", allow_pull: bool = False) -> RouteRequest:
    return RouteRequest(hashes(n_pages, tag), n_pages * PAGE, PAGE, allow_pull)


def idle(*ids: WorkerId, total: int = 1000) -> list[WorkerLoad]:
    return [WorkerLoad(w, free_pages=total, total_pages=total) for w in ids]


def policy(name: str, seed: int = 0, **cfg: object) -> object:
    return make_policy(name, CoordinatorConfig(**cfg), random.Random(seed))  # type: ignore[arg-type]


def test_the_registry_holds_every_policy_and_rejects_unknown_names() -> None:
    assert set(REGISTRY) == {
        "kv_aware",
        "round_robin",
        "random",
        "least_loaded",
        "consistent_hash",
        "cache_aware",
    }
    with pytest.raises(ConfigError, match="kv_aware"):
        make_policy("fastest")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_raises_no_workers_on_an_empty_cluster(name: str) -> None:
    with pytest.raises(NoWorkers):
        make_policy(name).choose(req(), {}, [])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_decision_names_the_peer_holding_a_longer_prefix(name: str) -> None:
    p = make_policy(name, rng=random.Random(1))
    overlaps = {W0: 8, W1: 3}
    for _ in range(10):
        d = p.choose(req(10), overlaps, idle(W0, W1, W2))
        assert d.local_pages == overlaps.get(d.worker_id, 0)
        if d.worker_id == W0:
            assert (d.peer_id, d.peer_pages) == (None, 0)
        else:
            assert (d.peer_id, d.peer_pages) == (W0, 8 - d.local_pages)
        assert d.total_pages == 10
        assert d.policy == name


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_stale_worker_is_never_chosen_for_affinity_nor_named_as_peer(name: str) -> None:
    p = make_policy(name, rng=random.Random(2))
    loads = idle(W0, W1)
    loads[0] = replace(loads[0], stale=True)
    for _ in range(10):
        d = p.choose(req(10), {W0: 10}, loads)
        assert d.worker_id == W1
        assert d.peer_id is None
        assert not d.degraded


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_stale_full_and_draining_workers_are_chosen_only_when_nothing_else_is(
    name: str,
) -> None:
    p = make_policy(name, rng=random.Random(3))
    stale = replace(idle(W0)[0], stale=True)
    full = WorkerLoad(W1, free_pages=2, total_pages=1000)
    draining = replace(idle(W2)[0], draining=True)
    d = p.choose(req(10), {}, [stale, full, draining])
    assert (d.worker_id, d.degraded) == (W0, True)
    d = p.choose(req(10), {}, [full, draining])
    assert (d.worker_id, d.degraded) == (W1, True)
    d = p.choose(req(10), {}, [draining])
    assert (d.worker_id, d.degraded) == (W2, True)
    assert d.local_pages == 0


def test_a_stale_workers_overlap_counts_as_zero() -> None:
    loads = idle(W0)
    loads[0] = replace(loads[0], stale=True)
    assert candidates(req(10), {W0: 9}, loads).overlaps == [0]


def test_a_worker_holding_the_prefix_is_not_full_for_the_pages_it_already_has() -> None:
    loads = [WorkerLoad(W0, free_pages=3, total_pages=100), *idle(W1)]
    cands = candidates(req(10), {W0: 8}, loads)
    assert [c.worker_id for c in cands.loads] == [W0, W1]


def test_kv_aware_prefers_the_longest_prefix_at_equal_load() -> None:
    d = make_policy("kv_aware").choose(req(10), {W0: 2, W1: 7, W2: 5}, idle(W0, W1, W2))
    assert (d.worker_id, d.local_pages, d.cost) == (W1, 7, 3.0)


def test_kv_aware_sends_work_away_from_a_long_prefill_queue() -> None:
    loads = idle(W0, W1)
    loads[0] = replace(loads[0], active_prefill_tokens=20 * PAGE)  # 20 queued pages
    d = make_policy("kv_aware").choose(req(10), {W0: 8}, loads)
    assert d.worker_id == W1
    assert (d.peer_id, d.peer_pages) == (W0, 8)


def test_kv_aware_cost_is_weighted_prefill_plus_queue_plus_decode_load() -> None:
    cfg = CoordinatorConfig(overlap_weight=2.0, queue_weight=0.5, decode_weight=0.25)
    p = KVAwarePolicy(cfg, random.Random(0))
    loads = [WorkerLoad(W0, active_prefill_tokens=4 * PAGE, active_decode_pages=10)]
    cands = candidates(req(10), {W0: 4}, loads)
    assert p.costs(req(10), cands) == [2.0 * (6 + 0.5 * 4) + 0.25 * 10]


def test_kv_aware_ignores_decode_pages_by_default() -> None:
    loads = [WorkerLoad(W0, active_decode_pages=500), WorkerLoad(W1)]
    assert make_policy("kv_aware").choose(req(10), {W0: 6}, loads).worker_id == W0


def test_kv_aware_counts_pullable_pages_at_the_pull_cost() -> None:
    p = KVAwarePolicy(CoordinatorConfig(pull_cost=0.25), random.Random(0))
    r = req(10, allow_pull=True)
    cands = candidates(r, {W0: 8}, idle(W0, W1))
    assert p.costs(r, cands, peer_n=8) == [2.0, 2.0 + 8 * 0.25]


def test_kv_aware_with_pulls_balances_load_and_names_the_peer() -> None:
    loads = idle(W0, W1)
    loads[0] = replace(loads[0], active_prefill_tokens=4 * PAGE)
    no_pull = make_policy("kv_aware").choose(req(10), {W0: 8}, loads)
    with_pull = make_policy("kv_aware").choose(req(10, allow_pull=True), {W0: 8}, loads)
    assert no_pull.worker_id == W0
    assert (with_pull.worker_id, with_pull.peer_id, with_pull.peer_pages) == (W1, W0, 8)


def test_kv_aware_breaks_cost_ties_by_load_then_at_random() -> None:
    loads = idle(W0, W1, W2)
    overlaps = {W0: 5, W1: 5}  # W0 and W1 tie on cost and load; W2 costs more
    picks = Counter(
        make_policy("kv_aware", rng=random.Random(s)).choose(req(10), overlaps, loads).worker_id
        for s in range(40)
    )
    assert set(picks) == {W0, W1}
    # All costs equal (zero weights): the least loaded of the tied wins.
    loads[0] = replace(loads[0], active_decode_pages=1)
    loads[2] = replace(loads[2], active_prefill_tokens=1)
    p = KVAwarePolicy(CoordinatorConfig(overlap_weight=0.0, decode_weight=0.0), random.Random(0))
    assert {p.choose(req(10), overlaps, loads).worker_id for _ in range(20)} == {W1}


def test_kv_aware_is_repeatable_with_the_same_seed() -> None:
    loads = idle(W0, W1, W2, W3)

    def run(seed: int) -> list[WorkerId]:
        p = make_policy("kv_aware", rng=random.Random(seed))
        return [p.choose(req(4, tag=str(i % 3)), {}, loads).worker_id for i in range(30)]

    assert run(7) == run(7)


def test_kv_aware_softmax_sampling_sometimes_picks_a_costlier_worker() -> None:
    overlaps = {W0: 6, W1: 5}
    cold = policy("kv_aware", seed=0)
    warm = policy("kv_aware", seed=0, temperature=1.0)
    cold_picks = {cold.choose(req(10), overlaps, idle(W0, W1)).worker_id for _ in range(50)}  # type: ignore[attr-defined]
    warm_picks = {warm.choose(req(10), overlaps, idle(W0, W1)).worker_id for _ in range(50)}  # type: ignore[attr-defined]
    assert cold_picks == {W0}
    assert warm_picks == {W0, W1}


def test_kv_aware_bounded_load_skips_a_worker_far_above_the_mean_queue() -> None:
    loads = idle(W0, W1, W2, W3)
    loads[0] = replace(loads[0], active_prefill_tokens=12 * PAGE)  # holds the prefix, long queue
    for i in (1, 2, 3):
        loads[i] = replace(loads[i], active_decode_pages=10)  # idle queues, busy decoding
    overlaps = {W0: 10}
    loose = make_policy("kv_aware", CoordinatorConfig(decode_weight=1.0))
    bounded = make_policy("kv_aware", CoordinatorConfig(decode_weight=1.0, max_load_ratio=1.5))
    assert loose.choose(req(10), overlaps, loads).worker_id == W0  # cost 12 < 20
    assert bounded.choose(req(10), overlaps, loads).worker_id != W0  # 12 > 1.5 * 22 / 4


def test_round_robin_cycles_through_workers_in_id_order() -> None:
    p = make_policy("round_robin")
    loads = idle(W2, W0, W1)
    assert [p.choose(req(), {W2: 9}, loads).worker_id for _ in range(5)] == [
        W0,
        W1,
        W2,
        W0,
        W1,
    ]


def test_random_follows_the_injected_rng() -> None:
    loads = idle(W0, W1, W2, W3)
    a = make_policy("random", rng=random.Random(5))
    b = make_policy("random", rng=random.Random(5))
    seq_a = [a.choose(req(), {}, loads).worker_id for _ in range(20)]
    assert seq_a == [b.choose(req(), {}, loads).worker_id for _ in range(20)]
    assert len(set(seq_a)) > 1


def test_least_loaded_picks_the_least_queued_prefill_plus_decode_pages() -> None:
    loads = [
        WorkerLoad(W0, active_prefill_tokens=5 * PAGE, active_decode_pages=0),
        WorkerLoad(W1, active_prefill_tokens=0, active_decode_pages=3),
        WorkerLoad(W2, active_prefill_tokens=2 * PAGE, active_decode_pages=2),
    ]
    assert make_policy("least_loaded").choose(req(), {W0: 10}, loads).worker_id == W1


def test_consistent_hash_sends_the_same_prefix_to_the_same_worker() -> None:
    p = make_policy("consistent_hash")
    loads = idle(W0, W1, W2, W3)
    first = p.choose(req(8, tag="conv-1"), {}, loads).worker_id
    assert all(p.choose(req(8, tag="conv-1"), {}, loads).worker_id == first for _ in range(5))


def test_consistent_hash_spreads_requests_that_share_only_the_first_page() -> None:
    p = make_policy("consistent_hash")
    loads = idle(W0, W1, W2, W3)
    picks = set()
    for i in range(40):
        hs = [PageHash(b"system-prompt"), *hashes(7, tag=f"user-{i}")]
        picks.add(p.choose(RouteRequest(hs, 8 * PAGE, PAGE), {}, loads).worker_id)
    assert len(picks) >= 3


def test_consistent_hash_bounds_the_load_even_when_every_key_is_equal() -> None:
    p = make_policy("consistent_hash", CoordinatorConfig(consistent_hash_load_factor=1.25))
    loads = {w: WorkerLoad(w) for w in (W0, W1, W2, W3)}
    for _ in range(40):
        d = p.choose(req(8, tag="same"), {}, list(loads.values()))
        cur = loads[d.worker_id]
        loads[d.worker_id] = replace(cur, active_decode_pages=cur.active_decode_pages + 8)
    counts = [load.active_decode_pages // 8 for load in loads.values()]
    assert max(counts) <= 1.25 * 10 + 1
    assert min(counts) > 0


def test_cache_aware_follows_a_good_prefix_match() -> None:
    p = make_policy("cache_aware", CoordinatorConfig(cache_threshold=0.5))
    loads = [WorkerLoad(W0, active_requests=3), WorkerLoad(W1, active_requests=0)]
    assert p.choose(req(10), {W0: 6}, loads).worker_id == W0


def test_cache_aware_goes_to_the_least_loaded_below_the_match_threshold() -> None:
    p = make_policy("cache_aware", CoordinatorConfig(cache_threshold=0.5))
    loads = [WorkerLoad(W0, active_requests=3), WorkerLoad(W1, active_requests=0)]
    assert p.choose(req(10), {W0: 4}, loads).worker_id == W1


def test_cache_aware_uses_the_shortest_queue_when_load_is_imbalanced() -> None:
    cfg = CoordinatorConfig(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=1.5)
    p = make_policy("cache_aware", cfg)
    loads = [WorkerLoad(W0, active_requests=10), WorkerLoad(W1, active_requests=2)]
    assert p.choose(req(10), {W0: 10}, loads).worker_id == W1
    # Imbalance under the absolute threshold: the cache match wins again.
    loads = [WorkerLoad(W0, active_requests=5), WorkerLoad(W1, active_requests=2)]
    assert p.choose(req(10), {W0: 10}, loads).worker_id == W0


def test_bad_policy_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        make_policy("kv_aware", CoordinatorConfig(temperature=-1.0))
    with pytest.raises(ConfigError):
        make_policy("consistent_hash", CoordinatorConfig(consistent_hash_load_factor=0.5))
    with pytest.raises(ConfigError):
        make_policy("cache_aware", CoordinatorConfig(cache_threshold=2.0))


def test_policies_keep_each_policy_built_once_so_its_state_carries_over() -> None:
    policies = Policies(CoordinatorConfig(policy="kv_aware"), random.Random(0))
    assert policies.get(None) is policies.get("kv_aware")
    turns = policies.get("round_robin")
    assert policies.get("round_robin") is turns  # round robin's turn goes on between routes
    assert policies.get(None) is not turns


def test_policies_refuse_an_unknown_name_naming_the_known_ones() -> None:
    policies = Policies(CoordinatorConfig(), random.Random(0))
    with pytest.raises(ConfigError, match="round_robin"):
        policies.get("fastest")
    with pytest.raises(ConfigError):
        policies.get("")  # not the config's: a name, and none of them
    with pytest.raises(ConfigError, match="kv_aware"):
        Policies.check("fastest")
    Policies.check(None)  # the config's, whatever it is
    Policies.check("round_robin")
