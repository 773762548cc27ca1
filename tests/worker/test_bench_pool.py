"""`kvmesh bench pool` on a small slice of the bundled trace: keys, sane and equal hit ratios."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh.benchmarks import bench_pool
from kvmesh.trace import infinite_cache_hit_ratio, load_trace

LIMIT = 40


@pytest.fixture(scope="module")
def small() -> dict[str, float]:
    return bench_pool.measure(None, num_pages=64, limit=LIMIT, hash_pages=20)


@pytest.fixture(scope="module")
def roomy() -> dict[str, float]:
    return bench_pool.measure(None, num_pages=4096, limit=LIMIT, hash_pages=20)


def test_json_output_has_the_promised_keys(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_pool.configure(parser)
    args = parser.parse_args(["--limit", "8", "--pages", "128", "--hash-pages", "10", "--json"])
    assert bench_pool.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "requests",
        "page_hit_ratio",
        "bound_hit_ratio",
        "page_ops_per_s",
        "baseline_page_ops_per_s",
        "speedup_vs_baseline",
        "page_ops_per_s_hash_only_events",
        "baseline_page_ops_per_s_hash_only_events",
        "sha256_tokens_per_s",
        "xxh3_tokens_per_s",
    ):
        assert key in out, key
    assert out["requests"] == 8
    assert out["page_ops_per_s"] > 0 and out["sha256_tokens_per_s"] > 0


def test_the_human_output_is_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_pool.configure(parser)
    assert bench_pool.run(parser.parse_args(["--limit", "4", "--hash-pages", "10"])) == 0
    out = capsys.readouterr().out
    assert "page_hit_ratio" in out and "sha256_tokens_per_s" in out


def test_pool_and_baseline_reach_the_same_hit_ratio(small: dict[str, float]) -> None:
    assert small["requests"] == LIMIT  # a few prompts exceed 63 pages and are turned away
    assert small["page_hit_ratio"] == small["baseline_page_hit_ratio"]
    assert small["page_hit_ratio_hash_only_events"] == small["page_hit_ratio"]


def test_hit_ratios_stay_below_the_infinite_cache_bound(
    small: dict[str, float], roomy: dict[str, float]
) -> None:
    bound = infinite_cache_hit_ratio(load_trace(None, LIMIT))
    assert small["bound_hit_ratio"] == bound
    assert 0.0 < small["page_hit_ratio"] <= roomy["page_hit_ratio"] <= bound


def test_a_pool_that_never_evicts_hits_every_repeated_full_block(roomy: dict[str, float]) -> None:
    # With room for the whole slice, a block hits exactly when its prefix was
    # seen before, unless it holds the prompt's last token or is partial.
    reqs = load_trace(None, LIMIT)
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in reqs:
        full = min(r.input_length // 512, len(r.hash_ids))
        max_pages = min((r.input_length - 1) // 512, full)
        for i in range(len(r.hash_ids)):
            total += 1
            prefix = r.hash_ids[: i + 1]
            if (
                i < max_pages
                and prefix in seen
                and all(r.hash_ids[:j] in seen for j in range(1, i + 1))
            ):
                hits += 1
        seen.update(r.hash_ids[: j + 1] for j in range(full))
    assert roomy["page_hit_ratio"] == pytest.approx(hits / total)
    assert roomy["events"] > 0 and roomy["page_ops"] == (
        roomy["lookups"] + roomy["allocations"] + roomy["frees"]
    )
