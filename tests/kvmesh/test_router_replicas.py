"""The router replicas' names and handles, found on a real (one-node) Ray cluster.

The named actors here stand in for routers: `router_handles` only looks names
up, so what answers behind a name is not what these tests are about.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import pytest

from kvmesh.config import CoordinatorConfig
from kvmesh.errors import NoWorkers
from kvmesh.router_replicas import router_actor_name, router_handles, shard_actor_name

ray = pytest.importorskip("ray")
cloudpickle = pytest.importorskip("ray.cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tests folder is no package

pytestmark = pytest.mark.ray


class Named:
    """A router's stand-in: answers which replica it was started as."""

    def __init__(self, replica: int) -> None:
        self.replica = replica

    def which(self) -> int:
        return self.replica


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def three_replicas() -> CoordinatorConfig:
    return CoordinatorConfig(namespace=f"t{uuid.uuid4().hex[:8]}", router_replicas=3)


def start_routers(cfg: CoordinatorConfig, replicas: list[int]) -> list[object]:
    remote = ray.remote(num_cpus=0)(Named)
    return [
        remote.options(name=router_actor_name(cfg, r), namespace=cfg.namespace).remote(r)
        for r in replicas
    ]


def test_replica_zero_keeps_the_coordinators_name_and_the_others_are_numbered() -> None:
    cfg = CoordinatorConfig(actor_name="kv", router_replicas=3)
    assert [router_actor_name(cfg, r) for r in range(3)] == ["kv", "kv-router-1", "kv-router-2"]
    assert shard_actor_name(cfg, 1, 2) == "kv-r1-s2"


def test_every_running_replica_is_found_replica_zero_first(ray_cluster: None) -> None:
    cfg = three_replicas()
    held = start_routers(cfg, [2, 0, 1])
    found = router_handles(cfg)
    assert ray.get([h.which.remote() for h in found], timeout=60) == [0, 1, 2]
    del held


def test_a_failover_asks_the_other_replicas_even_when_replica_zeros_name_is_gone(
    ray_cluster: None,
) -> None:
    cfg = three_replicas()
    held = start_routers(cfg, [1, 2])  # replica 0 killed for good: Ray forgot its name
    others = router_handles(cfg, range(1, cfg.router_replicas))
    assert ray.get([h.which.remote() for h in others], timeout=60) == [1, 2]
    del held


def test_no_running_replica_is_no_workers_naming_the_namespace(ray_cluster: None) -> None:
    cfg = three_replicas()
    start_routers(cfg, [0])
    with pytest.raises(
        NoWorkers, match=rf"no coordinator router runs in namespace '{cfg.namespace}'"
    ):
        router_handles(cfg, [1, 2])
