"""The bundled trace and its deterministic tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.errors import InvalidInput
from kvmesh.trace import (
    TraceRequest,
    block_tokens,
    blocks_tokens,
    bundled_trace_path,
    infinite_cache_hit_ratio,
    load_trace,
    request_tokens,
)


def test_bundled_trace_is_the_full_conversation_trace() -> None:
    reqs = load_trace()
    assert bundled_trace_path().is_file()
    assert len(reqs) == 12031
    assert sum(len(r.hash_ids) for r in reqs) == 288500
    assert abs(infinite_cache_hit_ratio(reqs) - 0.366) < 0.001


def test_limit_reads_a_prefix_of_the_trace() -> None:
    reqs = load_trace(limit=5)
    assert len(reqs) == 5 and reqs[0].hash_ids[0] == 0


def test_equal_block_ids_give_equal_tokens_and_different_ids_differ() -> None:
    assert block_tokens(7, 16) == block_tokens(7, 16)
    assert block_tokens(7, 16) != block_tokens(8, 16)
    assert all(0 <= t < 256 for t in block_tokens(123, 512, vocab_size=256))


def test_blocks_tokens_equal_one_block_at_a_time_even_for_huge_ids() -> None:
    ids = [0, 1, 7, 123_456, 2**31 + 5, 2**40 + 3]
    many = blocks_tokens(ids, 64)
    for b in ids:
        base = (b * 2654435761 + 97) & 0xFFFFFFFF
        assert many[b] == [((base + i * 40503) ^ (base >> 7)) % 32000 for i in range(64)]
        assert block_tokens(b, 64) == many[b]


def test_request_tokens_are_truncated_to_the_input_length() -> None:
    req = TraceRequest(0, 20, 1, (1, 2))
    toks = request_tokens(req, 16)
    assert len(toks) == 20 and toks[:16] == block_tokens(1, 16)


def test_infinite_cache_counts_prefix_reuse_only() -> None:
    reqs = [
        TraceRequest(0, 0, 0, (1, 2)),
        TraceRequest(0, 0, 0, (1, 3)),
        TraceRequest(0, 0, 0, (4, 2)),
    ]
    assert infinite_cache_hit_ratio(reqs) == pytest.approx(1 / 6)


def test_bad_trace_files_give_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:1"):
        load_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InvalidInput, match="no requests"):
        load_trace(empty)
