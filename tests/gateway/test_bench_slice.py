"""The slice `kvmesh bench engines` replays: conversations found in the trace, in trace order."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.app.cli import main
from kvmesh.benchmarks.bench_engines import (
    Measured,
    PolicySetting,
    Replay,
    metric_sum,
    policy_setting,
    print_table,
    summarize,
    to_turns,
)
from kvmesh.benchmarks.engine_slices import (
    SLICES,
    LRUBlockPool,
    SlicePrompt,
    cache_replays,
    conversations,
    lru_hit_rate,
    pinned_by_count,
    prompt_tokens,
    slice_prompts,
    trace_slice,
)
from kvmesh.errors import ConfigError
from kvmesh.trace import TraceRequest, load_trace


def req(*blocks: int) -> TraceRequest:
    return TraceRequest(0, len(blocks) * 512, 1, blocks)


TRACE = [
    req(0, 1, 2),  # conversation A, turn 1
    req(0, 5, 6),  # B
    req(0, 1, 2, 3),  # A, turn 2 (extends A)
    req(0, 9),  # C: shares only the system block 0
    req(0, 5, 6, 7, 8, 10),  # B, turn 2
    req(0, 1, 2, 3, 4),  # A, turn 3
]


def test_a_turn_joins_the_conversation_whose_blocks_it_extends() -> None:
    assert conversations(TRACE) == [0, 1, 0, 2, 1, 0]


def test_the_slice_keeps_trace_order_and_only_long_conversations() -> None:
    picked = trace_slice(TRACE, 4, min_turns=2, max_blocks=10)
    assert [(c, r.hash_ids) for c, r in picked] == [
        (0, (0, 1, 2)),
        (1, (0, 5, 6)),
        (0, (0, 1, 2, 3)),
        (1, (0, 5, 6, 7, 8, 10)),
    ]
    too_long_b = trace_slice(TRACE, 3, min_turns=2, max_blocks=5)
    assert {c for c, _ in too_long_b} == {0}


def test_a_slice_the_trace_cannot_fill_is_refused() -> None:
    with pytest.raises(ConfigError, match="only 5 requests"):
        trace_slice(TRACE, 6, min_turns=2, max_blocks=10)


def test_equal_blocks_become_equal_token_ids() -> None:
    turns = to_turns(trace_slice(TRACE, 3, 2, 10), block_tokens=32, vocab=100)
    assert turns[2].prompt[: 3 * 32] == turns[0].prompt
    assert turns[1].prompt[:32] == turns[0].prompt[:32]  # the shared system block
    assert all(0 <= t < 100 for turn in turns for t in turn.prompt)


def test_engine_counters_sum_over_label_sets() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total x\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0\n'
        'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n'
    )
    assert metric_sum(text, "vllm:prefix_cache_hits_total") == 100.0


def test_engine_counters_can_be_picked_by_label() -> None:
    text = (
        'kvmesh_engine_event_gaps_total{engine="engine-0",outcome="healed"} 2.0\n'
        'kvmesh_engine_event_gaps_total{engine="engine-1",outcome="uncovered"} 1.0\n'
        'kvmesh_engine_event_gaps_total{engine="engine-1",outcome="healed"} 3.0\n'
    )
    assert metric_sum(text, "kvmesh_engine_event_gaps_total", outcome="healed") == 5.0
    assert metric_sum(text, "kvmesh_engine_event_gaps_total", engine="engine-1") == 4.0


def test_a_policy_can_run_with_a_coordinator_setting_changed_for_its_gateway() -> None:
    assert policy_setting("kv_aware") == PolicySetting("kv_aware")
    assert policy_setting("approx_prefix[queue_weight=0.5; max_load_ratio=2]") == PolicySetting(
        "approx_prefix", {"KVMESH_QUEUE_WEIGHT": "0.5", "KVMESH_MAX_LOAD_RATIO": "2"}
    )
    assert policy_setting("kv_aware[shared_prefix_blocks=1;queue_weight=0.5]") == PolicySetting(
        "kv_aware", {"KVMESH_QUEUE_WEIGHT": "0.5"}, ("--shared-prefix-blocks", "1")
    )
    assert policy_setting("kv_aware[placement=cost]") == PolicySetting(
        "kv_aware", {}, ("--placement", "cost")
    )
    with pytest.raises(ConfigError, match="NAME\\[field=value\\]"):
        policy_setting("kv_aware[queue_weight=0.5")
    with pytest.raises(ConfigError, match=r"'qw' is no CoordinatorConfig field .* gateway setting"):
        policy_setting("kv_aware[qw=1]")
    with pytest.raises(ConfigError, match="is not field=value"):
        policy_setting("kv_aware[queue_weight]")


# ----------------------------------------------------------------------------- readings of the slice


def turn(*blocks: int, last: float = 1.0) -> TraceRequest:
    """A request whose last trace block holds `last` of its 512 tokens."""
    return TraceRequest(0, int((len(blocks) - 1 + last) * 512), 1, blocks)


LONG_TURN = [
    turn(0, 1, 2),  # A, turn 1
    turn(0, 5, 6),  # B, turn 1
    turn(0, 1, 2, 3, 4, 7, 8),  # A, turn 2: too long for 6 blocks
    turn(0, 5, 6, 9),  # B, turn 2
    turn(0, 1, 2, 3),  # A, turn 3 (extends turn 1: a retry of a shorter prompt)
    turn(0, 5, 6, 9, 10),  # B, turn 3
    turn(0, 11, 12),  # C, turn 1: a conversation of one turn
]


def test_fitting_requests_leave_out_only_the_prompts_too_long_for_the_context() -> None:
    picked = trace_slice(LONG_TURN, 5, min_turns=3, max_blocks=6, kind="fitting-requests")
    assert [r.hash_ids for _, r in picked] == [
        (0, 1, 2),
        (0, 5, 6),
        (0, 5, 6, 9),
        (0, 1, 2, 3),
        (0, 5, 6, 9, 10),
    ]


def test_fitting_conversations_leave_out_a_conversation_with_any_prompt_too_long() -> None:
    picked = trace_slice(LONG_TURN, 3, min_turns=3, max_blocks=6, kind="fitting-conversations")
    assert {c for c, _ in picked} == {1}
    with pytest.raises(ConfigError, match=r"only 3 requests .*fitting-conversations"):
        trace_slice(LONG_TURN, 4, min_turns=3, max_blocks=6, kind="fitting-conversations")


def test_whole_conversations_take_every_turn_of_the_first_conversations() -> None:
    trace = [
        turn(0, 1, 2),  # A
        turn(0, 5, 6),  # B
        turn(0, 1, 2, 3),  # A
        turn(0, 8, 9),  # C
        turn(0, 5, 6, 7),  # B
        turn(0, 8, 9, 10),  # C
        turn(0, 1, 2, 3, 4),  # A
    ]
    picked = trace_slice(trace, 4, min_turns=2, max_blocks=10, kind="whole-conversations")
    # A (3 turns) and B (2 turns) fill 4 requests; C, which starts before B's second turn,
    # is not taken, and the fifth request (A's third turn) is cut.
    assert [r.hash_ids for _, r in picked] == [(0, 1, 2), (0, 5, 6), (0, 1, 2, 3), (0, 5, 6, 7)]
    first_requests = trace_slice(trace, 4, min_turns=2, max_blocks=10)
    assert (0, 8, 9) in [r.hash_ids for _, r in first_requests]


def test_an_unknown_slice_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown slice 'first'.*fitting-requests"):
        trace_slice(LONG_TURN, 2, min_turns=2, max_blocks=6, kind="first")


def test_a_prompt_ends_inside_its_last_block_as_the_trace_says() -> None:
    quarter = turn(0, 1, 2, last=0.25)
    assert prompt_tokens(quarter, 32, full_blocks=False) == 2 * 32 + 8
    assert prompt_tokens(quarter, 32, full_blocks=True) == 3 * 32
    assert prompt_tokens(TraceRequest(0, 513, 1, (0, 1)), 32, full_blocks=False) == 33  # ceil
    # a trace that says more tokens than its blocks hold is cut to its blocks
    assert prompt_tokens(TraceRequest(0, 9000, 1, (0, 1)), 32, full_blocks=False) == 64


def test_turns_are_cut_to_their_prompt_length() -> None:
    picked = [(0, turn(0, 1, 2, last=0.5)), (0, turn(0, 1, 2, 3, last=0.5))]
    partial = to_turns(picked, block_tokens=32, vocab=100, full_blocks=False)
    assert [len(t.prompt) for t in partial] == [80, 112]
    assert partial[1].prompt[:64] == partial[0].prompt[:64]  # the shared full blocks
    assert partial[1].prompt[64:80] == partial[0].prompt[64:80]  # block 2's first half
    full = to_turns(picked, block_tokens=32, vocab=100, full_blocks=True)
    assert [len(t.prompt) for t in full] == [96, 128]


# ----------------------------------------------------------------------------- cache replays


def test_the_pool_evicts_a_prompts_tail_before_its_head() -> None:
    pool = LRUBlockPool(capacity=3)
    assert pool.serve([(0,), (0, 1)]) == 0
    assert pool.serve([(5,), (5, 6)]) == 0  # evicts (0, 1), then (0,) would be next
    assert pool.serve([(0,), (0, 1)]) == 1  # the head outlived the tail
    assert pool.serve([(5,), (5, 6)]) == 1  # (5, 6) went for (0, 1); its head (5,) stayed


def test_hits_count_full_leading_blocks_in_tokens_and_never_the_last_token() -> None:
    def p(conv: int, blocks: tuple[int, ...], tokens: int) -> SlicePrompt:
        return SlicePrompt(conv, blocks, tokens)

    prompts = [p(0, (0, 1), 64), p(0, (0, 1), 64), p(0, (0, 1, 2), 80)]
    # the repeat hits its first block only (its last token is computed); the third hits both
    # full blocks and its 16-token partial block is a query that never hits
    expected = (0 + 32 + 64) / (64 + 64 + 80)
    assert lru_hit_rate(prompts, [LRUBlockPool(0)], lambda i, q: 0, 32) == pytest.approx(expected)


def test_round_robin_splits_a_conversation_that_pinning_keeps_together() -> None:
    a = [SlicePrompt(0, tuple(range(k)), 32 * k) for k in (2, 3, 4, 5)]
    r = cache_replays(a, block_tokens=32, engine_blocks=100)
    # pinned and one pool reuse each previous turn: 0 + 2 + 3 + 4 of 14 blocks queried
    assert r.bound == r.pinned == r.shared == pytest.approx(9 / 14)
    # round robin: turns 1 and 3 on one engine, 2 and 4 on the other (each hits two turns back)
    assert r.round_robin == pytest.approx((2 + 3) / 14)


def test_pinning_balances_conversations_across_engines() -> None:
    assign = pinned_by_count(2)
    prompts = [SlicePrompt(c, (c,), 32) for c in (7, 3, 7, 9, 3, 4)]
    assert [assign(i, p) for i, p in enumerate(prompts)] == [0, 1, 0, 0, 1, 1]


def test_the_default_slice_of_the_bundled_trace_matches_the_issues_round_robin_rate() -> None:
    """Issue #13 measured round robin at 0.40 and the history router at 0.60-0.68 on its slice;
    the default reading must keep those within reach (the slice before gave 0.35 and 0.60)."""
    reqs = load_trace()
    picked = trace_slice(reqs, 250, min_turns=8, max_blocks=127, kind="fitting-requests")
    r = cache_replays(slice_prompts(picked, 32, full_blocks=False), 32, 384)
    assert len({c for c, _ in picked}) == 47
    assert r.round_robin == pytest.approx(0.396, abs=0.001)
    assert (r.bound, r.pinned, r.shared) == pytest.approx((0.761, 0.607, 0.673), abs=0.001)
    old = trace_slice(reqs, 250, min_turns=8, max_blocks=127, kind="fitting-conversations")
    r_old = cache_replays(slice_prompts(old, 32, full_blocks=True), 32, 384)
    assert (r_old.bound, r_old.round_robin) == pytest.approx((0.722, 0.349), abs=0.001)


def test_bench_engines_slices_prints_every_reading_without_an_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "engines", "--slices", "--requests", "100"]) == 0
    rows = capsys.readouterr().out.splitlines()
    readings = [(row.split()[0], row.split()[1]) for row in rows[1:-1]]
    assert readings == [(kind, last) for kind in SLICES for last in ("partial", "full")]
    first = rows[1].split()
    assert first[2:4] == ["100", str(len({c for c, _ in fitting_100()}))]


def fitting_100() -> list[tuple[int, TraceRequest]]:
    return trace_slice(load_trace(), 100, min_turns=8, max_blocks=127, kind="fitting-requests")


def test_bench_engines_refuses_an_unknown_slice_before_starting_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "engines", "--slice", "first-requests"])
    assert "invalid choice: 'first-requests'" in capsys.readouterr().err


def test_the_table_sets_ttft_beside_the_prefill_work_each_policy_left(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def measured(ttft_s: float, hits: float, queries: float) -> Measured:
        m = Measured(Replay(ttfts=[ttft_s] * 4), wall_s=1.0, rounds=1)
        m.hits, m.queries, m.external = {"engine-0": hits}, {"engine-0": queries}, {"engine-0": 0.0}
        return m

    kv = summarize("kv_aware", measured(0.1, hits=600, queries=1000), bound=0.7)
    rr = summarize("round_robin", measured(0.3, hits=200, queries=1000), bound=0.7)
    assert kv.computed_tokens_per_request == 100  # (1000 - 600) tokens over 4 requests
    assert rr.computed_tokens_per_request == 200
    print_table([kv, rr], argparse.Namespace(rate=None, concurrency=4), "slice")
    out = capsys.readouterr().out
    assert (
        "mean TTFT round_robin / kv_aware = 3.00x (prompt tokens computed per request: 2.00x)"
        in out
    )
    assert "gateway replicas" not in out  # one gateway: nothing to say
    print_table([kv, rr], argparse.Namespace(rate=None, concurrency=4, gateways=2), "slice")
    assert "2 gateway replicas per policy, requests sent to each in turn" in capsys.readouterr().out
