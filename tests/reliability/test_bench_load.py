"""`kvmesh bench load` with tiny settings: a real embedded Ray cluster, real clients."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvmesh.benchmarks import bench_load
from kvmesh.benchmarks.cli import BENCHES

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

TINY = [
    "--clients", "3",
    "--duration", "1.5",
    "--baseline-duration", "1",
    "--route-duration", "0.5",
    "--workers", "2",
    "--num-pages", "24",
    "--prefixes", "3",
    "--prefix-pages", "2",
    "--suffix-tokens", "20",
    "--max-tokens", "2",
    "--warmup", "20",
    "--warmup-cycles", "1",
]  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_load.configure(parser)
    return parser.parse_args(argv)


def test_load_is_registered_as_a_bench() -> None:
    assert BENCHES["load"][0] == "kvmesh.benchmarks.bench_load"


def test_rss_of_this_process_is_read_in_mib() -> None:
    mb = bench_load.rss_mb(os.getpid())
    assert 1.0 < mb < 1_000_000.0


@pytest.mark.parametrize("argv", [["--num-pages", "4"]])
def test_bad_settings_are_refused_before_any_cluster_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_load.run(parse(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmesh bench load: ")
    assert "must" in err or "too small" in err


@pytest.mark.parametrize("argv", [["--clients", "0"], ["--duration", "0"], ["--max-tokens", "0"]])
def test_a_count_or_duration_out_of_range_is_a_usage_error_of_its_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):  # kvmesh.arguments' types, before run() is reached
        parse(argv)
    assert f"argument {argv[0]}: must be a positive" in capsys.readouterr().err


def test_json_reports_throughput_latency_errors_and_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # the bench starts (and stops) its own embedded cluster
        ray.shutdown()
    assert bench_load.run(parse([*TINY, "--json"])) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(out) == 1
    fig = json.loads(out[0])
    assert fig["errors"] == 0
    assert fig["baseline_errors"] == 0
    assert fig["route_errors"] == 0
    assert fig["requests"] > 0
    assert fig["requests_per_s"] > 0
    assert fig["baseline_requests_per_s"] > 0
    assert fig["speedup_vs_single_client"] == pytest.approx(
        fig["requests_per_s"] / fig["baseline_requests_per_s"]
    )
    assert fig["route_decisions_per_s"] > 0
    assert fig["route_decisions_per_s_single"] > 0
    assert 0 < fig["latency_p50_ms"] <= fig["latency_p99_ms"]
    assert fig["pool_cycles_before"] >= 1.0  # the pools were full before memory was read
    assert set(fig["rss_by_process_mb"]) == {"coordinator", "worker-0", "worker-1"}
    for before, after in fig["rss_by_process_mb"].values():
        assert before > 0
        assert after > 0
    assert fig["rss_before_mb"] == pytest.approx(
        sum(b for b, _ in fig["rss_by_process_mb"].values())
    )
    assert fig["rss_after_mb"] == pytest.approx(
        sum(a for _, a in fig["rss_by_process_mb"].values())
    )
    trace = fig["rss_trace_mb"]
    assert len(trace) >= 2 and all(mb > 0 for mb in trace)
    assert trace[-1] == pytest.approx(fig["rss_after_mb"])
    assert not ray.is_initialized()  # the bench stopped the cluster it started
