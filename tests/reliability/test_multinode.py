"""Many nodes on one machine: a Ray cluster of three nodes made by `ray.cluster_utils.Cluster`.

The layout (docs/scale.md, deploy/README.md for KubeRay):

    head    num_cpus=0                       the driver only
    node-a  kvmesh-index-replica=0, kvmesh-worker-group=a   router 0 + shards r0-s*, worker-a
    node-b  kvmesh-index-replica=1, kvmesh-worker-group=b   router 1 + shards r1-s*, worker-b

Routers and shards are placed by `CoordinatorConfig.replica_node_label`,
workers by a node-label selector. Removing node-b (its worker, one replica's
router and shards) is survived as the single-node faults are: every request
before, during and after succeeds, each answer is the one the workers' pools
prove, and the dead worker leaves the registry.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from reliability_kit import held, random_prompt, wait_until

from kvmesh.app import connect
from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig
from kvmesh.router_replicas import router_handles, shard_actor_name
from kvmesh.types import WorkerId

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

PAGE = 16
NAMESPACE = "kvmesh-multinode"
REPLICA_LABEL = "kvmesh-index-replica"
GROUP_LABEL = "kvmesh-worker-group"
CONFIG = dataclasses.replace(
    ClusterConfig(),
    pool=PoolConfig(num_pages=128),
    coordinator=CoordinatorConfig(
        namespace=NAMESPACE,
        index_shards=2,
        router_replicas=2,
        replica_node_label=REPLICA_LABEL,
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=3.0,
    ),
)


@dataclasses.dataclass
class Layout:
    cluster: Any
    nodes: dict[str, Any]  # node name -> the cluster_utils node
    node_ids: dict[str, str]  # node name -> Ray node id
    mesh: KVMesh
    workers: dict[str, Any]  # worker id -> actor handle


def start_worker(worker_id: str, group: str) -> Any:
    """A worker actor on the nodes of worker group `group` (a node-label selector)."""
    from kvmesh.requests import WorkerSpec
    from kvmesh.worker.actor import WorkerActor, worker_actor_name

    coordinator = ray.get_actor(CONFIG.coordinator.actor_name, namespace=NAMESPACE)
    handle = (
        ray.remote(WorkerActor)
        .options(
            name=worker_actor_name(worker_id),
            namespace=NAMESPACE,
            num_cpus=0.5,
            max_concurrency=8,
            max_restarts=0,
            label_selector={GROUP_LABEL: group},
        )
        .remote(WorkerSpec(WorkerId(worker_id), CONFIG), coordinator)
    )
    ray.get(handle.info.remote(), timeout=300)
    return handle


def actor_node(handle: Any) -> str:
    """The node an actor runs on, from the GCS's actor table (workers have no node_id call)."""
    from ray._private import state

    info = state.actors(handle._actor_id.hex())
    return str(info["Address"]["NodeID"])


@pytest.fixture(scope="module")
def layout() -> Iterator[Layout]:
    if ray.is_initialized():
        ray.shutdown()
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    nodes = {
        "a": cluster.add_node(num_cpus=1, labels={REPLICA_LABEL: "0", GROUP_LABEL: "a"}),
        "b": cluster.add_node(num_cpus=1, labels={REPLICA_LABEL: "1", GROUP_LABEL: "b"}),
    }
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        by_label = {n["Labels"].get(GROUP_LABEL): n["NodeID"] for n in ray.nodes() if n["Alive"]}
        mesh = connect(config=CONFIG, num_workers=0)
        workers = {
            "worker-a": start_worker("worker-a", "a"),
            "worker-b": start_worker("worker-b", "b"),
        }
        yield Layout(cluster, nodes, {k: by_label[k] for k in ("a", "b")}, mesh, workers)
        mesh.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_replicas_shards_and_workers_run_on_their_nodes(layout: Layout) -> None:
    r0, r1 = router_handles(CONFIG.coordinator)
    assert ray.get(r0.node_id.remote()) == layout.node_ids["a"]
    assert ray.get(r1.node_id.remote()) == layout.node_ids["b"]
    for replica, node in ((0, "a"), (1, "b")):
        for s in range(2):
            shard = ray.get_actor(
                shard_actor_name(CONFIG.coordinator, replica, s), namespace=NAMESPACE
            )
            assert ray.get(shard.node_id.remote()) == layout.node_ids[node]
    for wid, node in (("worker-a", "a"), ("worker-b", "b")):
        assert actor_node(layout.workers[wid]) == layout.node_ids[node]
    assert ray.get([r0.wait_ready.remote(60), r1.wait_ready.remote(60)]) == [True, True]


def test_a_removed_node_is_survived_with_no_failed_request(layout: Layout) -> None:
    import random

    mesh = layout.mesh
    rng = random.Random(17)
    prompts = [random_prompt(rng, rng.randrange(2, 6), PAGE) for _ in range(6)]
    served = {tuple(p): mesh.generate(p, max_tokens=1).worker_id for p in prompts}
    assert set(served.values()) <= {"worker-a", "worker-b"}
    for p in prompts:  # both replicas answer, and the answer is what the pool holds
        d = mesh.route(p)
        assert (d.worker_id, d.local_pages) == (served[tuple(p)], (len(p) - 1) // PAGE)

    failures: list[BaseException] = []
    done = [0]
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            p = prompts[rng.randrange(len(prompts))]
            try:
                mesh.generate(p, max_tokens=1)
                done[0] += 1
            except Exception as exc:  # counted: the test wants none
                failures.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(1.0)
    layout.cluster.remove_node(layout.nodes["b"])  # worker-b, router 1, replica 1's shards
    before = done[0]
    coordinator = ray.get_actor(CONFIG.coordinator.actor_name, namespace=NAMESPACE)

    def dropped() -> bool:
        infos = ray.get(coordinator.workers.remote(), timeout=30)
        return {i.worker_id for i in infos} == {"worker-a"}

    assert wait_until(dropped, 60.0, poll_s=0.2)
    time.sleep(1.0)
    stop.set()
    thread.join(120)
    assert not failures, failures[:3]
    assert done[0] > before
    address = next(w["address"] for w in mesh.workers() if w["worker_id"] == "worker-a")
    for p in prompts:  # worker-a now serves everything, from what its pool really holds
        d = mesh.route(p)
        hashes = mesh.hashes(p)
        assert d.worker_id == "worker-a"
        assert d.local_pages == len(held(address, hashes[: d.local_pages]))
