"""End to end on a real local Ray cluster: client -> coordinator actor -> worker actors.

One embedded cluster per module (3 workers, the default small model); the
disaggregation test adds a prefill and a decode worker under their own
coordinator namespace in the same Ray cluster. Reference answers come from a
`TinyTransformer` built in this process (same seed, so the same weights),
computing each prompt whole, from scratch. The tests that kill workers run
last: they shrink the cluster.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmesh.app import connect
from kvmesh.client import KVMesh
from kvmesh.config import (
    ClusterConfig,
    CoordinatorConfig,
    HashConfig,
    PoolConfig,
    TransferConfig,
)
from kvmesh.errors import ConfigError, WorkerDied
from kvmesh.worker.model import TinyTransformer

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

PAGE = 16
CONFIG = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=256))


@pytest.fixture(scope="module")
def mesh(fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    # Logical CPUs for every worker the module starts: 3 + 2 disaggregated + 2 + 2 dist.
    return fresh_cluster(num_workers=3, config=CONFIG, num_cpus=6)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG.model)


_rng = random.Random(20261123)


def fresh_prompt(pages: int, extra: int = 5) -> list[int]:
    """A prompt no other test uses: `pages` full pages plus a partial one."""
    return [_rng.randrange(CONFIG.model.vocab_size) for _ in range(pages * PAGE + extra)]


def reusable_pages(tokens: list[int]) -> int:
    """Pages a worker can take from cache: never the page of the prompt's last token."""
    return (len(tokens) - 1) // PAGE


def test_the_same_prompt_twice_hits_the_second_time(mesh: KVMesh, model: TinyTransformer) -> None:
    prompt = fresh_prompt(6)
    first = mesh.generate(prompt, max_tokens=8)
    second = mesh.generate(prompt, max_tokens=8)
    assert first.pages_hit_local == 0
    assert first.pages_computed == 7
    assert second.worker_id == first.worker_id
    assert second.pages_hit_local == reusable_pages(prompt) == 6
    assert second.pages_computed == 1
    assert second.promised_local == 6  # the router predicted the hit
    assert list(first.tokens) == list(second.tokens) == model.generate(prompt, 8)


def test_text_prompts_go_through_the_byte_tokenizer(mesh: KVMesh, model: TinyTransformer) -> None:
    text = "kvmesh routes requests to the worker that already holds their prefix."
    result = mesh.generate(text, max_tokens=4)
    assert list(result.tokens) == model.generate(list(text.encode()), 4)


def test_route_predicts_the_worker_that_holds_the_prefix(mesh: KVMesh) -> None:
    prompt = fresh_prompt(4)
    served = mesh.generate(prompt, max_tokens=1)
    decision = mesh.route(prompt)
    assert decision.worker_id == served.worker_id
    assert decision.local_pages == 4


def pull_elsewhere(mesh: KVMesh, shared: list[int]) -> tuple[list[int], Any]:
    """Serve `shared` on one worker, then a prompt extending it on another (which may pull)."""
    owner = mesh.generate([*shared, 1, 2, 3], max_tokens=2).worker_id
    mesh.set_policy("round_robin")  # send the next requests anywhere, not to the owner
    try:
        for _ in range(len(mesh.workers())):  # round robin reaches a non-owner in time
            prompt = shared + fresh_prompt(2)
            result = mesh.generate(prompt, max_tokens=6)
            if result.worker_id != owner:
                return prompt, result
    finally:
        mesh.set_policy(CONFIG.coordinator.policy)
    pytest.fail("round robin never left the owner")


def test_a_prefix_held_by_another_worker_is_pulled_over_grpc(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    shared = fresh_prompt(8, extra=0)
    before = mesh.stats().mismatches
    prompt, result = pull_elsewhere(mesh, shared)
    assert result.pages_pulled == 8
    assert result.pages_hit_local == 0
    assert result.promised_pull == 8
    assert result.pull_error is None
    assert result.timings.pull_ms > 0
    assert list(result.tokens) == model.generate(prompt, 6)
    assert mesh.stats().mismatches == before  # promised and realized agree
    # The pulled pages are now the puller's own: the index routes to either holder.
    assert mesh.route([*shared, 7]).local_pages == 8


def test_cache_salt_separates_tenants(mesh: KVMesh, model: TinyTransformer) -> None:
    prompt = fresh_prompt(5)
    a1 = mesh.generate(prompt, max_tokens=3, cache_salt="tenant-a")
    b = mesh.generate(prompt, max_tokens=3, cache_salt="tenant-b")
    a2 = mesh.generate(prompt, max_tokens=3, cache_salt="tenant-a")
    assert a1.pages_hit_local == 0
    assert (b.pages_hit_local, b.pages_pulled) == (0, 0)  # no hit and no pull across salts
    # The same tenant reuses all 5 pages (caching is on): a local hit, or a pull when the
    # router weighs the holder's load against pulling to another worker.
    assert a2.pages_hit_local + a2.pages_pulled == 5
    assert list(a1.tokens) == list(b.tokens) == list(a2.tokens) == model.generate(prompt, 3)


def test_a_router_hashing_disagreement_shows_up_as_mismatches(mesh: KVMesh) -> None:
    prompt = fresh_prompt(4)
    mesh.generate(prompt, max_tokens=1)
    before = mesh.stats()
    # A second client in this process joins the running cluster with another hash
    # seed: its routes can never match what the workers (original seed) hold.
    wrong = dataclasses.replace(CONFIG, hash=HashConfig(seed="not-the-cluster-seed"))
    other = connect(config=wrong)
    try:
        hits = 0
        for _ in range(4):  # 3 workers: some request lands where the prompt is cached
            result = other.generate(prompt, max_tokens=1)
            assert result.promised_local == 0
            hits += result.pages_hit_local
    finally:
        other.close()
    after = mesh.stats()
    assert hits > 0
    assert after.mismatches > before.mismatches
    assert after.coordinator["realized_local_pages"] > before.coordinator["realized_local_pages"]


def test_stats_report_every_worker_and_the_cluster_hit_ratio(mesh: KVMesh) -> None:
    stats = mesh.stats()
    assert {w.worker_id for w in stats.workers} == {"worker-0", "worker-1", "worker-2"}
    assert stats.requests > 0
    assert 0 < stats.page_hit_ratio < 1
    assert stats.coordinator["workers"] == 3
    assert all(w.last_seq >= 0 and not w.draining for w in stats.workers)
    assert stats.to_dict()["workers"][0]["worker_id"]


@pytest.fixture(scope="module")
def disaggregated(mesh: KVMesh, fresh_cluster: Callable[..., KVMesh]) -> KVMesh:
    cfg = dataclasses.replace(
        CONFIG, coordinator=CoordinatorConfig(namespace="kvmesh-disaggregated")
    )
    return fresh_cluster(config=cfg, prefill_workers=1, decode_workers=1)


def test_disaggregated_mode_gives_the_same_tokens(
    mesh: KVMesh, disaggregated: KVMesh, model: TinyTransformer
) -> None:
    assert {w["role"] for w in disaggregated.workers()} == {"prefill", "decode"}
    prompt = fresh_prompt(7)
    split = disaggregated.generate(prompt, max_tokens=10)
    whole = mesh.generate(prompt, max_tokens=10)
    assert split.worker_id == "decode-0"
    # The decode worker computed only the last (partial) page: the rest was pushed to it.
    assert split.pages_hit_local == 7
    assert split.pages_computed == 1
    assert list(split.tokens) == list(whole.tokens) == model.generate(prompt, 10)
    prefill = next(w for w in disaggregated.stats().workers if w.role == "prefill")
    assert prefill.pages_pushed == 7


def test_disaggregated_mode_reuses_the_decode_workers_pages(disaggregated: KVMesh) -> None:
    prompt = fresh_prompt(3)
    disaggregated.generate(prompt, max_tokens=2)
    again = disaggregated.generate(prompt + [9] * 20, max_tokens=2)
    assert again.pages_hit_local >= 3


def test_more_workers_than_the_cluster_has_cpus_for_is_a_clear_error(mesh: KVMesh) -> None:
    cfg = dataclasses.replace(CONFIG, coordinator=CoordinatorConfig(namespace="kvmesh-too-big"))
    with pytest.raises(ConfigError, match="need 40 CPUs but the Ray cluster has 6"):
        connect(config=cfg, num_workers=40, worker_num_cpus=1)


# -- torch.distributed transport -----------------------------------------------------------------


def dist_cluster(namespace: str, **workers: int) -> KVMesh:
    cfg = dataclasses.replace(
        CONFIG,
        coordinator=CoordinatorConfig(namespace=namespace),
        transfer=TransferConfig(transport="dist"),
    )
    return connect(config=cfg, **workers)


@pytest.fixture(scope="module")
def dist_mesh(mesh: KVMesh) -> Iterator[KVMesh]:
    with dist_cluster("kvmesh-dist", num_workers=2) as m:
        yield m


def test_with_transport_dist_pulls_go_over_a_torch_distributed_link(
    dist_mesh: KVMesh, model: TinyTransformer
) -> None:
    shared = fresh_prompt(6, extra=0)
    prompt, result = pull_elsewhere(dist_mesh, shared)
    assert (result.pages_pulled, result.pull_error) == (6, None)
    assert list(result.tokens) == model.generate(prompt, 6)
    puller = next(w for w in dist_mesh.stats().workers if w.worker_id == result.worker_id)
    assert (puller.pulls_dist, puller.pulls_grpc, puller.dist_fallbacks) == (1, 0, 0)
    assert puller.links_opened == 1
    assert dist_mesh.stats().coordinator["links_opened"] == 1


def test_with_transport_dist_prefill_pushes_over_a_link(
    dist_mesh: KVMesh, model: TinyTransformer
) -> None:
    with dist_cluster("kvmesh-dist-disaggregated", prefill_workers=1, decode_workers=1) as split:
        prompt = fresh_prompt(5)
        result = split.generate(prompt, max_tokens=4)
        assert (result.worker_id, result.pages_hit_local, result.pages_computed) == (
            "decode-0",
            5,
            1,
        )
        assert list(result.tokens) == model.generate(prompt, 4)
        prefill = next(w for w in split.stats().workers if w.role == "prefill")
        assert (prefill.pages_pushed, prefill.pushes_dist, prefill.pushes_grpc) == (5, 1, 0)


# -- faults: these run last, they remove workers -----------------------------------------------


def _kill_when_busy(mesh: KVMesh, killed: list[str], stop: threading.Event) -> None:
    """Kill the first worker seen serving a request (polled through its own stats)."""
    import ray

    while not stop.is_set():
        for info in mesh.workers():
            handle = mesh.worker(info["worker_id"])
            try:
                busy = ray.get(handle.stats.remote(), timeout=5).running > 0
            except Exception:
                continue
            if busy:
                ray.kill(handle, no_restart=True)
                killed.append(info["worker_id"])
                return
        time.sleep(0.01)


def _generate_while_killing(client: KVMesh, mesh: KVMesh, prompt: list[int], n: int) -> Any:
    killed: list[str] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_busy, args=(mesh, killed, stop), daemon=True)
    killer.start()
    try:
        return client.generate(prompt, max_tokens=n), killed
    finally:
        stop.set()
        killer.join(timeout=30)


def test_a_worker_killed_during_a_request_is_retried_on_another_with_the_right_answer(
    mesh: KVMesh, model: TinyTransformer
) -> None:
    prompt = fresh_prompt(2)
    result, killed = _generate_while_killing(mesh, mesh, prompt, 600)  # long: ~1 s of decoding
    assert len(killed) == 1
    assert result.worker_id != killed[0]
    assert list(result.tokens) == model.generate(prompt, 600)
    assert killed[0] not in {w.worker_id for w in mesh.stats().workers}


def test_without_retries_a_killed_worker_gives_a_clear_error(mesh: KVMesh) -> None:
    strict = connect(config=CONFIG, retries=0)
    try:
        with pytest.raises(WorkerDied, match="died"):
            _generate_while_killing(strict, mesh, fresh_prompt(2), 600)
    finally:
        strict.close()
