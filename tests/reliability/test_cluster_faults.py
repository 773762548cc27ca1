"""Faults on a real local Ray cluster: the coordinator and workers killed, a worker drained.

One embedded cluster for the module (4 workers, heartbeats every 0.25 s,
expiry after 3 s); one more worker with a slow transfer server joins for the
streaming tests. The tests run in file order and the cluster shrinks as they
go: the coordinator restart needs every worker, the kills come last.

What is checked after each fault, always through public surfaces (gRPC
Lookup / FetchPages, actor `stats` / `check_invariants`, the coordinator's
index snapshot): the coordinator's index equals what the workers really
hold, a dead worker's pages miss, answers equal the from-scratch model,
surviving pools keep their invariants, hold no page (ref counts back to
zero) and the checksums of their pages are unchanged.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from reliability_kit import (
    TRANSFER,
    assert_pages_match_reference,
    held,
    index_of,
    page_checksums,
    random_prompt,
    start_worker,
    wait_until,
)

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig
from kvmesh.requests import GenerateRequest
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.transfer_client import SyncPeerClient

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

PAGE = 16
HEARTBEAT_S = 0.25
EXPIRY_S = 3.0
NAMESPACE = "kvmesh-reliability-faults"
CONFIG = dataclasses.replace(
    ClusterConfig(),
    pool=PoolConfig(num_pages=256),
    coordinator=CoordinatorConfig(
        namespace=NAMESPACE, heartbeat_interval_s=HEARTBEAT_S, heartbeat_timeout_s=EXPIRY_S
    ),
)
DROP_BOUND_S = EXPIRY_S + 2 * HEARTBEAT_S + 10.0  # expiry + one sweep + a loaded machine's slack

_rng = random.Random(20261124)
_sent: list[list[int]] = []  # every prompt any worker may hold pages of


def fresh(pages: int, extra: int = 5) -> list[int]:
    tokens = random_prompt(_rng, pages, PAGE, extra)
    _sent.append(tokens)
    return tokens


def all_hashes(mesh: KVMesh) -> list[PageHash]:
    out: dict[PageHash, None] = {}
    for tokens in _sent:
        out.update(dict.fromkeys(mesh.hashes(tokens)))
    return list(out)


@pytest.fixture(scope="module")
def mesh(fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    return fresh_cluster(num_workers=4, config=CONFIG, num_cpus=4)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG.model)


def coordinator() -> Any:
    return ray.get_actor(CONFIG.coordinator.actor_name, namespace=NAMESPACE)


def registered() -> set[str]:
    return {w.worker_id for w in ray.get(coordinator().workers.remote(), timeout=60)}


def address(mesh: KVMesh, worker_id: str) -> str:
    return next(w["address"] for w in mesh.workers() if w["worker_id"] == worker_id)


def serve_on(handle: Any, tokens: list[int], max_tokens: int = 2, **kw: Any) -> Any:
    """Serve a request on one worker directly (no routing); its events reach the index."""
    request = GenerateRequest(f"direct-{_rng.random()}", tuple(tokens), max_tokens, **kw)
    return ray.get(handle.generate.remote(request), timeout=120)


def assert_index_equals_pools(mesh: KVMesh, workers: list[str]) -> None:
    """The coordinator's entries for each worker are exactly the pages its pool holds."""
    hashes = all_hashes(mesh)
    for wid in workers:
        ray.get(mesh.worker(wid).flush.remote(), timeout=60)
    index = index_of(coordinator())
    index.check_invariants()
    for wid in workers:
        truth = held(address(mesh, wid), hashes)
        stats = ray.get(mesh.worker(wid).stats.remote(), timeout=60)
        assert stats.cached_pages == len(truth)  # every cached page is one of ours
        assert index.worker_pages(WorkerId(wid)) == truth


def assert_idle_and_intact(mesh: KVMesh, workers: list[str], before: dict[str, dict]) -> None:
    """Invariants hold, no page is held, and every page seen before has its old checksum."""
    for wid in workers:
        handle = mesh.worker(wid)
        ray.get(handle.check_invariants.remote(), timeout=60)
        assert wait_until(
            lambda h=handle: ray.get(h.stats.remote(), timeout=60).pages_used == 0, 10.0
        )
        now = page_checksums(address(mesh, wid), before[wid])
        assert now == before[wid]


def checksums(mesh: KVMesh, workers: list[str]) -> dict[str, dict]:
    hashes = all_hashes(mesh)
    return {wid: page_checksums(address(mesh, wid), hashes) for wid in workers}


def wait_dropped(worker_id: str, t0: float) -> float:
    """Seconds from `t0` until the coordinator no longer lists `worker_id`."""
    assert wait_until(lambda: worker_id not in registered(), DROP_BOUND_S, poll_s=0.05)
    return time.monotonic() - t0


# --------------------------------------------------------------------- coordinator


def test_a_killed_coordinator_is_restarted_rebuilds_the_index_and_routing_resumes(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    workers = [w["worker_id"] for w in mesh.workers()]
    prompts = [fresh(_rng.randrange(3, 9)) for _ in range(8)]
    served = {tuple(p): mesh.generate(p, max_tokens=2).worker_id for p in prompts}
    assert_index_equals_pools(mesh, workers)
    routes = {tuple(p): mesh.route(p) for p in prompts}
    for p, d in routes.items():
        assert (d.worker_id, d.local_pages) == (served[p], (len(p) - 1) // PAGE)
    old = coordinator()
    pid = ray.get(old.pid.remote(), timeout=30)

    t0 = time.monotonic()
    ray.kill(old, no_restart=False)

    def recovered() -> bool:
        try:
            c = coordinator()
            if ray.get(c.pid.remote(), timeout=10) == pid:
                return False  # ray.kill is asynchronous: still the old process
            if not ray.get(c.wait_ready.remote(5.0), timeout=10):
                return False
            return all(
                (d.worker_id, d.local_pages) == (routes[p].worker_id, routes[p].local_pages)
                for p in routes
                if (d := mesh.route(list(p)))
            )
        except Exception:  # restarting: the actor is unavailable for a moment
            return False

    assert wait_until(recovered, 90.0, poll_s=0.05)
    recovery_s = time.monotonic() - t0
    print(f"\ncoordinator recovery (kill -> every route as before): {recovery_s:.2f} s")

    stats = ray.get(coordinator().stats.remote(), timeout=30)
    assert stats["workers"] == len(workers)
    assert registered() == set(workers)  # no worker lost from the registry
    assert stats["stale_workers"] == 0
    assert_index_equals_pools(mesh, workers)
    again = fresh(4)
    result = mesh.generate(again, max_tokens=6)
    assert list(result.tokens) == model.generate(again, 6)
    assert mesh.route(again).local_pages == 4


# --------------------------------------------------------------------- draining


def test_a_draining_worker_reports_not_serving_and_gets_no_new_requests(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    victim = "worker-3"
    shared = fresh(6, extra=0)
    serve_on(mesh.worker(victim), [*shared, 1, 2])
    ray.get(mesh.worker(victim).flush.remote(), timeout=60)
    assert mesh.route([*shared, 3]).worker_id == victim  # it holds the prefix: it would win
    with SyncPeerClient(address(mesh, victim), TRANSFER) as client:
        assert client.health() == "SERVING"
        assert ray.get(mesh.worker(victim).drain.remote(10.0), timeout=60) is True
        assert client.health() == "NOT_SERVING"
    time.sleep(2 * HEARTBEAT_S)  # one heartbeat poll; the drain call told the coordinator already
    served = []
    for i in range(12):
        tokens = [*shared, *random_prompt(_rng, 1, PAGE, i)]
        _sent.append(tokens)
        result = mesh.generate(tokens, max_tokens=3)
        assert list(result.tokens) == model.generate(tokens, 3)
        served.append(result.worker_id)
    assert victim not in served
    stats = ray.get(mesh.worker(victim).stats.remote(), timeout=60)
    assert stats.draining and stats.running == 0
    for other in ("worker-0", "worker-1", "worker-2"):
        with SyncPeerClient(address(mesh, other), TRANSFER) as client:
            assert client.health() == "SERVING"


# --------------------------------------------------------------------- worker kills


def test_a_worker_killed_while_idle_is_dropped_within_the_timeout_and_its_pages_miss(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    victim, others = "worker-2", ["worker-0", "worker-1"]
    tokens = fresh(7)
    serve_on(mesh.worker(victim), tokens)
    for wid in others:
        serve_on(mesh.worker(wid), fresh(5))
    assert mesh.route(tokens).worker_id == victim
    before = checksums(mesh, others)
    assert all(before.values())

    t0 = time.monotonic()
    ray.kill(mesh.worker(victim), no_restart=True)
    dropped_s = wait_dropped(victim, t0)
    print(f"\nidle worker dropped {dropped_s:.2f} s after the kill (timeout {EXPIRY_S} s)")

    hashes = mesh.hashes(tokens)
    match = ray.get(coordinator().match.remote(hashes), timeout=30)
    assert victim not in match.pages
    assert match.pages == {}  # nobody else held this prompt: a miss
    decision = mesh.route(tokens)
    assert decision.worker_id != victim and decision.local_pages == 0
    result = mesh.generate(tokens, max_tokens=4)
    assert result.worker_id != victim
    assert list(result.tokens) == model.generate(tokens, 4)
    assert_idle_and_intact(mesh, others, before)


def _kill_when_busy(mesh: KVMesh, candidates: list[str], killed: list[str]) -> None:
    """Kill the first candidate seen serving a request (polled through its own stats)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for wid in candidates:
            handle = mesh.worker(wid)
            try:
                busy = ray.get(handle.stats.remote(), timeout=5).running > 0
            except Exception:
                continue
            if busy:
                ray.kill(handle, no_restart=True)
                killed.append(wid)
                return
        time.sleep(0.005)


def test_a_worker_killed_while_serving_is_retried_elsewhere_and_never_answers_wrong(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    candidates = ["worker-0", "worker-1"]
    before = checksums(mesh, candidates)
    tokens = fresh(3)
    killed: list[str] = []
    killer = threading.Thread(target=_kill_when_busy, args=(mesh, candidates, killed))
    killer.start()
    result = mesh.generate(tokens, max_tokens=600)  # ~1 s of decoding: killed mid-request
    killer.join(timeout=60)
    assert len(killed) == 1
    victim = killed[0]
    (survivor,) = (w for w in candidates if w != victim)
    assert result.worker_id == survivor
    assert list(result.tokens) == model.generate(tokens, 600)
    assert victim not in registered()  # the client told the coordinator at once
    index = index_of(coordinator())
    assert victim not in index.workers()
    for p in _sent:  # every page the dead worker held now misses there
        assert victim not in ray.get(coordinator().match.remote(mesh.hashes(p)), timeout=30).pages
    assert_idle_and_intact(mesh, [survivor], {survivor: before[survivor]})
    assert_index_equals_pools(mesh, [survivor])


@pytest.fixture(scope="module")
def slow_source(mesh: KVMesh) -> Any:
    """One more worker whose transfer server streams each page 0.15 s late."""
    return start_worker(CONFIG, "slow-src", page_delay_s=0.15)


def test_a_puller_killed_mid_stream_leaves_the_source_with_no_pinned_page(
    mesh: KVMesh, slow_source: Any
) -> None:
    src_addr = ray.get(slow_source.info.remote(), timeout=60)["address"]
    tokens = fresh(16)
    serve_on(slow_source, tokens)
    before = page_checksums(src_addr, mesh.hashes(tokens))
    assert len(before) == 16
    puller = mesh.worker("worker-3")  # drained: routed nothing, but still serves direct calls
    request = GenerateRequest(
        "pull-then-die", tuple(tokens), 2, promised_pull=16, peer_address=src_addr
    )
    ref = puller.generate.remote(request)
    assert wait_until(
        lambda: ray.get(slow_source.stats.remote(), timeout=30).pages_used > 0, 30.0, poll_s=0.01
    )
    ray.kill(puller, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=60)
    # The source notices the broken streams and unpins; its pages are as before.
    assert wait_until(lambda: ray.get(slow_source.stats.remote(), timeout=30).pages_used == 0, 30.0)
    ray.get(slow_source.check_invariants.remote(), timeout=30)
    assert page_checksums(src_addr, before) == before


def test_a_source_killed_mid_stream_leaves_no_half_written_page_and_the_request_succeeds(
    mesh: KVMesh, model: TinyTransformer, slow_source: Any
) -> None:
    src_addr = ray.get(slow_source.info.remote(), timeout=60)["address"]
    alive = [w for w in ("worker-0", "worker-1") if w in registered()]
    (puller_id,) = alive
    puller = mesh.worker(puller_id)
    before = checksums(mesh, [puller_id])
    tokens = fresh(16)
    serve_on(slow_source, tokens)
    ray.get(slow_source.flush.remote(), timeout=30)
    request = GenerateRequest(
        "pull-from-dying", tuple(tokens), 6, promised_pull=16, peer_address=src_addr
    )
    ref = puller.generate.remote(request)
    assert wait_until(
        lambda: ray.get(slow_source.stats.remote(), timeout=30).pages_used > 0, 30.0, poll_s=0.01
    )
    t0 = time.monotonic()
    ray.kill(slow_source, no_restart=True)
    result = ray.get(ref, timeout=120)
    assert result.pull_error is not None  # the pull broke off: its pages were computed
    assert result.pages_pulled + result.pages_computed == 17
    assert list(result.tokens) == model.generate(tokens, 6)
    hashes = mesh.hashes(tokens)
    assert assert_pages_match_reference(address(mesh, puller_id), hashes, tokens, model, PAGE) == 16
    assert_idle_and_intact(mesh, [puller_id], before)
    dropped_s = wait_dropped("slow-src", t0)
    print(f"\nstreaming source dropped {dropped_s:.2f} s after the kill")
    match = ray.get(coordinator().match.remote(hashes), timeout=30)
    assert match.pages == {puller_id: 16}  # only the puller's own copy is left
    assert_index_equals_pools(mesh, [puller_id])


def test_a_worker_that_dies_before_this_client_ever_called_it_is_routed_around(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    late = start_worker(CONFIG, "late-joiner")
    tokens = fresh(8)
    serve_on(late, tokens)  # it holds the prefix: the coordinator will route there
    ray.get(late.flush.remote(), timeout=30)
    assert mesh.route(tokens).worker_id == "late-joiner"
    assert "late-joiner" not in {w["worker_id"] for w in mesh.workers()}  # never attached
    ray.kill(late, no_restart=True)
    name = "kvmesh-worker-late-joiner"

    def gone() -> bool:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    assert wait_until(gone, 30.0)
    assert "late-joiner" in registered()  # its heartbeats have not run out yet
    result = mesh.generate(tokens, max_tokens=4)
    assert result.worker_id != "late-joiner"
    assert list(result.tokens) == model.generate(tokens, 4)
    assert "late-joiner" not in registered()  # dropped by the client that hit it
