"""The trace simulator: its time model on hand-built traces, and real replays of trace slices."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from kvmesh.app.cli import main
from kvmesh.app.sim_engine import (
    PreparedTrace,
    RequestTiming,
    SimSettings,
    Simulation,
    TimeModel,
    prepare_trace,
)
from kvmesh.app.simulate import REPORT_KEYS, policy_names, simulate, summarize
from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.policies import (
    REGISTRY,
    RouteDecision,
    RouteRequest,
    WorkerLoad,
    make_policy,
)
from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.hashing import PageHasher
from kvmesh.trace import TraceRequest, load_trace, request_tokens
from kvmesh.types import WorkerId

P = 512
BASE_MS = 5.0
TOKEN_MS = 0.08
PULL_MS = 6.4


def replay(
    reqs: list[TraceRequest],
    *,
    workers: int = 1,
    capacity: int = 64,
    pull: bool = False,
    policy: str = "round_robin",
    time_model: TimeModel | None = None,
) -> tuple[Simulation, dict[str, RequestTiming]]:
    settings = SimSettings(workers, capacity, pull, time_model or TimeModel())
    sim = Simulation(
        prepare_trace(reqs), make_policy(policy, CoordinatorConfig(), random.Random(0)), settings
    )
    result = sim.run()
    return sim, {t.request_id: t for t in result.timings}


def prefill_ms(tokens: int) -> float:
    return BASE_MS + TOKEN_MS * tokens


@pytest.fixture(scope="module")
def trace_slice() -> PreparedTrace:
    return prepare_trace(load_trace(limit=300))


# ------------------------------------------------------------------ time model


def test_one_request_ttft_is_the_fixed_cost_plus_its_tokens() -> None:
    _, t = replay([TraceRequest(0, 1000, 10, (1, 2))])
    assert t["req-0"].ttft_ms == pytest.approx(prefill_ms(1000))
    assert t["req-0"].computed_tokens == 1000
    assert t["req-0"].hit_pages == 0


def test_a_request_queued_behind_another_waits_for_its_prefill() -> None:
    _, t = replay([TraceRequest(0, 2000, 1, (1, 2, 3, 4)), TraceRequest(10, 600, 1, (7, 8))])
    first_end = prefill_ms(2000)
    assert t["req-1"].start_ms == pytest.approx(first_end)
    assert t["req-1"].ttft_ms == pytest.approx(first_end - 10 + prefill_ms(600))


def test_a_cached_prefix_saves_the_compute_of_its_pages() -> None:
    a = TraceRequest(0, 3 * P, 1, (1, 2, 3))
    b = TraceRequest(1000, 3 * P + 100, 1, (1, 2, 9, 10))
    _, t = replay([a, b])
    assert t["req-1"].hit_pages == 2
    assert t["req-1"].computed_tokens == P + 100
    assert t["req-1"].ttft_ms == pytest.approx(prefill_ms(3 * P + 100 - 2 * P))


def test_the_last_prompt_token_is_always_computed() -> None:
    a = TraceRequest(0, 3 * P, 1, (1, 2, 3))
    _, t = replay([a, TraceRequest(1000, 3 * P, 1, (1, 2, 3))])
    # All three pages are cached, but the last one is recomputed for its logits.
    assert t["req-1"].hit_pages == 2
    assert t["req-1"].ttft_ms == pytest.approx(prefill_ms(P))


def test_pulled_pages_cost_the_pull_time_instead_of_their_compute() -> None:
    a = TraceRequest(0, 4 * P, 1, (1, 2, 3, 4))
    b = TraceRequest(1000, 4 * P + 10, 1, (1, 2, 3, 5, 6))
    # Round robin sends b to the other worker, which pulls a's three pages.
    _, t = replay([a, b], workers=2, pull=True)
    assert t["req-0"].worker_id != t["req-1"].worker_id
    assert (t["req-1"].hit_pages, t["req-1"].pulled_pages) == (0, 3)
    assert t["req-1"].ttft_ms == pytest.approx(prefill_ms(P + 10) + 3 * PULL_MS)


def test_pulls_happen_only_when_cheaper_than_computing() -> None:
    a = TraceRequest(0, 4 * P, 1, (1, 2, 3, 4))
    b = TraceRequest(1000, 4 * P + 10, 1, (1, 2, 3, 5, 6))
    slow = TimeModel(pull_page_ms=100.0)  # more than 512 tokens x 80 us = 41 ms
    _, t = replay([a, b], workers=2, pull=True, time_model=slow)
    assert t["req-1"].pulled_pages == 0
    assert t["req-1"].ttft_ms == pytest.approx(prefill_ms(4 * P + 10))


def test_pulled_pages_become_cached_on_the_puller_and_reach_the_index() -> None:
    a = TraceRequest(0, 4 * P, 1, (1, 2, 3, 4))
    b = TraceRequest(1000, 4 * P + 10, 1, (1, 2, 3, 5, 6))
    sim, t = replay([a, b], workers=2, pull=True)
    assert t["req-1"].pulled_pages == 3
    puller = next(w for w in sim.workers if w.worker_id == t["req-1"].worker_id)
    hashes = sim.trace.requests[1].page_hashes
    assert set(hashes[:4]) <= puller.pool.cached_hashes()
    assert set(hashes[:4]) <= sim.index.worker_pages(puller.worker_id)


def test_a_prefill_waits_until_a_decode_frees_the_pages_it_needs() -> None:
    a = TraceRequest(0, 3 * P, 100, (1, 2, 3))  # holds 3 pages for 100 x 25 ms
    b = TraceRequest(10, 3 * P, 1, (4, 5, 6))
    _, t = replay([a, b], capacity=4)
    a_done = prefill_ms(3 * P) + 100 * 25.0
    assert t["req-1"].start_ms == pytest.approx(a_done)
    assert t["req-1"].ttft_ms == pytest.approx(a_done - 10 + prefill_ms(3 * P))


def test_freed_pages_stay_cached_until_reused() -> None:
    a = TraceRequest(0, 2 * P, 1, (1, 2))
    b = TraceRequest(1000, 3 * P, 1, (1, 2, 3))
    _, t = replay([a, b], capacity=4)
    assert t["req-1"].hit_pages == 2


class RecordingPolicy:
    """The real round robin policy, keeping the loads it was shown."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = make_policy("round_robin")
        self.seen: list[list[WorkerLoad]] = []

    def choose(
        self, request: RouteRequest, overlaps: Mapping[WorkerId, int], loads: Sequence[WorkerLoad]
    ) -> RouteDecision:
        self.seen.append(list(loads))
        return self.inner.choose(request, overlaps, loads)


def test_policies_see_remaining_prefill_tokens_and_held_decode_pages() -> None:
    big = TraceRequest(0, 20 * P, 40, tuple(range(100, 120)))
    big_prefill = prefill_ms(20 * P)
    mid = TraceRequest(int(big_prefill / 2), P, 1, (7,))
    later = TraceRequest(int(big_prefill) + 100, P, 1, (9,))
    policy = RecordingPolicy()
    Simulation(prepare_trace([big, mid, later]), policy, SimSettings(1, 64)).run()
    at_mid = policy.seen[1][0]
    assert at_mid.active_prefill_tokens == pytest.approx(10 * P, abs=P // 8)
    assert at_mid.active_requests == 1
    at_later = policy.seen[2][0]
    assert at_later.active_prefill_tokens == 0
    assert at_later.active_decode_pages == 20
    assert at_later.free_pages == 64 - 20


def test_a_simulation_replays_only_once() -> None:
    sim, _ = replay([TraceRequest(0, P, 1, (1,))])
    with pytest.raises(InvalidInput, match="replays once"):
        sim.run()


def test_time_model_constants_must_be_finite_and_non_negative() -> None:
    with pytest.raises(ConfigError, match="prefill_token_us"):
        TimeModel(prefill_token_us=-1.0)
    with pytest.raises(ConfigError, match="workers"):
        SimSettings(workers=0)


def test_a_pool_smaller_than_the_longest_prompt_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 3"):
        replay([TraceRequest(0, 3 * P, 1, (1, 2, 3))], capacity=2)


def test_a_trace_line_whose_blocks_do_not_cover_its_input_is_refused() -> None:
    with pytest.raises(InvalidInput, match="need 2 blocks"):
        prepare_trace([TraceRequest(0, P + 1, 1, (1,))])


# --------------------------------------------------------------- real replays


def test_prepared_hashes_are_the_real_chained_page_hashes(trace_slice: PreparedTrace) -> None:
    hasher = PageHasher(P)
    raw = load_trace(limit=3)
    for req, sim_req in zip(raw, trace_slice.requests, strict=False):
        tokens = request_tokens(req, P)
        assert list(sim_req.page_hashes) == hasher.hash_prompt(tokens)
        assert list(trace_slice.token_ids(sim_req)) == tokens


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_every_policy_replays_a_trace_slice_on_the_real_loop(
    trace_slice: PreparedTrace, policy: str
) -> None:
    settings = SimSettings(workers=4, capacity_pages=2000)
    sim = Simulation(
        trace_slice, make_policy(policy, CoordinatorConfig(), random.Random(0)), settings
    )
    result = sim.run()
    report = summarize(result)
    assert len(result.timings) == len(trace_slice.requests)
    assert report.policy == policy
    assert 0.0 < report.page_hit_ratio <= report.reuse_ratio <= report.bound_hit_ratio + 1e-9
    assert report.load_imbalance >= 1.0
    assert min(t.ttft_ms for t in result.timings) >= BASE_MS
    assert report.ttft_p50_ms <= report.ttft_p99_ms
    for w in sim.workers:
        w.pool.check_invariants()
        assert w.pool.get_num_free_pages() == settings.capacity_pages  # every request freed


def test_the_index_ends_equal_to_the_union_of_the_pools_cached_sets(
    trace_slice: PreparedTrace,
) -> None:
    settings = SimSettings(workers=4, capacity_pages=1000, pull=True)  # pages get evicted
    sim = Simulation(
        trace_slice, make_policy("round_robin", CoordinatorConfig(), random.Random(0)), settings
    )
    report = summarize(sim.run())
    assert report.pulled_pages > 0
    union: set[bytes] = set()
    for w in sim.workers:
        cached = w.pool.cached_hashes()
        assert sim.index.worker_pages(w.worker_id) == cached
        union |= cached
    assert sim.index.all_pages() == union
    sim.index.check_invariants()


def test_kv_aware_reuses_more_of_the_slice_than_round_robin(trace_slice: PreparedTrace) -> None:
    settings = SimSettings(workers=4, capacity_pages=2000)
    kv = simulate(trace_slice, "kv_aware", settings)
    rr = simulate(trace_slice, "round_robin", settings)
    assert kv.page_hit_ratio > rr.page_hit_ratio


def test_pulls_bring_reuse_close_to_the_bound(trace_slice: PreparedTrace) -> None:
    settings = SimSettings(workers=4, capacity_pages=2000, pull=True)
    report = simulate(trace_slice, "round_robin", settings)
    assert report.reuse_ratio >= 0.9 * report.bound_hit_ratio
    assert report.page_hit_ratio < report.reuse_ratio


def test_policy_names_accept_all_or_a_list() -> None:
    assert policy_names("all") == list(REGISTRY)
    assert policy_names("round_robin, kv_aware") == ["round_robin", "kv_aware"]
    with pytest.raises(ConfigError, match="nope"):
        policy_names("nope")


# ------------------------------------------------------------------------- CLI

SMALL = ["--limit", "40", "--workers", "2", "--capacity-pages", "1000"]


def test_json_lines_carry_exactly_the_report_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "bundled", *SMALL, "--policy", "kv_aware,round_robin", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert len(lines) == 2
    objs = [json.loads(line) for line in lines]
    assert [list(o) for o in objs] == [list(REPORT_KEYS)] * 2
    assert [o["policy"] for o in objs] == ["kv_aware", "round_robin"]


def test_cli_prints_a_table_of_all_policies_and_writes_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "policies.png"
    rc = main(["simulate", *SMALL, "--policy", "all", "--pull", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for name in REGISTRY:
        assert name in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_argument_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:  # a flag's range: argparse's one usage line
        main(["simulate", "--workers", "0", "--limit", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert usage.value.code == 2
    assert len(err) == 1 and err[0].startswith("kvmesh simulate: error:") and "workers" in err[0]
    rc = main(["simulate", "--policy", "fastest", "--limit", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "fastest" in err[0]
