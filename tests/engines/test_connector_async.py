"""A slow pull off the engine's scheduler: one real vLLM engine, its store, a slow peer store.

The store beside the engine pulls a prompt's blocks from a peer whose page
server is slowed (`EngineStore`'s ``page_delay_s`` test hook). The
connector's ``Prepare`` runs off the scheduler, so another request on the
same engine is answered while the pull is still under way, and the first
request then loads the pulled blocks rather than computing them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvmesh.connector.blocks import sealed_page_bytes
from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.store_launcher import engine_block_nbytes
from kvmesh.engine_launcher import EngineSpec, VLLMEngine, engine_model
from kvmesh.worker.engine_store import EngineStore
from tests.engines.connector_kit import (
    BLOCK,
    complete,
    computed_then_moved,
    external_hits,
    held,
    prompt_of,
)

PAGE_DELAY_S = 0.4  # per page the slow peer streams: a 6-block pull takes 2.4 s


@dataclass
class SlowPeer:
    engine: VLLMEngine
    own: EngineStore
    slow: EngineStore


@pytest.fixture(scope="module")
def slow_peer(start_engine) -> Iterator[SlowPeer]:  # type: ignore[no-untyped-def]
    page_bytes = sealed_page_bytes(engine_block_nbytes(engine_model(), BLOCK), BLOCK)
    with (
        EngineStore(page_bytes=page_bytes, block_size=BLOCK, num_pages=64, name="own") as own,
        EngineStore(
            page_bytes=page_bytes,
            block_size=BLOCK,
            num_pages=64,
            name="slow",
            page_delay_s=PAGE_DELAY_S,
        ) as slow,
    ):
        config = connector_config(
            own.address, own.control_address, peers=[slow.address], timeout_s=30.0
        )
        engine = start_engine(
            EngineSpec(block_size=BLOCK, extra_args=("--kv-transfer-config", config)),
            name="connector-slow-peer",
        )
        yield SlowPeer(engine, own, slow)


def test_a_slow_pull_does_not_hold_up_another_request_on_the_engine(
    slow_peer: SlowPeer,
) -> None:
    held_prompt, pulled_prompt = prompt_of(42), prompt_of(41)
    complete(slow_peer.engine, held_prompt, max_tokens=1)  # its blocks: in the engine's store
    answer = computed_then_moved(
        slow_peer.engine, slow_peer.own, slow_peer.slow, pulled_prompt
    )  # (resets the engine's cache)
    assert held(slow_peer.own, held_prompt) == 6
    before = external_hits(slow_peer.engine)
    results: list[list[int]] = []
    waiting = threading.Thread(
        target=lambda: results.append(complete(slow_peer.engine, pulled_prompt)), daemon=True
    )
    waiting.start()
    time.sleep(0.3)  # a head start: its Prepare (the 2.4 s pull) is under way
    complete(slow_peer.engine, held_prompt, max_tokens=1)  # loaded from the engine's store
    # answered while the pull still runs (the old, synchronous Prepare waited for it)
    assert held(slow_peer.own, pulled_prompt) < 6
    assert waiting.is_alive()
    waiting.join(timeout=60)
    assert results == [answer]  # the pulled blocks give the engine's own answer
    assert external_hits(slow_peer.engine) - before == 2 * 6 * BLOCK  # both loaded, not computed
