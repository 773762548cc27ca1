"""The simulator with the workers' real tiers under its pools: spills, promotions, their time."""

from __future__ import annotations

import json
import random

import pytest

from kvmesh.app.cli import main
from kvmesh.app.sim_engine import (
    FLOOD_TENANT,
    QUIET_TENANT,
    RequestTiming,
    SimSettings,
    Simulation,
    TimeModel,
    prepare_trace,
)
from kvmesh.app.simulate import REPORT_KEYS, simulate, summarize
from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.policies import make_policy
from kvmesh.errors import ConfigError
from kvmesh.trace import TraceRequest, load_trace

P = 512
TM = TimeModel()


def replay(
    reqs: list[TraceRequest], **settings: object
) -> tuple[Simulation, dict[str, RequestTiming]]:
    sim = Simulation(
        prepare_trace(reqs),
        make_policy("round_robin", CoordinatorConfig(), random.Random(0)),
        SimSettings(**settings),  # type: ignore[arg-type]
    )
    return sim, {t.request_id: t for t in sim.run().timings}


# a's three pages are all evicted by b (the device holds 3), then c hits a's first two
A = TraceRequest(0, 3 * P, 1, (1, 2, 3))
B = TraceRequest(100, 3 * P, 1, (4, 5, 6))
C = TraceRequest(1000, 2 * P + 100, 1, (1, 2, 8))


def test_without_tiers_evicted_pages_are_recomputed() -> None:
    _, t = replay([A, B, C], workers=1, capacity_pages=3)
    assert (t["req-2"].hit_pages, t["req-2"].promoted_pages) == (0, 0)
    assert t["req-2"].ttft_ms == pytest.approx(TM.prefill_ms(2 * P + 100))


@pytest.mark.parametrize(
    ("tier", "page_ms"), [("host", TM.host_page_ms), ("disk", TM.disk_page_ms)]
)
def test_pages_spilled_to_a_lower_tier_are_promoted_for_their_copy_time(
    tier: str, page_ms: float
) -> None:
    sim, t = replay([A, B, C], workers=1, capacity_pages=3, **{f"{tier}_pages": 8})
    c = t["req-2"]
    assert (c.hit_pages, c.promoted_pages) == (2, 2)
    assert c.computed_tokens == 100
    assert c.ttft_ms == pytest.approx(TM.prefill_ms(100) + 2 * page_ms)
    # the index followed every spill and promotion: per tier, it holds what the tiers hold
    w = sim.workers[0]
    assert w.tiers is not None
    held = w.tiers.hashes_by_tier()
    for name, hashes in held.items():
        for h in hashes:
            assert name in sim.index.holders(h)[w.worker_id]
    assert sim.index.worker_pages(w.worker_id) == set().union(*held.values())
    sim.index.check_invariants()


def test_a_full_host_tier_spills_on_to_disk_and_both_promote() -> None:
    d = TraceRequest(200, 3 * P, 1, (9, 10, 11))  # pushes a's pages on from host to disk
    _, t = replay([A, B, d, C], workers=1, capacity_pages=3, host_pages=3, disk_pages=8)
    c = t["req-3"]
    assert (c.hit_pages, c.promoted_pages) == (2, 2)
    assert c.ttft_ms == pytest.approx(TM.prefill_ms(100) + 2 * TM.disk_page_ms)


def test_host_pages_bring_a_small_device_pool_close_to_a_large_one() -> None:
    trace = prepare_trace(load_trace(limit=300))
    cfg = CoordinatorConfig(
        host_hit_cost=TM.tier_costs(P).host, disk_hit_cost=TM.tier_costs(P).disk
    )
    small = simulate(trace, "kv_aware", SimSettings(4, 300), cfg)
    tiered = simulate(trace, "kv_aware", SimSettings(4, 300, host_pages=1700), cfg)
    large = simulate(trace, "kv_aware", SimSettings(4, 2000), cfg)
    assert small.reuse_ratio < tiered.reuse_ratio
    assert tiered.reuse_ratio >= 0.9 * large.reuse_ratio


def test_negative_tier_sizes_are_refused_with_the_flag_to_fix() -> None:
    with pytest.raises(ConfigError, match="--host-pages"):
        SimSettings(host_pages=-1)


def test_the_cli_takes_host_and_disk_pages_and_keeps_its_json_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["simulate", "--limit", "40", "--workers", "2", "--capacity-pages", "300"]
    tiers = ["--host-pages", "300", "--disk-pages", "300", "--policy", "kv_aware", "--json"]
    assert main([*args, *tiers]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert tuple(line) == REPORT_KEYS
    with pytest.raises(SystemExit) as usage:  # a flag's range: argparse's usage line
        main([*args, "--host-pages", "-5"])
    assert usage.value.code == 2 and "--host-pages" in capsys.readouterr().err


# ------------------------------------------------------------------ tenants


def test_a_flooding_neighbour_sends_unique_pages_and_the_trace_keeps_its_own() -> None:
    trace = prepare_trace([A, TraceRequest(1000, 3 * P, 1, (1, 2, 3))])
    flooded = trace.with_flood(2)
    assert [r.tenant for r in flooded.requests] == [QUIET_TENANT, *[FLOOD_TENANT] * 2] * 2
    quiet = [r for r in flooded.requests if r.tenant == QUIET_TENANT]
    assert [r.page_hashes for r in quiet] == [r.page_hashes for r in trace.requests]
    flood_pages = [h for r in flooded.requests if r.tenant == FLOOD_TENANT for h in r.page_hashes]
    assert len(set(flood_pages)) == len(flood_pages) == 4 * 3
    assert not set(flood_pages) & set(trace.requests[0].page_hashes)
    with pytest.raises(ConfigError, match="--flood"):
        trace.with_flood(-1)


@pytest.mark.parametrize(("eviction", "quiet_hits"), [("lru", 0), ("fair", 2)])
def test_fair_share_keeps_a_quiet_tenants_pages_that_lru_gives_to_a_flood(
    eviction: str, quiet_hits: int
) -> None:
    # 9 device pages: the quiet tenant's 3, then three flooding prompts of 3; the third
    # needs room. LRU takes the oldest free pages (the quiet tenant's); fair share takes the
    # flood's own, since it holds 6 of 9 against a share of 4.5.
    trace = prepare_trace([A, TraceRequest(1000, 3 * P, 1, (1, 2, 3))]).with_flood(3)
    sim = Simulation(
        trace,
        make_policy("round_robin", CoordinatorConfig(), random.Random(0)),
        SimSettings(1, 9, eviction=eviction),
    )
    result = sim.run()
    again = next(t for t in result.timings if t.request_id == "req-1")
    assert (again.tenant, again.hit_pages) == (QUIET_TENANT, quiet_hits)
    report = summarize(result)
    assert report.tenant_page_hit_ratio[FLOOD_TENANT] == 0.0
    assert report.tenant_page_hit_ratio[QUIET_TENANT] == quiet_hits / 6
    assert "tenant_page_hit_ratio" in report.as_json()


def test_the_cli_reports_each_tenants_hit_ratio_beside_a_flood(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["simulate", "--limit", "30", "--workers", "2", "--capacity-pages", "300"]
    assert main([*args, "--flood", "1", "--eviction", "fair", "--policy", "kv_aware"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "page hit ratio by tenant" in x)
    assert f"{FLOOD_TENANT} 0.000" in line and f"{QUIET_TENANT} 0." in line
