"""A request's id travels client -> coordinator -> worker on a real cluster, and the error a
caller sees carries it (`kvmesh.logs.request_scope` in each process)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import ray

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, PoolConfig
from kvmesh.coordination import RouteQuery
from kvmesh.errors import ConfigError, InvalidInput, KVMeshError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

CONFIG = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=64))


@pytest.fixture(scope="module")
def mesh(fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    return fresh_cluster(num_workers=1, config=CONFIG, num_cpus=2)


def cause(exc: BaseException) -> BaseException:
    """The actor's own exception out of Ray's wrapper."""
    inner = getattr(exc, "cause", None)
    return inner if isinstance(inner, BaseException) else exc


def test_the_coordinator_actor_tags_the_error_of_the_route_it_refused(mesh: KVMesh) -> None:
    from kvmesh.coordinator.actor import get_or_create_coordinator

    coordinator: Any = get_or_create_coordinator(CONFIG.coordinator)
    with pytest.raises(Exception) as refused:
        ray.get(
            coordinator.route.remote(RouteQuery([], 16, policy="nope", request_id="req-route-1"))
        )
    err = cause(refused.value)
    assert isinstance(err, ConfigError) and "nope" in str(err)
    assert err.request_id == "req-route-1"


def test_a_request_the_worker_refuses_reaches_the_caller_with_the_clients_id(
    mesh: KVMesh,
) -> None:
    too_long = [1] * (CONFIG.model.max_positions + 1)
    with pytest.raises(InvalidInput, match="max_positions") as refused:
        mesh.generate(too_long, max_tokens=1)
    request_id = refused.value.request_id
    assert request_id is not None and re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert refused.value.__notes__ == [f"kvmesh request id: {request_id}"]  # tagged once


def test_errors_of_calls_outside_a_request_carry_no_id(mesh: KVMesh) -> None:
    with pytest.raises(KVMeshError) as refused:
        mesh.generate([1, 2, 3], max_tokens=-1)
    assert refused.value.request_id is None
