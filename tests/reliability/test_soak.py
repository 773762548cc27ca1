"""Soak: mixed requests while workers are killed at random and replaced; then check everything.

A real embedded Ray cluster (3 workers, 64-page pools so pages are evicted
and pulled all the time). For ``KVMESH_SOAK_S`` seconds (default 60) a few
asyncio clients send mixed requests (48 prompts over 4 shared prefixes,
three tenant salts, answer lengths 1-8) through `KVMesh.agenerate`, while a killer
kills a random worker every few seconds and starts a replacement under a
new id. Afterwards, with the load stopped:

- every answered request equals the from-scratch model's answer;
- a request that failed did so with `WorkerDied` (its worker and its
  retries died), never with anything else;
- every live pool passes `check_invariants()` and holds no page;
- the coordinator lists exactly the live workers, and its index equals
  what each of them really holds (gRPC Lookup over every page sent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from reliability_kit import held, index_of, start_worker, wait_until

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig
from kvmesh.errors import WorkerDied
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.actor import worker_actor_name
from kvmesh.worker.model import TinyTransformer

ray = pytest.importorskip("ray")

SOAK_S = float(os.environ.get("KVMESH_SOAK_S", "60"))
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(int(SOAK_S) + 300)]

PAGE = 16
CLIENTS = 3
KILL_EVERY_S = (6.0, 12.0)
MIN_ALIVE = 2
NAMESPACE = "kvmesh-reliability-soak"
CONFIG = dataclasses.replace(
    ClusterConfig(),
    pool=PoolConfig(num_pages=64),
    coordinator=CoordinatorConfig(
        namespace=NAMESPACE, heartbeat_interval_s=0.25, heartbeat_timeout_s=3.0
    ),
)
SALTS = (None, None, None, "tenant-a", "tenant-b")
MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Answered:
    tokens: tuple[int, ...]
    max_tokens: int
    answer: tuple[int, ...]
    worker_id: str


@dataclass
class SoakLog:
    answered: list[Answered] = dataclasses.field(default_factory=list)
    failed: Counter[str] = dataclasses.field(default_factory=Counter)
    first_error: dict[str, str] = dataclasses.field(default_factory=dict)
    sent: list[tuple[list[int], str | None]] = dataclasses.field(default_factory=list)
    killed: list[str] = dataclasses.field(default_factory=list)
    started: list[str] = dataclasses.field(default_factory=list)
    # The owner's handles of the replacements: Ray destroys an actor its owner drops.
    handles: list[Any] = dataclasses.field(default_factory=list)


@pytest.fixture(scope="module")
def mesh(fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    # Closing it stops Ray, and with it the replacement workers this test started.
    return fresh_cluster(num_workers=3, config=CONFIG, num_cpus=4, retries=2)


def coordinator() -> Any:
    return ray.get_actor(CONFIG.coordinator.actor_name, namespace=NAMESPACE)


def registered() -> set[str]:
    return {w.worker_id for w in ray.get(coordinator().workers.remote(), timeout=60)}


def handle(worker_id: str) -> Any:
    """A worker's actor by name (the client knows only the workers it was routed to)."""
    return ray.get_actor(worker_actor_name(worker_id), namespace=NAMESPACE)


def live_workers() -> dict[str, str]:
    """Id -> gRPC address of the registered workers whose actors answer a ping."""
    out = {}
    for info in ray.get(coordinator().workers.remote(), timeout=60):
        try:
            ray.get(handle(info.worker_id).ping.remote(), timeout=10)
        except Exception:
            continue
        out[info.worker_id] = info.address
    return out


def prompt_pool(rng: random.Random) -> list[list[int]]:
    """Prompts sharing 4 prefixes (2-6 pages), each with 12 suffixes (1-39 tokens)."""
    prefixes = [[rng.randrange(256) for _ in range(k * PAGE)] for k in (2, 3, 4, 6)]
    return [
        p + [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        for p in prefixes
        for _ in range(12)
    ]


PROMPTS = prompt_pool(random.Random(7))


async def client(mesh: KVMesh, rng: random.Random, log: SoakLog, end: float) -> None:
    while time.monotonic() < end:
        tokens = rng.choice(PROMPTS)
        salt = rng.choice(SALTS)
        n = rng.randrange(1, MAX_TOKENS + 1)
        log.sent.append((tokens, salt))
        try:
            r = await mesh.agenerate(tokens, max_tokens=n, cache_salt=salt)
        except Exception as exc:  # judged after the run: only WorkerDied is allowed
            log.failed[type(exc).__name__] += 1
            log.first_error.setdefault(type(exc).__name__, str(exc))
            await asyncio.sleep(0.05)  # a client backs off after a failure
            continue
        log.answered.append(Answered(tuple(tokens), n, tuple(r.tokens), r.worker_id))


async def killer(mesh: KVMesh, rng: random.Random, log: SoakLog, end: float) -> None:
    loop = asyncio.get_running_loop()
    next_id = 100
    while True:
        await asyncio.sleep(rng.uniform(*KILL_EVERY_S))
        if time.monotonic() > end - 3.0:
            return
        alive = await loop.run_in_executor(None, live_workers)
        if len(alive) >= MIN_ALIVE:
            victim = rng.choice(sorted(alive))
            ray.kill(handle(victim), no_restart=True)
            log.killed.append(victim)
        wid = f"worker-{next_id}"
        next_id += 1
        log.handles.append(await loop.run_in_executor(None, lambda w=wid: start_worker(CONFIG, w)))
        log.started.append(wid)


async def soak(mesh: KVMesh, seconds: float, seed: int) -> SoakLog:
    log = SoakLog()
    end = time.monotonic() + seconds
    rng = random.Random(seed)
    tasks = [client(mesh, random.Random(rng.random()), log, end) for _ in range(CLIENTS)]
    await asyncio.gather(*tasks, killer(mesh, random.Random(rng.random()), log, end))
    return log


def test_random_worker_kills_under_mixed_load_never_give_a_wrong_answer_or_a_stale_index(
    mesh: KVMesh,
) -> None:
    t0 = time.monotonic()
    log = asyncio.run(soak(mesh, SOAK_S, seed=20261124))
    elapsed = time.monotonic() - t0
    print(
        f"\nsoak {elapsed:.0f} s: {len(log.answered)} answered, failed {dict(log.failed)}, "
        f"killed {log.killed}, started {log.started}"
    )
    assert log.killed, "the soak killed no worker: make it longer (KVMESH_SOAK_S)"
    assert len(log.answered) > 10 * len(log.killed)
    assert set(log.failed) <= {WorkerDied.__name__}, log.first_error
    served_by_dead = sum(a.worker_id in log.killed for a in log.answered)
    print(f"answers from workers later killed: {served_by_dead}")

    # Greedy decoding: an n-token answer is the first n tokens of the MAX_TOKENS answer.
    model = TinyTransformer(CONFIG.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # next to the workers, more threads only contend
    try:
        ref = {tuple(p): model.generate(p, MAX_TOKENS) for p in PROMPTS}
    finally:
        torch.set_num_threads(threads)
    wrong = [a for a in log.answered if list(a.answer) != ref[a.tokens][: a.max_tokens]]
    assert not wrong, f"{len(wrong)} of {len(log.answered)} answers differ from scratch"

    alive = live_workers()
    assert len(alive) >= MIN_ALIVE
    # Dead workers leave the registry (the client forgot them, or their heartbeats expired).
    assert wait_until(lambda: registered() == set(alive), 30.0, poll_s=0.1), registered()
    hashes: dict[PageHash, None] = {}
    for tokens, salt in log.sent:
        hashes.update(dict.fromkeys(mesh.hashes(tokens, salt)))
    everything = list(hashes)
    for wid in alive:
        worker = handle(wid)
        ray.get(worker.check_invariants.remote(), timeout=60)
        assert ray.get(worker.stats.remote(), timeout=60).pages_used == 0
        ray.get(worker.flush.remote(), timeout=60)
    index = index_of(coordinator())
    index.check_invariants()
    assert set(index.workers()) == set(alive)
    assert index.stale_workers() == set()
    for wid, address in alive.items():
        truth = held(address, everything)
        stats = ray.get(handle(wid).stats.remote(), timeout=60)
        assert stats.cached_pages == len(truth)
        assert index.worker_pages(WorkerId(wid)) == truth
