"""What one request costs the coordinator, counted by the coordinator actor itself.

A request makes two coordinator calls: the client's `route` (awaited: it
needs the answer) and its worker's `report` (events, load and the route's
outcome, sent before the answer and never waited for). No heartbeat, no
separate `record_result`. A disaggregated request makes one route (both
halves in one `RouteQuery.split` call) and a report from each of its two
workers. Heartbeats are made rare here so that only requests report.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

CONFIG = dataclasses.replace(
    ClusterConfig(),
    pool=PoolConfig(num_pages=128),
    coordinator=CoordinatorConfig(
        namespace="kvmesh-request-path", heartbeat_interval_s=120.0, heartbeat_timeout_s=600.0
    ),
)
REQUESTS = 6


@pytest.fixture(scope="module")
def mesh(fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    return fresh_cluster(num_workers=2, config=CONFIG, num_cpus=2)


SPLIT = dataclasses.replace(
    CONFIG,
    coordinator=dataclasses.replace(CONFIG.coordinator, namespace="kvmesh-request-path-split"),
)


@pytest.fixture(scope="module")
def split_mesh(mesh: KVMesh, fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    return fresh_cluster(config=SPLIT, prefill_workers=1, decode_workers=1)


def coordinator_calls(config: ClusterConfig = CONFIG) -> dict[str, int]:
    import ray

    handle = ray.get_actor(config.coordinator.actor_name, namespace=config.coordinator.namespace)
    calls: dict[str, int] = ray.get(handle.calls.remote(), timeout=30)
    return calls


def settled(
    before: dict[str, int], reports: int, config: ClusterConfig = CONFIG, timeout_s: float = 20.0
) -> dict[str, int]:
    """The calls made since `before`, once `reports` reports arrived (they are not awaited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = coordinator_calls(config)
        made = {m: now.get(m, 0) - before.get(m, 0) for m in {*now, *before}}
        if made.get("report", 0) >= reports or time.monotonic() > deadline:
            return {m: n for m, n in made.items() if n}


def test_a_request_costs_one_route_and_one_report(mesh: KVMesh) -> None:
    rng = random.Random(14)
    prompts: list[Any] = [
        [rng.randrange(CONFIG.model.vocab_size) for _ in range(3 * 16 + 2)]
        for _ in range(REQUESTS // 2)
    ]
    start = coordinator_calls()
    mesh.generate(prompts[0], max_tokens=1)  # warm: the workers' connections, the model
    settled(start, 1)  # its report is not awaited: let it land before counting
    before = coordinator_calls()
    results = [mesh.generate(p, max_tokens=2) for p in prompts + prompts]
    made = settled(before, REQUESTS)
    assert made == {"route": REQUESTS, "report": REQUESTS}
    assert sum(r.pages_hit_local + r.pages_pulled for r in results[REQUESTS // 2 :]) > 0
    # the reports carried the outcomes: every request's promise is counted
    stats = mesh.stats().coordinator
    assert stats["results_recorded"] >= REQUESTS


def test_a_disaggregated_request_costs_one_route_and_a_report_per_worker(
    split_mesh: KVMesh,
) -> None:
    """One route answers both halves (`RouteQuery.split`); the prefill and the decode worker
    each report what they stored, neither report awaited by the answer."""
    rng = random.Random(15)
    prompts = [[rng.randrange(SPLIT.model.vocab_size) for _ in range(2 * 16 + 3)] for _ in range(3)]
    start = coordinator_calls(SPLIT)
    split_mesh.generate(prompts[0], max_tokens=1)  # warm
    settled(start, 2, SPLIT)
    before = coordinator_calls(SPLIT)
    results = [split_mesh.generate(p, max_tokens=2) for p in prompts]
    made = settled(before, 2 * len(prompts), SPLIT)
    assert made == {"route": len(prompts), "report": 2 * len(prompts)}
    assert {r.worker_id for r in results} == {
        w["worker_id"] for w in split_mesh.workers() if w["role"] == "decode"
    }
