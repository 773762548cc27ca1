"""A pull never holds the scheduler: a real vLLM engine, its store, and a peer store whose
directory it reads (``peer_controls``).

Only the peer holds a prompt's blocks. By default (``direct_pulls``) the
scheduler claims them from the directories and the worker copies them out of
the peer's arena in the step, checked by their seals, with no call to either
store. With ``direct_pulls`` off, the claim is an asynchronous load (vLLM
parks the request in ``WAITING_FOR_REMOTE_KVS``); the worker asks its store
to pull them (slowed by the store's ``page_delay_s`` test hook), loads them
and reports the request done. Meanwhile the engine answers other requests,
the connector never answers "not yet" (no skipped step), and the pulled
blocks give the engine's own answer. A block the peer lost before the pull
is recomputed, never an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.benchmarks.connector_overhead import connector_samples
from kvmesh.connector.blocks import sealed_page_bytes
from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.hook_timings import TIMINGS_ENV
from kvmesh.connector.store_launcher import engine_block_nbytes
from kvmesh.engine_launcher import EngineSpec, VLLMEngine, engine_model
from kvmesh.worker.engine_store import EngineStore
from tests.engines.connector_kit import (
    BLOCK,
    complete,
    computed_then_moved,
    digests,
    external_hits,
    held,
    prompt_of,
    wait_until,
)

PAGE_DELAY_S = 0.4  # per page the engine's store pulls: a 6-block pull takes 2.4 s


@dataclass
class Mesh:
    engine: VLLMEngine
    own: EngineStore
    peer: EngineStore
    timings: Path

    def answers(self, answer: str) -> float:
        """How often the connector answered `answer` so far (its process writes them)."""
        return connector_samples(self.timings).get(
            ("kvmesh_connector_prepare_answers_total", answer), 0.0
        )

    def blocks(self, outcome: str) -> float:
        """The connector's ``kvmesh_connector_blocks`` of `outcome`, from its timing files."""
        total = 0.0
        for path in self.timings.glob("connector-*.prom"):
            for family in text_string_to_metric_families(path.read_text()):
                for s in family.samples:
                    if s.name == "kvmesh_connector_blocks_total" and s.labels["outcome"] == outcome:
                        total += s.value
        return total


@contextmanager
def pair_of_stores(
    start_engine: Callable[..., VLLMEngine], timings: Path, *, direct: bool, own_delay_s: float
) -> Iterator[Mesh]:
    """An engine whose store is `own` and whose one peer is `peer`, both in process; pulls
    direct (copied out of the peer's arena in the step) or through `own` (asynchronous)."""
    page_bytes = sealed_page_bytes(engine_block_nbytes(engine_model(), BLOCK), BLOCK)
    kind = "direct" if direct else "async"
    with (
        EngineStore(
            page_bytes=page_bytes,
            block_size=BLOCK,
            num_pages=64,
            name=f"own-{kind}",
            page_delay_s=own_delay_s,
        ) as own,
        EngineStore(
            page_bytes=page_bytes, block_size=BLOCK, num_pages=64, name=f"peer-{kind}"
        ) as peer,
    ):
        config = connector_config(
            own.address,
            own.control_address,
            peers=[peer.address],
            peer_controls=[peer.control_address],
            timeout_s=30.0,
            direct_pulls=direct,
        )
        engine = start_engine(
            EngineSpec(
                block_size=BLOCK,
                extra_args=("--kv-transfer-config", config),
                extra_env={TIMINGS_ENV: str(timings)},
            ),
            name=f"connector-{kind}-pull",
        )
        yield Mesh(engine, own, peer, timings)


@pytest.fixture(scope="module")
def mesh(start_engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:  # type: ignore[no-untyped-def]
    timings = tmp_path_factory.mktemp("hook-timings")
    with pair_of_stores(start_engine, timings, direct=False, own_delay_s=PAGE_DELAY_S) as pair:
        yield pair


def test_a_pull_is_loaded_asynchronously_and_never_skips_a_step(mesh: Mesh) -> None:
    held_prompt, pulled_prompt = prompt_of(52), prompt_of(51)
    complete(mesh.engine, held_prompt, max_tokens=1)  # its blocks: in the engine's store
    answer = computed_then_moved(
        mesh.engine, mesh.own, mesh.peer, pulled_prompt
    )  # (resets the engine's cache)
    assert held(mesh.own, held_prompt) == 6
    wait_until(lambda: mesh.answers("read") > 0, "the connector's answers in its timing file")
    pending, claimed = mesh.answers("pending"), mesh.answers("async")
    before = external_hits(mesh.engine)
    results: list[list[int]] = []
    waiting = threading.Thread(
        target=lambda: results.append(complete(mesh.engine, pulled_prompt)), daemon=True
    )
    waiting.start()
    time.sleep(0.3)  # a head start: its pull (2.4 s) is under way
    complete(mesh.engine, held_prompt, max_tokens=1)  # loaded from the engine's store
    assert held(mesh.own, pulled_prompt) < 6  # answered while the pull still runs
    assert waiting.is_alive()
    waiting.join(timeout=60)
    assert results == [answer]  # the pulled blocks give the engine's own answer
    assert held(mesh.own, pulled_prompt) == 6  # pulled into the engine's store
    assert external_hits(mesh.engine) - before == 2 * 6 * BLOCK  # both loaded, not computed
    wait_until(lambda: mesh.answers("async") > claimed, "the asynchronous claim to be written")
    time.sleep(1.0)  # the timing file is rewritten every 0.5 s
    assert mesh.answers("pending") == pending  # the scheduler never waited for the pull


def test_blocks_the_peer_lost_before_the_pull_are_recomputed(mesh: Mesh) -> None:
    prompt = prompt_of(53)
    answer = computed_then_moved(mesh.engine, mesh.own, mesh.peer, prompt)
    time.sleep(1.0)  # the timing file is rewritten every 0.5 s
    loaded, undelivered = mesh.blocks("loaded"), mesh.blocks("undelivered")
    # the scheduler claims all six from the peer's directory, but the peer drops the last
    # three before the pull reads it (the test hook delays the pull's start)
    losing = threading.Thread(
        target=lambda: (time.sleep(0.5), mesh.peer.forget(digests(prompt)[3:])), daemon=True
    )
    losing.start()
    assert complete(mesh.engine, prompt) == answer  # recomputed, not an error
    losing.join()
    wait_until(lambda: mesh.blocks("undelivered") == undelivered + 3, "the blocks not loaded")
    assert mesh.blocks("loaded") == loaded + 3


@pytest.fixture(scope="module")
def direct(start_engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:  # type: ignore[no-untyped-def]
    timings = tmp_path_factory.mktemp("direct-timings")
    with pair_of_stores(start_engine, timings, direct=True, own_delay_s=0.0) as pair:
        yield pair


def test_a_peers_blocks_are_copied_out_of_its_arena_in_the_step_with_no_pull(
    direct: Mesh,
) -> None:
    prompt = prompt_of(54)
    answer = computed_then_moved(direct.engine, direct.own, direct.peer, prompt)
    time.sleep(1.0)  # the timing file is rewritten every 0.5 s
    before, from_peers = external_hits(direct.engine), direct.answers("peers")
    pending, pulled = direct.answers("pending"), direct.answers("async")
    assert complete(direct.engine, prompt) == answer
    assert external_hits(direct.engine) - before == 6 * BLOCK  # loaded, not computed
    assert held(direct.own, prompt) == 0  # not pulled through the engine's store
    wait_until(lambda: direct.answers("peers") > from_peers, "the claim from the peer's arena")
    assert (direct.answers("pending"), direct.answers("async")) == (pending, pulled)
