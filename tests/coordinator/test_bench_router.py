"""`kvmesh bench router --shards` on a tiny index: one object per shard count with the issue's keys."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from typing import Any

import pytest

from kvmesh.benchmarks import bench_router
from kvmesh.coordinator.shards import ShardedCoordinator
from kvmesh.errors import InvalidInput


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_router.configure(parser)
    return parser.parse_args(list(argv))


def test_sharded_json_has_one_object_per_shard_count_with_the_promised_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _args(
        "--workers", "8", "--pages", "3000", "--routes", "60", "--shards", "1,2", "--no-ray",
        "--json",
    )  # fmt: skip
    assert bench_router.run(args) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["shards"] for r in results] == [1, 2]
    for r in results:
        for key in (
            "route_p99_ms",
            "route_cpu_p99_ms",
            "index_ops_per_s",
            "index_ops_per_cpu_s",
            "ingest_page_events_per_s",
            "cpu_s_per_million_ops",
            "bytes_per_page",
            "cpu_per_op_ratio_vs_first",
            "batched_cpu_s_per_million_ops",
            "batched_route_cpu_us_per_call",
            "batched_cpu_per_op_ratio_vs_first",
        ):
            assert r[key] > 0, key
        assert r["route_batch"] == 16
        assert "failover_gap_ms" not in r  # measured on Ray only
        assert r["route_cpu_p50_ms"] <= r["route_cpu_p99_ms"]
    assert results[0]["cpu_per_op_ratio_vs_first"] == 1.0
    assert results[0]["batched_cpu_per_op_ratio_vs_first"] == 1.0
    for prefix in ("", "batched_"):
        assert results[0][f"{prefix}cpu_per_op_ratio_paired_median"] == 1.0
        assert results[0][f"{prefix}cpu_per_op_ratio_paired_range"] == [1.0, 1.0]
        low, high = results[1][f"{prefix}cpu_per_op_ratio_paired_range"]
        assert 0 < low <= results[1][f"{prefix}cpu_per_op_ratio_paired_median"] <= high


def test_the_table_says_where_each_route_latency_was_measured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _args(
        "--workers", "4", "--pages", "1000", "--routes", "20", "--shards", "1", "--no-ray",
        "--no-memory",
    )  # fmt: skip
    assert bench_router.run(args) == 0
    table = capsys.readouterr().out
    assert "route p99 ms (in process)" in table
    assert "route_p99_ms" not in table


def test_a_route_batch_below_one_is_refused() -> None:
    with pytest.raises(SystemExit):
        _args("--shards", "1,2", "--route-batch", "0")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--workers", "8,1"), "each worker count must be at least 2, got '8,1'"),
        (("--workers", "8,many"), "expected worker counts like 8,64,256, got '8,many'"),
        (("--shards", "0"), "each shard count must be at least 1, got '0'"),
        (("--shards", "1,two"), "expected shard counts like 1,2,4, got '1,two'"),
    ],
)
def test_a_bad_worker_or_shard_count_list_is_refused_naming_the_count(
    argv: tuple[str, ...], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)
    assert said in capsys.readouterr().err


def test_index_ops_count_every_page_event_and_match() -> None:
    wl = bench_router._Workload(4, 2000, seed=0)
    prompts = wl.prompts(30, random.Random(1))
    out = bench_router._index_ops(wl, prompts)
    assert out["index_ops"] == wl.stored_events + wl.removed_events + 30
    assert out["index_ops_per_cpu_s"] > 0


def test_json_keeps_stdout_for_the_json_whatever_is_printed_while_it_measures(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's "(raylet)" lines, a library's print and a child process writing to descriptor 1
    while the bench measures all land on stderr: stdout is one JSON object per line."""
    measured = bench_router._sharded_in_process

    def noisy(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        print("(raylet) a line from Ray's log thread")
        os.write(1, b"(raylet) straight to descriptor 1\n")
        subprocess.run([sys.executable, "-c", "print('(raylet) from a child process')"], check=True)
        return measured(*args, **kwargs)

    monkeypatch.setattr(bench_router, "_sharded_in_process", noisy)
    args = _args(
        "--workers", "4", "--pages", "1000", "--routes", "20", "--shards", "1,2", "--no-ray",
        "--no-memory", "--json",
    )  # fmt: skip
    assert bench_router.run(args) == 0
    out, err = capfd.readouterr()
    assert [json.loads(line)["shards"] for line in out.splitlines()] == [1, 2]
    assert err.count("(raylet)") == 3
    print("after the run, stdout is stdout again")
    assert capfd.readouterr().out == "after the run, stdout is stdout again\n"


def test_json_of_a_small_run_on_ray_is_pure_json_on_stdout() -> None:
    """The whole bench with its Ray layout, in a process of its own: every line on stdout
    parses as JSON, with the figures measured through Ray."""
    argv = [
        "bench", "router", "--workers", "4", "--pages", "600", "--routes", "30",
        "--ray-pages", "600", "--shards", "1,2", "--no-memory", "--json",
    ]  # fmt: skip
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvmesh.app.cli import main; sys.exit(main())",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["shards"] for r in results] == [1, 2]
    assert all(r["ray_route_p50_ms"] > 0 for r in results)
    # a shard call carries at least one route of the in-flight waves and at most a wave's
    # worth (no more routes than are in flight)
    assert all(1 <= r["ray_in_flight_routes_per_shard_call"] <= 16 for r in results), results


def test_each_cpu_pass_measures_every_shard_count_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shard counts compared meet the same moments of a shared machine: in every pass
    each chunk of stored batches (and each batch of routes) goes to every count in turn,
    the count that goes first rotating, and every count gets every batch in order."""
    calls: list[tuple[str, int, Any]] = []
    report, route_many = ShardedCoordinator.report, ShardedCoordinator.route_many

    def reported(self: ShardedCoordinator, r: Any) -> Any:
        calls.append(("report", len(self.shards), r))
        return report(self, r)

    def routed(self: ShardedCoordinator, queries: Any) -> Any:
        calls.append(("route_many", len(self.shards), queries))
        return route_many(self, queries)

    monkeypatch.setattr(ShardedCoordinator, "report", reported)
    monkeypatch.setattr(ShardedCoordinator, "route_many", routed)
    monkeypatch.setattr(bench_router, "INGEST_CHUNK", 2)
    wl = bench_router._Workload(4, 1000, seed=0)
    prompts = wl.prompts(20, random.Random(1))
    figures = bench_router._sharded_in_process(wl, prompts, [1, 2, 4], 0, 8)
    batches = len(wl.stored_batches)
    assert batches > 4  # several chunks
    per_pass = 3 * batches + 3 * 3  # every batch to each count; 3 route batches to each
    assert len(calls) == bench_router.ROUTE_CPU_PASSES * per_pass
    first = calls[:per_pass]
    reports = [(shards, r.batches) for kind, shards, r in first if kind == "report"]
    for shards in (1, 2, 4):  # each count got every batch, in order
        assert [b for n, b in reports if n == shards] == [(d,) for _, d in wl.stored_batches]
    runs = [
        shards for j, (shards, _) in enumerate(reports) if j == 0 or reports[j - 1][0] != shards
    ]
    chunks = -(-batches // 2)
    assert runs == [[1, 2, 4][(j + k) % 3] for j in range(chunks) for k in range(3)]
    routes = [shards for kind, shards, _ in first if kind == "route_many"]
    assert routes == [1, 2, 4, 2, 4, 1, 4, 1, 2]
    assert [f["route_batch"] for f in figures] == [8, 8, 8]
    assert all(f["batched_route_cpu_us_per_call"] > 0 for f in figures)
    for name in ("route_cpu_ratio", "batched_route_cpu_ratio", "ingest_cpu_ratio"):
        assert figures[0][f"{name}_paired_median"] == 1.0
        low, high = figures[2][f"{name}_paired_range"]
        assert 0 < low <= figures[2][f"{name}_paired_median"] <= high


def test_paired_ratios_compare_the_counts_within_each_pass() -> None:
    """The first count met a fast moment of the machine in one pass and the others never
    did: the least CPU of each count, taken from different passes, reads 2.4 and 3 where
    two passes of three say 1.2 and 1.5."""
    totals = [[1.0, 2.4, 3.0], [2.0, 2.4, 3.0], [2.0, 2.4, 3.0]]
    assert bench_router.paired_ratios(totals) == [(1.0, 1.0, 1.0), (1.2, 1.2, 2.4), (1.5, 1.5, 3.0)]
    least = [min(column) for column in zip(*totals, strict=True)]
    assert [x / least[0] for x in least] == [1.0, 2.4, 3.0]


def test_paired_ratios_refuse_no_passes() -> None:
    with pytest.raises(InvalidInput, match="at least one pass"):
        bench_router.paired_ratios([])
