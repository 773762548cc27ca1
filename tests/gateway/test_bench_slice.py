"""The slice `kvmesh bench engines` replays: conversations found in the trace, in trace order."""

from __future__ import annotations

import pytest

from kvmesh.benchmarks.bench_engines import (
    conversations,
    metric_sum,
    policy_setting,
    to_turns,
    trace_slice,
)
from kvmesh.errors import ConfigError
from kvmesh.trace import TraceRequest


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
    assert policy_setting("kv_aware") == ("kv_aware", {})
    assert policy_setting("approx_prefix[queue_weight=0.5; max_load_ratio=2]") == (
        "approx_prefix",
        {"KVMESH_QUEUE_WEIGHT": "0.5", "KVMESH_MAX_LOAD_RATIO": "2"},
    )
    with pytest.raises(ConfigError, match="NAME\\[field=value\\]"):
        policy_setting("kv_aware[queue_weight=0.5")
    with pytest.raises(ConfigError, match="'qw' is no CoordinatorConfig field"):
        policy_setting("kv_aware[qw=1]")
    with pytest.raises(ConfigError, match="is not field=value"):
        policy_setting("kv_aware[queue_weight]")
