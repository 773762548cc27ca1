"""Starting a kvmesh cluster: Ray (embedded, or joined), the coordinator, the workers.

This is the app's job, not the client's: the client (`kvmesh.client.KVMesh`)
only talks to a cluster it is handed (`KVMesh.attach` joins one that runs and
creates nothing). `connect` here creates what is missing and hands the
client the handles; users call it as `kvmesh.app.connect` (the package
imports it on first use). The client imports nothing of the app, so its old
spelling `KVMesh.connect` only raises `MovedAPI` pointing here.

Where the cluster is: `address` when given, else ``RAY_ADDRESS`` when set (as
Ray itself reads it), else a new embedded Ray on this machine. A join checks
first that the GCS port answers (`kvmesh.ray_address.reachable`), so a wrong
address is one `ClusterUnreachable` within seconds, not minutes of Ray's
retries.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from kvmesh.app.launch import start_workers
from kvmesh.client.mesh import DEFAULT_WORKER_CPUS, KVMesh, WorkerHandle, attach_workers
from kvmesh.config import ClusterConfig
from kvmesh.coordinator.actor import get_or_create_coordinator
from kvmesh.errors import ClusterAlreadyRunning, ConfigError
from kvmesh.handles import CoordinatorHandle
from kvmesh.ray_address import address_from_environment
from kvmesh.requests import Role
from kvmesh.security import TenantPolicy, check_cluster
from kvmesh.settings import settings_for
from kvmesh.types import WorkerId


def _check_counts(
    num_workers: int, prefill: int, decode: int, worker_cpus: float, worker_gpus: float
) -> None:
    if num_workers < 0 or prefill < 0 or decode < 0:
        raise ConfigError("worker counts must be >= 0")
    if (prefill > 0) != (decode > 0):
        raise ConfigError(
            "disaggregation needs both prefill_workers and decode_workers (got "
            f"{prefill} and {decode})"
        )
    if worker_cpus < 0:
        raise ConfigError(f"worker_num_cpus must be >= 0, got {worker_cpus}")
    if worker_gpus < 0:
        raise ConfigError(f"worker_num_gpus must be >= 0, got {worker_gpus}")


def plan_workers(num_workers: int, prefill: int, decode: int) -> list[tuple[str, Role]]:
    """The (id, role) of every worker to create: ``worker-i``, or ``prefill-i`` + ``decode-i``."""
    plan: list[tuple[str, Role]] = [(f"worker-{i}", "both") for i in range(num_workers)]
    plan += [(f"prefill-{i}", "prefill") for i in range(prefill)]
    plan += [(f"decode-{i}", "decode") for i in range(decode)]
    return plan


def connect(
    address: str | None = None,
    *,
    num_workers: int | None = None,
    config: ClusterConfig | None = None,
    config_file: str | Path | None = None,
    prefill_workers: int | None = None,
    decode_workers: int | None = None,
    worker_num_cpus: float = DEFAULT_WORKER_CPUS,
    worker_num_gpus: float = 0.0,
    num_cpus: float | None = None,
    retries: int = 1,
    pull: bool = True,
    request_timeout_s: float = 120.0,
    worker_max_concurrency: int = 8,
    tenants: TenantPolicy | None = None,
    join_existing: bool = True,
    metrics_port: int | None = None,
) -> KVMesh:
    """A `KVMesh` over the cluster at `address` (or ``RAY_ADDRESS``), or over a new
    embedded one; the coordinator and workers it lacks are created.

    Settings: `config` as given, else `config_file` / ``KVMESH_CONFIG``, the
    ``KVMESH_*`` environment (`kvmesh.settings.settings_for`); every value and
    the security profile are checked before Ray starts. Workers: when the
    coordinator already knows some (another process ran `kvmesh start`) they
    are used and none is created, unless `join_existing` is False, which
    refuses with `ClusterAlreadyRunning` (`kvmesh start` without ``--join``).
    Otherwise `num_workers` (default: the config's; or `prefill_workers` +
    `decode_workers`) are created, owned by the returned client, stopped by
    its `close`. When Ray is already initialised in this process its cluster
    is used, and `config` sets only this client's side. `metrics_port`: the
    Prometheus port of an embedded cluster's node, where every actor's metrics
    are served (None: one Ray chooses; `kvmesh.metrics.ray_metrics_endpoints`).
    """
    import ray

    cfg = settings_for(config, config_file)
    check_cluster(cfg)  # the security profile refuses before anything starts
    if num_workers is None:
        num_workers = cfg.num_workers
    prefill = cfg.prefill_workers if prefill_workers is None else prefill_workers
    decode = cfg.decode_workers if decode_workers is None else decode_workers
    _check_counts(num_workers, prefill, decode, worker_num_cpus, worker_num_gpus)
    KVMesh.check_client_options(retries, request_timeout_s)
    if prefill or decode:
        num_workers = 0
    cfg = dataclasses.replace(
        cfg, num_workers=num_workers, prefill_workers=prefill, decode_workers=decode
    )
    owns_ray = False
    if not ray.is_initialized():
        source = "address"
        if address is None and (address := address_from_environment()) is not None:
            source = "RAY_ADDRESS"
        if address is None:
            total = (num_workers + prefill + decode) * worker_num_cpus
            cpus = math.ceil(num_cpus) if num_cpus is not None else max(4, math.ceil(total) + 1)
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                namespace=cfg.coordinator.namespace,
                configure_logging=False,
                _metrics_export_port=metrics_port,
            )
        else:
            KVMesh.join_ray(address, cfg, source)
        owns_ray = True  # this driver's connection; a joined cluster itself stays up
    try:
        if not join_existing:
            _refuse_a_running_kvmesh(cfg)
        coordinator = get_or_create_coordinator(cfg.coordinator, cfg.transfer)
        ray.get(coordinator.wait_ready.remote(), timeout=120)
        workers = attach_workers(ray.get(coordinator.workers.remote(), timeout=60))
        created: list[WorkerId] = []
        if not workers and num_workers + prefill + decode > 0:
            started = start_workers(
                plan_workers(num_workers, prefill, decode),
                cfg,
                coordinator,
                worker_num_cpus,
                worker_num_gpus,
                worker_max_concurrency,
            )
            workers = {
                w.worker_id: WorkerHandle(w.worker_id, w.role, w.address, w.actor) for w in started
            }
            created = list(workers)
        ray_address = ray.get_runtime_context().gcs_address
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    return KVMesh(
        cfg,
        coordinator,
        workers,
        owns_ray=owns_ray,
        created=created,
        retries=retries,
        pull=pull,
        request_timeout_s=request_timeout_s,
        ray_address=ray_address,
        tenants=tenants,
    )


def _refuse_a_running_kvmesh(cfg: ClusterConfig) -> None:
    """`ClusterAlreadyRunning` when the namespace's coordinator exists and knows workers."""
    import ray

    ns, name = cfg.coordinator.namespace, cfg.coordinator.actor_name
    try:
        coordinator: CoordinatorHandle = ray.get_actor(name, namespace=ns)
    except ValueError:
        return
    known = ray.get(coordinator.workers.remote(), timeout=60)
    if known:
        address = ray.get_runtime_context().gcs_address
        raise ClusterAlreadyRunning(
            f"kvmesh already runs in namespace {ns!r} of the Ray cluster at {address} "
            f"({len(known)} workers registered); use it (`kvmesh status --address "
            f"{address}`), join it with `kvmesh start --address {address} --join`, or "
            "start another with a different KVMESH_NAMESPACE"
        )


__all__ = ["connect", "plan_workers"]
