"""Starting worker actors for an embedded cluster: the one place that builds `WorkerActor`s.

The client only talks to workers (it is handed their handles); creating them
needs the worker's code, so it lives here, beside the CLI, and `kvmesh.app.connect`
reaches it through `kvmesh.app.launch.start_workers` only when it must start
workers itself. Nothing under ``kvmesh/client/`` imports ``kvmesh.worker``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh import errors
from kvmesh.config import ClusterConfig
from kvmesh.errors import ConfigError, KVMeshError, NoWorkers
from kvmesh.handles import CoordinatorHandle, WorkerActorHandle, handle_of
from kvmesh.requests import Role, WorkerSpec
from kvmesh.types import WorkerId

WORKER_START_TIMEOUT_S = 300.0
"""How long `start_workers` waits for the workers it created to start and register."""


@dataclass(frozen=True, slots=True)
class StartedWorker:
    """A worker actor that started and registered: its id, role, gRPC address and handle."""

    worker_id: WorkerId
    role: Role
    address: str
    actor: WorkerActorHandle


def start_workers(
    plan: Sequence[tuple[str, Role]],
    cfg: ClusterConfig,
    coordinator: CoordinatorHandle,
    num_cpus: float,
    num_gpus: float,
    max_concurrency: int,
) -> list[StartedWorker]:
    """Start one named worker actor per (id, role) and wait until each has registered.

    Refuses up front (`ConfigError`) when the Ray cluster has too few CPUs for
    the plan; a worker that fails in ``__init__`` comes back as its own kvmesh
    error; workers that do not start in time are killed (`NoWorkers`).
    """
    import ray

    from kvmesh.worker.actor import WorkerActor, worker_actor_name

    if not plan:
        raise ConfigError("no workers to start: give num_workers (or prefill and decode workers)")
    need_cpus = num_cpus * len(plan)
    total_cpus = float(ray.cluster_resources().get("CPU", 0.0))
    if need_cpus > total_cpus:
        raise ConfigError(
            f"{len(plan)} workers of {num_cpus:g} CPUs need {need_cpus:g} CPUs but the Ray "
            f"cluster has {total_cpus:g}: start fewer workers, lower worker_num_cpus, or give "
            "Ray more CPUs (num_cpus= for an embedded cluster)"
        )
    remote = ray.remote(WorkerActor)
    handles: list[tuple[str, Role, WorkerActorHandle]] = []
    for wid, role in plan:
        spec = WorkerSpec(WorkerId(wid), cfg, role)
        options: dict[str, Any] = {
            "name": worker_actor_name(wid),
            "namespace": cfg.coordinator.namespace,
            "num_cpus": num_cpus,
            "max_concurrency": max_concurrency,
            "max_restarts": 0,
        }
        if num_gpus:
            options["num_gpus"] = num_gpus
        handles.append((wid, role, handle_of(remote.options(**options).remote(spec, coordinator))))
    try:
        infos = ray.get(
            [h.info.remote() for _, _, h in handles],
            timeout=WORKER_START_TIMEOUT_S,
        )
    except ray.exceptions.GetTimeoutError:
        for _, _, h in handles:
            ray.kill(h, no_restart=True)  # type: ignore[arg-type]
        free = float(ray.available_resources().get("CPU", 0.0))
        raise NoWorkers(
            f"{len(plan)} workers did not start within {WORKER_START_TIMEOUT_S:g}s; the Ray "
            f"cluster has {free:g} CPUs free and they need {need_cpus:g} (worker_num_cpus="
            f"{num_cpus:g}): other actors hold the rest, or the nodes are too slow to start"
        ) from None
    except ray.exceptions.RayActorError as exc:  # a worker's __init__ raised
        for _, _, h in handles:
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)  # type: ignore[arg-type]
        raise _start_error(exc) from None
    return [
        StartedWorker(WorkerId(wid), role, info["address"], h)
        for (wid, role, h), info in zip(handles, infos, strict=True)
    ]


_REMOTE_KVMESH_ERROR = re.compile(r"^kvmesh\.errors\.(\w+): (.+)$", re.MULTILINE)


def _start_error(exc: Exception) -> KVMeshError:
    """A worker that failed in ``__init__`` (e.g. ``device='cuda'`` on a node without CUDA)
    as one kvmesh error of the same class. Ray keeps only the text of the creation task's
    traceback, whose last ``kvmesh.errors.<Class>: <message>`` line is the worker's error."""
    found = _REMOTE_KVMESH_ERROR.findall(str(exc))
    if found:
        name, message = found[-1]
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, KVMeshError):
            with contextlib.suppress(TypeError):  # a class that is not built from a message
                return cls(f"a worker could not start: {message}")
            return ConfigError(f"a worker could not start: {message}")
    lines = [line for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else repr(exc)  # `!r` here would quote the line as well
    return NoWorkers(f"a worker could not start: {last}")


__all__ = ["WORKER_START_TIMEOUT_S", "StartedWorker", "start_workers"]
