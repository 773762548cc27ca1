"""A real cluster's actors export kvmesh's metrics through Ray's metrics API.

Ray's metrics agent serves every actor's ``ray.util.metrics`` on the node's
Prometheus endpoint (``_metrics_export_port``), with Ray's ``ray_`` prefix;
the scrape is parsed with prometheus-client's parser, as Prometheus would.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.app import connect
from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, PoolConfig
from kvmesh.metrics import RAY_PREFIX

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

CONFIG = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=128))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[KVMesh, int]]:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        namespace=CONFIG.coordinator.namespace,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    mesh = connect(num_workers=2, config=CONFIG)
    try:
        yield mesh, port
    finally:
        mesh.close()
        ray.shutdown()


def scrape(port: int) -> dict[str, list[Any]]:
    """Samples by sample name (``ray_`` prefix removed) from the node's endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(RAY_PREFIX + "kvmesh_"):
                out.setdefault(s.name.removeprefix(RAY_PREFIX), []).append(s)
    return out


def total(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


def scrape_until(port: int, ready: Callable[[dict[str, list[Any]]], bool]) -> dict[str, list[Any]]:
    """Each process exports every report interval, on its own clock: scrape until `ready`
    holds for the scrape (or 60 s passed; the caller's asserts then say what is missing)."""
    deadline = time.monotonic() + 60.0
    while True:
        samples = scrape(port)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_the_node_endpoint_serves_the_workers_and_the_coordinators_metrics(
    cluster: tuple[KVMesh, int],
) -> None:
    mesh, port = cluster
    prompt = list(range(16 * 5 + 3))
    first = mesh.generate(prompt, max_tokens=2)
    second = mesh.generate(prompt, max_tokens=2)
    assert second.pages_hit_local == 5
    me = CONFIG.coordinator.actor_name

    def observed(samples: dict[str, list[Any]]) -> dict[str, float]:
        free = [s for s in samples.get("kvmesh_pool_pages", []) if s.labels["state"] == "free"]
        return {
            "requests": total(samples, "kvmesh_worker_requests_total"),
            "first worker's": total(
                samples, "kvmesh_worker_requests_total", worker=first.worker_id
            ),
            "local pages": total(samples, "kvmesh_prompt_pages_total", source="local"),
            "computed pages": total(samples, "kvmesh_prompt_pages_total", source="computed"),
            "routes": total(samples, "kvmesh_routes_total", coordinator=me),
            "route decisions timed": total(samples, "kvmesh_route_seconds_count"),
            "predicted local pages": total(samples, "kvmesh_predicted_pages_total", kind="local"),
            "event batches >= 2": float(total(samples, "kvmesh_event_batches_total") >= 2),
            "workers with a free-page gauge": len({s.labels["worker"] for s in free}),
            "free gauges in range": float(all(0 < s.value <= 127 for s in free)),
        }

    expected = {
        "requests": 2,
        "first worker's": 2,
        "local pages": 5,
        "computed pages": 7,
        "routes": 2,
        "route decisions timed": 2,
        "predicted local pages": 5,
        "event batches >= 2": 1,
        "workers with a free-page gauge": 2,
        "free gauges in range": 1,
    }
    samples = scrape_until(port, lambda samples: observed(samples) == expected)
    assert observed(samples) == expected


def test_status_watch_draws_the_real_clusters_workers(cluster: tuple[KVMesh, int]) -> None:
    from rich.console import Console

    from kvmesh.app.watch import watch

    mesh, _ = cluster
    console = Console(record=True, width=200)
    assert watch(mesh, console, 0.05, rounds=2) == 2
    text = console.export_text()
    for worker in mesh.stats().workers:
        assert f"│ {worker.worker_id}" in text
    assert "routes " in text and "req/s" in text
