"""`kvmesh bench transfer` with tiny sizes: real peer process, real tcp / gRPC / gloo."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh.benchmarks import bench_transfer
from kvmesh.benchmarks.cli import BENCHES
from kvmesh.errors import ConfigError

TINY = ["--pages", "6", "--page-bytes", str(1 << 20), "--rounds", "2", "--timeout", "60"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_transfer.configure(parser)
    return parser.parse_args(argv)


def test_transfer_is_registered_as_a_bench() -> None:
    assert BENCHES["transfer"][0] == "kvmesh.benchmarks.bench_transfer"


def test_json_gives_one_object_per_transport_with_a_ratio_to_tcp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        bench_transfer.run(
            parse([*TINY, "--transport", "both", "--json", "--batch-bytes", str(2 << 20)])
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [obj["transport"] for obj in lines] == ["tcp", "grpc", "dist"]
    for obj in lines:
        assert obj["gb_per_s"] > 0
        assert obj["pages_per_s"] > 0
        assert obj["ratio_vs_tcp"] > 0
        assert (obj["pages"], obj["page_bytes"], obj["bytes"]) == (6, 1 << 20, 6 << 20)
        assert obj["rounds"] == 2
        assert obj["median_ratio_vs_tcp"] > 0
        # Both processes did work for every transport; measured, not filled in.
        assert obj["puller_cpu_s_per_gib"] > 0 and obj["peer_cpu_s_per_gib"] > 0
    assert lines[0]["ratio_vs_tcp"] == 1.0
    assert lines[0]["median_ratio_vs_tcp"] == 1.0
    tcp = lines[0]["gb_per_s"]
    for obj in lines[1:]:
        assert obj["ratio_vs_tcp"] == pytest.approx(obj["gb_per_s"] / tcp, rel=0.05)


def test_table_shows_every_transport_next_to_tcp() -> None:
    spec = bench_transfer.spec_from_args(parse(TINY))
    figures = [
        bench_transfer.Figure(
            name, rate, rate * 1e3, rate / 2.0, 0.1, rate, 6, 4096, 24576, 2, name
        )
        for name, rate in (("tcp", 2.0), ("grpc", 0.5), ("dist", 1.5))
    ]
    rows = bench_transfer.render(spec, figures).splitlines()
    assert "vs tcp" in rows[1]
    assert rows[-1].startswith("vs tcp: best round / tcp's best round")  # the legend
    assert [row.split()[:4] for row in rows[2:-1]] == [
        ["tcp", "2.00", "2000", "100%"],
        ["grpc", "0.50", "500", "25%"],
        ["dist", "1.50", "1500", "75%"],
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--page-bytes", "100"],
        ["--page-bytes", "4096", "--batch-bytes", "1024"],
    ],
)
def test_impossible_sizes_are_refused_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        bench_transfer.spec_from_args(parse(argv))


def test_a_count_below_one_is_a_usage_error_of_its_flag() -> None:
    with pytest.raises(SystemExit):  # kvmesh.arguments.positive_int
        parse(["--pages", "0"])


def test_grpc_flags_and_kvmesh_variables_reach_both_processes_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVMESH_GRPC_FRAME_BYTES", str(1 << 20))
    monkeypatch.setenv("KVMESH_FETCH_STREAMS", "5")
    spec = bench_transfer.spec_from_args(
        parse([*TINY, "--grpc-malloc-tune", "--grpc-streams", "3"])
    )
    config = bench_transfer._transfer_config(spec)
    assert config.grpc_frame_bytes == 1 << 20  # from the environment
    assert config.fetch_streams == 3  # a flag wins over its variable
    assert config.grpc_malloc_tune
    assert (config.host, config.port, config.deadline_s) == ("127.0.0.1", 0, 60.0)
    default = bench_transfer._transfer_config(bench_transfer.spec_from_args(parse(TINY)))
    assert not default.grpc_malloc_tune


def test_the_table_header_names_the_machine_load() -> None:
    spec = bench_transfer.spec_from_args(parse(TINY))
    fig = bench_transfer.Figure("tcp", 2.0, 2e3, 1.0, 0.1, 2.0, 6, 4096, 24576, 2, "tcp", 1.25, 1.5)
    assert (
        "1-min load 1.25 before, 1.50 after" in bench_transfer.render(spec, [fig]).splitlines()[0]
    )


def test_the_median_ratio_pairs_each_round_with_tcp_in_the_same_round() -> None:
    """Load that comes and goes moves both sides of a round's ratio: tcp's one lucky round
    sets the best-vs-best ratio, not the median of the rounds."""
    spec = bench_transfer.spec_from_args(parse(TINY))
    times = {"tcp": [1.0, 4.0, 4.0], "grpc": [2.0, 4.0, 5.0]}
    cpu = {"tcp": [(0.1, 0.2)] * 3, "grpc": [(0.2, 0.3), (0.4, 0.6), (0.3, 0.3)]}
    tcp, grpc = bench_transfer._figures(spec, times, {"tcp": "", "grpc": ""}, cpu=cpu)
    assert grpc.ratio_vs_tcp == pytest.approx(0.5)  # best 2.0 vs tcp's best 1.0
    assert grpc.median_ratio_vs_tcp == pytest.approx(0.8)  # of 0.5, 1.0, 0.8
    assert tcp.median_ratio_vs_tcp == 1.0
    gib = spec.pages * spec.page_bytes / 2**30
    assert grpc.puller_cpu_s_per_gib == pytest.approx(0.3 / gib)
    assert grpc.peer_cpu_s_per_gib == pytest.approx(0.4 / gib)
    row = bench_transfer.render(spec, [tcp, grpc]).splitlines()[3].split()
    assert row[5] == "80%" and row[6] == f"{0.3 / gib:.2f}+{0.4 / gib:.2f}"
