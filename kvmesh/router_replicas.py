"""Where the coordinator's router replicas and index shards are found on Ray: their names.

The coordinator creates them (`kvmesh.coordinator.router.create_layout`); a
client fails over to them when replica 0 is away. Both read the names from
here, so the two cannot drift apart and the client needs nothing of the
coordinator's code (tests/test_layering.py):

    replica 0:  router "kvmesh-coordinator"          shards "kvmesh-coordinator-r0-s0" ..
    replica r:  router "kvmesh-coordinator-router-r" shards "kvmesh-coordinator-rR-s0" ..

Ray is imported only by `router_handles`, so importing this module stays
cheap for callers that only name actors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvmesh.config import CoordinatorConfig
from kvmesh.errors import NoWorkers

if TYPE_CHECKING:
    from kvmesh.handles import CoordinatorHandle


def shard_actor_name(config: CoordinatorConfig, replica: int, shard: int) -> str:
    """The named Ray actor holding index shard `shard` of router replica `replica`."""
    return f"{config.actor_name}-r{replica}-s{shard}"


def router_actor_name(config: CoordinatorConfig, replica: int) -> str:
    """Replica 0 takes the coordinator's own name, so workers and clients find it unchanged."""
    return config.actor_name if replica == 0 else f"{config.actor_name}-router-{replica}"


def router_handles(
    config: CoordinatorConfig, replicas: Iterable[int] | None = None
) -> list[CoordinatorHandle]:
    """Handles of the running routers among `replicas` (default: all, replica 0 first).

    A replica whose actor Ray does not know (never started, or killed for good)
    is left out; raises `NoWorkers` naming the namespace when none of them runs.
    Needs this process to have joined the Ray cluster.
    """
    import ray

    wanted = range(config.router_replicas) if replicas is None else replicas
    out: list[CoordinatorHandle] = []
    for r in wanted:
        with contextlib.suppress(ValueError):
            out.append(ray.get_actor(router_actor_name(config, r), namespace=config.namespace))
    if not out:
        raise NoWorkers(f"no coordinator router runs in namespace {config.namespace!r}")
    return out


__all__ = ["router_actor_name", "router_handles", "shard_actor_name"]
