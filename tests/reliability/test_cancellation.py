"""A caller that gives up stops its request's work on the worker (issue 12).

One embedded Ray cluster with one worker. Each test starts a request long
enough (a ~4000-token prompt computed 32 tokens at a time, then ~4000 decode
steps: seconds of work) that it is still computing when the caller gives up,
then waits, within a generous bound, for the worker's state to show the
request stopped: `requests_cancelled` up by one, `requests` (answered) not,
nothing running, no page held. How the caller gives up:

- its awaiting task is cancelled (what Ctrl-C does): the client calls
  `ray.cancel`, the worker sees the task's cancel flag;
- its `request_timeout_s` passes: the same, after `DeadlineExceeded`;
- nobody cancels, but the request's own `timeout_s` passes on the worker
  (a caller that cannot cancel): the worker raises `RequestExpired`;
- its process dies (SIGKILL): the worker sees the caller's Ray job dead.

No assertion is on wall time; the bounds only keep a failing run finite.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
from reliability_kit import random_prompt, wait_until

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, CoordinatorConfig, ModelConfig, PoolConfig
from kvmesh.errors import DeadlineExceeded, RequestExpired
from kvmesh.requests import GenerateRequest
from kvmesh.worker.model import TinyTransformer

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

PAGE = 16
PROMPT_PAGES = 250  # 4000 tokens, 125 prefill chunks
ANSWER = 4000  # decode steps after them (8000 positions of the 8192)
BOUND_S = 60.0  # how long a stopped request may take to show as stopped; not a timing
NAMESPACE = "kvmesh-reliability-cancel"
CONFIG = dataclasses.replace(
    ClusterConfig(),
    model=ModelConfig(prefill_chunk_tokens=2 * PAGE),
    pool=PoolConfig(num_pages=1024),
    coordinator=CoordinatorConfig(namespace=NAMESPACE),
)

_rng = random.Random(20261124)


def long_prompt() -> list[int]:
    return random_prompt(_rng, PROMPT_PAGES, PAGE)


@pytest.fixture(scope="module")
def mesh(fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    return fresh_cluster(num_workers=1, config=CONFIG, num_cpus=2)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG.model)


def worker(mesh: KVMesh) -> Any:
    return mesh.worker(mesh.workers()[0]["worker_id"])


def stats(mesh: KVMesh) -> Any:
    return ray.get(worker(mesh).stats.remote(), timeout=60)


def wait_running(mesh: KVMesh) -> None:
    assert wait_until(lambda: stats(mesh).running == 1, BOUND_S), "the request never started"


def assert_stopped_unanswered(mesh: KVMesh, before: Any) -> None:
    """The worker stopped the request (counted, not answered) and holds nothing for it."""

    def stopped() -> bool:
        now = stats(mesh)
        return now.requests_cancelled == before.requests_cancelled + 1 and now.running == 0

    assert wait_until(stopped, BOUND_S), f"still running or not counted: {stats(mesh)}"
    after = stats(mesh)
    assert after.requests == before.requests  # it never produced an answer
    assert (after.waiting, after.pages_used) == (0, 0)
    ray.get(worker(mesh).check_invariants.remote(), timeout=60)


def assert_serves_the_next_request(mesh: KVMesh, model: TinyTransformer) -> None:
    before = stats(mesh)
    prompt = random_prompt(_rng, 3, PAGE)
    result = mesh.generate(prompt, 8)
    assert list(result.tokens) == model.generate(prompt, 8)
    assert stats(mesh).requests == before.requests + 1


def test_a_client_call_cancelled_mid_request_stops_the_worker(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    before = stats(mesh)

    async def cancel_mid_request() -> None:
        call = asyncio.ensure_future(mesh.agenerate(long_prompt(), ANSWER))
        while (await worker(mesh).stats.remote()).running == 0:
            assert not call.done(), call
            await asyncio.sleep(0.02)
        call.cancel()  # what Ctrl-C does to the awaiting task
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(asyncio.wait_for(cancel_mid_request(), BOUND_S))
    assert_stopped_unanswered(mesh, before)
    assert_serves_the_next_request(mesh, model)


def test_a_request_whose_client_deadline_passes_is_stopped_on_the_worker(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    before = stats(mesh)
    mesh.request_timeout_s = 1.0
    try:
        with pytest.raises(DeadlineExceeded, match="did not answer within"):
            mesh.generate(long_prompt(), ANSWER)
    finally:
        mesh.request_timeout_s = 120.0
    assert_stopped_unanswered(mesh, before)
    assert_serves_the_next_request(mesh, model)


def test_a_request_past_its_own_deadline_is_stopped_even_if_nobody_cancels_it(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    before = stats(mesh)
    request = GenerateRequest("no-cancel", tuple(long_prompt()), ANSWER, timeout_s=0.5)
    ref = worker(mesh).generate.remote(request)
    with pytest.raises(RequestExpired, match="passed its deadline"):
        ray.get(ref, timeout=BOUND_S)  # waits for the worker's answer, never cancels
    assert_stopped_unanswered(mesh, before)
    assert_serves_the_next_request(mesh, model)


ORPHAN = textwrap.dedent(
    """
    import json, sys
    from kvmesh.app import connect
    from kvmesh.config import ClusterConfig, CoordinatorConfig

    address, namespace, request = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    config = ClusterConfig(coordinator=CoordinatorConfig(namespace=namespace))
    mesh = connect(address, config=config)  # joins: the cluster's workers serve it
    print("connected", flush=True)
    mesh.generate(request["prompt"], request["max_tokens"])  # killed while this computes
    """
)


def test_a_client_process_that_dies_mid_request_has_its_work_stopped(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    before = stats(mesh)
    request = json.dumps({"prompt": long_prompt(), "max_tokens": ANSWER})
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, mesh.ray_address, NAMESPACE, request],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
        wait_running(mesh)
        proc.send_signal(signal.SIGKILL)  # no ray.cancel, no goodbye; its deadline is 120 s
        proc.wait(timeout=60)
        assert_stopped_unanswered(mesh, before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert_serves_the_next_request(mesh, model)
