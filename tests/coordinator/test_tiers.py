"""Tiers in the index and the router: where each page lives, and what a hit there costs."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import (
    Candidates,
    KVAwarePolicy,
    RouteRequest,
    WorkerLoad,
    candidates,
    make_policy,
)
from kvmesh.coordinator.service import Coordinator
from kvmesh.coordinator.tiers import TierCosts, TierPages
from kvmesh.errors import ConfigError
from kvmesh.events import (
    AllPagesCleared,
    KVEvent,
    PagesRemoved,
    PagesStored,
    decode_batch,
    encode_batch,
    make_batch,
)
from kvmesh.hashing import PageHasher
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.page_pool import PagePool

PAGE = 2
HASHER = PageHasher(PAGE, algo="xxh3_128")
TIERS = ("gpu", "cpu", "disk")
WORKERS = [WorkerId(f"w{i}") for i in range(3)]
PROMPTS: list[list[PageHash]] = [
    HASHER.hash_prompt([f] * (2 * PAGE) + [f * 10 + v] * (3 * PAGE))
    for f in range(2)
    for v in range(2)
]
W0, W1 = WorkerId("w0"), WorkerId("w1")


# ------------------------------------------------------------------ the index, property


class Reference:
    """What a worker holds where: worker -> page -> tiers (the model the index must equal)."""

    def __init__(self) -> None:
        self.held: dict[WorkerId, dict[PageHash, set[str]]] = {w: {} for w in WORKERS}

    def events(self, op: tuple[str, int, int, int, int, int]) -> tuple[WorkerId, list[KVEvent]]:
        kind, wi, ti, t2, pi, k = op
        wid, tier, other = WORKERS[wi], TIERS[ti], TIERS[t2]
        prompt = PROMPTS[pi]
        held = self.held[wid]
        if kind == "store":  # the first k pages enter `tier`
            for h in prompt[:k]:
                held.setdefault(h, set()).add(tier)
            return wid, [PagesStored(tuple(prompt[:k]), None, (), PAGE, None, tier)]
        if kind == "move":  # pages k.. held in `tier` move to `other`: stored there, then removed
            if other == tier:
                return wid, []
            moving = [h for h in prompt[k:] if tier in held.get(h, ())]
            events: list[KVEvent] = []
            for h in moving:
                i = prompt.index(h)
                parent = prompt[i - 1] if i else None
                events.append(PagesStored((h,), parent, (), PAGE, None, other))
                held[h].add(other)
            if moving:
                events.append(PagesRemoved(tuple(moving), tier))
                for h in moving:
                    held[h].discard(tier)
            return wid, events
        if kind == "remove":  # pages k.. leave `tier`
            gone = [h for h in prompt[k:] if tier in held.get(h, ())]
            for h in gone:
                held[h].discard(tier)
                if not held[h]:
                    del held[h]
            return wid, [PagesRemoved(tuple(gone), tier)]
        held.clear()
        return wid, [AllPagesCleared()]

    def holders(self, h: PageHash) -> dict[WorkerId, tuple[str, ...]]:
        out: dict[WorkerId, tuple[str, ...]] = {}
        for wid, held in self.held.items():
            tiers = held.get(h)
            if tiers:
                out[wid] = tuple(t for t in TIERS if t in tiers)
        return out

    def tier_pages(self, prompt: list[PageHash]) -> dict[WorkerId, TierPages]:
        out: dict[WorkerId, TierPages] = {}
        for wid, held in self.held.items():
            counts = dict.fromkeys(TIERS, 0)
            for h in prompt:
                tiers = held.get(h)
                if not tiers:
                    break
                counts[min(tiers, key=TIERS.index)] += 1
            if (
                counts["cpu"]
                or counts["disk"]
                or any(held.get(h, {"gpu"}) != {"gpu"} for h in prompt[: sum(counts.values())])
            ):
                out[wid] = TierPages(counts["gpu"], counts["cpu"], counts["disk"])
        return out


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "move", "move", "remove", "clear"]),
        st.integers(0, len(WORKERS) - 1),
        st.integers(0, len(TIERS) - 1),
        st.integers(0, len(TIERS) - 1),
        st.integers(0, len(PROMPTS) - 1),
        st.integers(0, 5),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_the_index_knows_each_pages_tier_through_random_stores_moves_and_removals(
    steps: list[tuple[str, int, int, int, int, int]],
) -> None:
    index = GlobalIndex()
    ref = Reference()
    seqs = dict.fromkeys(WORKERS, 0)
    for op in steps:
        wid, events = ref.events(op)
        batch = make_batch(events, wid, "inc", seqs[wid])
        seqs[wid] += 1
        index.apply(decode_batch(encode_batch(batch)))
        index.check_invariants()
        for prompt in PROMPTS:
            for h in prompt:
                assert index.holders(h) == ref.holders(h)
            matched = index.match(prompt)
            assert index.tier_pages(prompt, matched) == ref.tier_pages(prompt)
            # each matched worker's tiers over its prefix, and the walk's "all on the device"
            # (which lets tier_pages skip its count) only when it is so
            tiers = {
                wid: tuple(t for t in TIERS if any(t in ref.held[wid][h] for h in prompt[:n]))
                for wid, n in matched.pages.items()
            }
            assert matched.tiers == tiers
            assert matched.device_only == all(t == ("gpu",) for t in tiers.values())
            # a view's shortcut (no MatchResult) gives the same overlaps and tier counts
            assert index.overlaps(prompt) == (matched.pages, ref.tier_pages(prompt))
            assert index.overlaps_many([prompt, prompt[:3]]) == [
                index.overlaps(prompt),
                index.overlaps(prompt[:3]),
            ]


def test_a_worker_whose_prefix_is_all_on_the_device_is_left_out_of_tier_pages() -> None:
    index = GlobalIndex()
    p = PROMPTS[0]
    index.apply(make_batch([PagesStored(tuple(p), None, (), PAGE, None, "gpu")], W0, "i", 0))
    index.apply(make_batch([PagesStored(tuple(p[:3]), None, (), PAGE, None, "host")], W1, "i", 0))
    assert index.tier_pages(p, index.match(p)) == {W1: TierPages(cpu=3)}


def test_vllm_media_names_map_to_the_tiers() -> None:
    index = GlobalIndex()
    p = PROMPTS[0]
    events: list[KVEvent] = [
        PagesStored(tuple(p[:2]), None, (), PAGE, None, "GPU"),
        PagesStored(tuple(p[2:4]), p[1], (), PAGE, None, "CPU"),
        PagesStored(tuple(p[4:]), p[3], (), PAGE, None, "STORAGE"),
    ]
    index.apply(make_batch(events, W0, "i", 0))
    assert index.tier_pages(p, index.match(p)) == {W0: TierPages(2, 2, len(p) - 4)}


# ------------------------------------------------------------------ kv_aware by tier


def req(n: int = 8) -> RouteRequest:
    return RouteRequest(PROMPTS[0][:n], n * PAGE, PAGE)


def idle(*ids: WorkerId, prefill_tokens: int = 0) -> list[WorkerLoad]:
    return [WorkerLoad(w, prefill_tokens, free_pages=100, total_pages=100) for w in ids]


def kv_aware(**cfg: object) -> KVAwarePolicy:
    policy = make_policy("kv_aware", CoordinatorConfig(**cfg), random.Random(0))  # type: ignore[arg-type]
    assert isinstance(policy, KVAwarePolicy)
    return policy


def test_kv_aware_prefers_a_host_hit_over_recomputing_and_names_the_pages_to_promote() -> None:
    policy = kv_aware(host_hit_cost=0.25)
    d = policy.choose(req(), {W0: 7}, idle(W0, W1), {W0: TierPages(cpu=7)})
    assert (d.worker_id, d.local_pages, d.promote_pages) == (W0, 7, 7)
    assert d.cost == pytest.approx(8 - 7 + 7 * 0.25)


def test_kv_aware_prefers_a_device_hit_over_a_host_hit_by_the_configured_cost() -> None:
    policy = kv_aware(host_hit_cost=0.25)
    tiers = {W1: TierPages(cpu=7)}
    d = policy.choose(req(), {W0: 7, W1: 7}, idle(W0, W1), tiers)
    assert (d.worker_id, d.promote_pages) == (W0, 0)
    # The host hit wins once the device holder's queue costs more than promoting would:
    # 7 pages x 0.25 = 1.75 pages of prefill; 2 queued pages on W0 tip it.
    d = policy.choose(req(), {W0: 7, W1: 7}, [*idle(W0, prefill_tokens=2 * PAGE), *idle(W1)], tiers)
    assert (d.worker_id, d.promote_pages) == (W1, 7)


def test_a_disk_hit_costs_its_read_time_and_never_more_than_recomputing() -> None:
    policy = kv_aware(host_hit_cost=0.1, disk_hit_cost=0.5)
    d = policy.choose(
        req(), {W0: 6, W1: 6}, idle(W0, W1), {W0: TierPages(disk=6), W1: TierPages(cpu=6)}
    )
    assert d.worker_id == W1  # host beats disk
    slow_disk = kv_aware(disk_hit_cost=3.0)
    costs = slow_disk.costs(
        req(), _cands(slow_disk, {W0: 6}, idle(W0, W1)), 0, {W0: TierPages(disk=6)}
    )
    assert costs == [8.0, 8.0]  # capped at a recompute: the disk copy is no worse than nothing


def test_a_mixed_prefix_is_charged_per_tier_and_pulls_still_count() -> None:
    policy = kv_aware(host_hit_cost=0.2, disk_hit_cost=0.4, pull_cost=0.1)
    request = RouteRequest(PROMPTS[0][:8], 8 * PAGE, PAGE, allow_pull=True)
    overlaps = {W0: 6, W1: 8}
    tiers = {W0: TierPages(gpu=2, cpu=2, disk=2)}
    costs = policy.costs(request, _cands(policy, overlaps, idle(W0, W1)), 8, tiers)
    assert costs[0] == pytest.approx(2 + 2 * 0.2 + 2 * 0.4 - 2 * 0.9)
    assert costs[1] == pytest.approx(0.0)


def test_tier_costs_refuse_a_negative_cost_and_derive_from_measured_times() -> None:
    with pytest.raises(ConfigError, match="host_hit_cost"):
        CoordinatorConfig(host_hit_cost=-0.1)
    with pytest.raises(ConfigError, match="tier cost disk"):
        TierCosts(0.1, float("nan"), 0.2)
    with pytest.raises(ConfigError, match="prefill time"):
        TierCosts.from_ms(0.0, 1.0, 2.0, 3.0)
    costs = TierCosts.from_ms(40.0, 2.0, 10.0, 8.0)
    assert (costs.host, costs.disk, costs.pull) == (0.05, 0.25, 0.2)


def _cands(
    policy: KVAwarePolicy, overlaps: dict[WorkerId, int], loads: list[WorkerLoad]
) -> Candidates:
    return candidates(req(), overlaps, loads)


# ------------------------------------------------------------------ through the service


def test_the_coordinator_prefers_a_device_holder_and_promises_a_host_holder_promotion() -> None:
    coord = Coordinator(CoordinatorConfig(host_hit_cost=0.25), rng=random.Random(0))
    prompt = PROMPTS[1]
    pools = {
        W0: PagePool(32, page_size=PAGE, medium="gpu"),
        W1: PagePool(32, page_size=PAGE, medium="cpu"),
    }
    for wid, pool in pools.items():
        coord.register_worker(WorkerRegistration(wid, "127.0.0.1:1", 31, "inc"))
        pages = pool.get_new_pages(len(prompt))
        pool.cache_full_pages(pages, prompt, 0, len(prompt))
        pool.free_pages(reversed(pages))
        coord.report(
            WorkerReport(
                wid, [encode_batch(make_batch(pool.take_events(), wid, "inc", 0, snapshot=True))]
            )
        )
    d = coord.route(RouteQuery(prompt, len(prompt) * PAGE + 1, page_size=PAGE))
    assert (d.worker_id, d.local_pages, d.promote_pages) == (W0, len(prompt), 0)
    coord.remove_worker(W0)
    d = coord.route(RouteQuery(prompt, len(prompt) * PAGE + 1, page_size=PAGE))
    assert (d.worker_id, d.local_pages, d.promote_pages) == (W1, len(prompt), len(prompt))
