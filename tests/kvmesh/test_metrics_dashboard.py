"""deploy/grafana-kvmesh.json: every panel reads metrics kvmesh defines, under the name the
process serving it exports (``ray_`` for actors, plain for processes outside Ray)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvmesh.metrics import ALL_METRICS, RAY_PREFIX

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-kvmesh.json"
METRIC_NAME = re.compile(r"\b(?:ray_)?kvmesh_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
OUTSIDE_RAY = ("kvmesh_gateway_", "kvmesh_engine_")  # served by the gateway's own /metrics


def panels() -> list[dict[str, Any]]:
    return list(json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"])


def defined_metric(sample: str) -> str | None:
    """The kvmesh metric a sample name in an expression belongs to; None if none does."""
    name = sample.removeprefix(RAY_PREFIX)
    for metric in ALL_METRICS.values():
        for suffix in SUFFIXES[metric.definition.kind]:
            if name == metric.name + suffix:
                return metric.name
    return None


def test_the_dashboard_has_uniquely_titled_panels_with_queries() -> None:
    found = panels()
    assert len(found) >= 15
    assert len({p["title"] for p in found}) == len(found)
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in found)


@pytest.mark.parametrize("panel", panels(), ids=lambda p: p["title"])
def test_every_metric_a_panel_reads_is_defined_in_kvmesh_metrics(panel: dict[str, Any]) -> None:
    for target in panel["targets"]:
        names = METRIC_NAME.findall(target["expr"])
        assert names, f"{panel['title']}: no kvmesh metric in {target['expr']!r}"
        for sample in names:
            assert defined_metric(sample), f"{panel['title']}: {sample} is not in kvmesh.metrics"
            ray_served = not sample.removeprefix(RAY_PREFIX).startswith(OUTSIDE_RAY)
            assert sample.startswith(RAY_PREFIX) == ray_served, (
                f"{panel['title']}: {sample} is exported "
                + ("through Ray (ray_ prefix)" if ray_served else "by the gateway (no prefix)")
            )


def test_the_issues_metrics_each_have_a_panel() -> None:
    read = {
        defined_metric(s)
        for p in panels()
        for t in p["targets"]
        for s in METRIC_NAME.findall(t["expr"])
    }
    wanted = {
        "kvmesh_pool_pages",
        "kvmesh_prompt_pages",
        "kvmesh_predicted_pages",
        "kvmesh_realized_pages",
        "kvmesh_tier_evictions",
        "kvmesh_transfer_bytes",
        "kvmesh_transfer_seconds",
        "kvmesh_route_seconds",
        "kvmesh_event_lag_seconds",
        "kvmesh_event_gaps",
        "kvmesh_workers",
        "kvmesh_worker_errors",
    }
    assert wanted <= read, f"no panel for {sorted(wanted - read)}"
