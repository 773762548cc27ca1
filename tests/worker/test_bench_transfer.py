"""`kvmesh bench transfer` with tiny sizes: real peer process, real tcp / gRPC / gloo."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh.benchmarks import bench_transfer
from kvmesh.benchmarks.cli import BENCHES
from kvmesh.errors import ConfigError

TINY = ["--pages", "6", "--page-bytes", "4096", "--rounds", "2", "--timeout", "60"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_transfer.configure(parser)
    return parser.parse_args(argv)


def test_transfer_is_registered_as_a_bench() -> None:
    assert BENCHES["transfer"][0] == "kvmesh.benchmarks.bench_transfer"


def test_json_gives_one_object_per_transport_with_a_ratio_to_tcp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_transfer.run(parse([*TINY, "--transport", "both", "--json"])) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [obj["transport"] for obj in lines] == ["tcp", "grpc", "dist"]
    for obj in lines:
        assert obj["gb_per_s"] > 0
        assert obj["pages_per_s"] > 0
        assert obj["ratio_vs_tcp"] > 0
        assert (obj["pages"], obj["page_bytes"], obj["bytes"]) == (6, 4096, 6 * 4096)
        assert obj["rounds"] == 2
    assert lines[0]["ratio_vs_tcp"] == 1.0
    tcp = lines[0]["gb_per_s"]
    for obj in lines[1:]:
        assert obj["ratio_vs_tcp"] == pytest.approx(obj["gb_per_s"] / tcp, rel=0.05)


def test_table_shows_the_asked_transport_next_to_tcp(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_transfer.run(parse([*TINY, "--transport", "dist", "--gather"])) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.strip()]
    assert rows == ["tcp", "dist"]
    assert "vs tcp" in out
    assert "gathered" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--page-bytes", "100"],
        ["--pages", "0"],
        ["--page-bytes", "4096", "--batch-bytes", "1024"],
    ],
)
def test_impossible_sizes_are_refused_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        bench_transfer.spec_from_args(parse(argv))
