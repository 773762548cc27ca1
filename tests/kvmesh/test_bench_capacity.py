"""`kvmesh bench capacity` runs both sides of its ratios on a trace slice."""

from __future__ import annotations

import json

import pytest

from kvmesh.app.cli import main


def test_bench_capacity_prints_every_figure_and_its_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["bench", "capacity", "--limit", "40", "--workers", "2", "--capacity-pages", "300"]
    assert main([*args, "--host-pages", "300", "--flood", "1", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    tiers, tenants = figures["tiers"], figures["tenants"]
    assert tiers["reuse_vs_large"] == pytest.approx(
        tiers["tiered"]["reuse_ratio"] / tiers["device_large"]["reuse_ratio"]
    )
    assert tiers["device_small"]["reuse_ratio"] <= tiers["device_large"]["reuse_ratio"]
    for eviction in ("lru", "fair"):
        r = tenants[eviction]
        assert r["vs_alone"] == pytest.approx(r["hit_ratio"] / tenants["alone"])
