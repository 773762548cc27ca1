"""A real vLLM engine whose kvmesh store dies: a recompute, never an error.

The store runs as its own process (`StoreProcess`) and streams pages slowly
(its test hook), so it can be killed (SIGKILL) while the engine is loading
a prefix from it. It offers no shared memory (``--no-shm``): through an
arena a load makes no call that a dying store could fail (the pages stay
mapped, and each is checked by its seal; tests/engines/test_connector_store.py
covers a restarted store's new arena), so the calls a store can die in are
gRPC's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.store_client import StoreClient
from kvmesh.connector.store_launcher import StoreProcess, engine_block_nbytes
from kvmesh.engine_launcher import EngineSpec, VLLMEngine, engine_model
from tests.engines.connector_kit import (
    BLOCK,
    complete,
    external_hits,
    prompt_of,
    reset_prefix_cache,
    wait_saved,
)

PAGE_DELAY_S = 1.0  # every page the store streams waits this long: 6 blocks take 6 s


@dataclass
class Rig:
    engine: VLLMEngine
    store: StoreProcess

    def client(self) -> StoreClient:
        return StoreClient(self.store.page_address, self.store.control_address)


@pytest.fixture(scope="module")
def rig(start_engine, tmp_path_factory) -> Iterator[Rig]:  # type: ignore[no-untyped-def]
    store = StoreProcess(
        block_nbytes=engine_block_nbytes(engine_model(), BLOCK),
        block_size=BLOCK,
        pages=64,
        page_delay_s=PAGE_DELAY_S,
        log_dir=tmp_path_factory.mktemp("store"),
        shm=False,
    ).start()
    try:
        config = connector_config(store.page_address, store.control_address, timeout_s=60.0)
        spec = EngineSpec(block_size=BLOCK, extra_args=("--kv-transfer-config", config))
        yield Rig(start_engine(spec, name="connector-faults"), store)
    finally:
        store.stop()


def test_a_store_killed_mid_load_gives_a_recompute_with_the_right_answer(rig: Rig) -> None:
    prompt = prompt_of(11)
    expected = complete(rig.engine, prompt)
    wait_saved(rig.client(), prompt)
    reset_prefix_cache(rig.engine)
    before = external_hits(rig.engine)
    answer: list[list[int]] = []
    asking = threading.Thread(target=lambda: answer.append(complete(rig.engine, prompt)))
    started = time.monotonic()
    asking.start()
    time.sleep(2.0)  # the claim is made, the slow page stream has begun
    rig.store.kill()
    asking.join(120)
    assert answer == [expected]
    assert time.monotonic() - started < 6 * PAGE_DELAY_S + 60
    assert external_hits(rig.engine) - before == 6 * BLOCK  # claimed, then refused
    assert "load failed" in rig.engine.log_tail(400)


def test_with_the_store_down_requests_are_computed_and_nothing_is_claimed(rig: Rig) -> None:
    assert not rig.store.running()
    before = external_hits(rig.engine)
    prompt = prompt_of(12)
    first = complete(rig.engine, prompt)
    reset_prefix_cache(rig.engine)
    assert complete(rig.engine, prompt) == first
    assert external_hits(rig.engine) == before


def test_a_restarted_store_is_empty_and_filled_again(rig: Rig) -> None:
    rig.store.restart()
    time.sleep(1.5)  # the engine's channel redials within its longest backoff (1 s)
    prompt = prompt_of(13)
    expected = complete(rig.engine, prompt)  # computed, saved into the new store
    wait_saved(rig.client(), prompt)
    reset_prefix_cache(rig.engine)
    before = external_hits(rig.engine)
    assert complete(rig.engine, prompt) == expected
    assert external_hits(rig.engine) - before == 6 * BLOCK
