"""Prefill/decode across two real vLLM engines through kvmesh: the tokens of one engine.

The prefill engine (``kv_producer``) computes the prompt and saves its
blocks into the mesh; the decode engine (``kv_consumer``) loads them instead
of computing them, and saves nothing. Each has a store beside it; the
decode engine's store pulls the prompt's blocks from the prefill engine's.
"""

from __future__ import annotations

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
    digests,
    external_hits,
    prompt_of,
    reset_prefix_cache,
)


@dataclass
class PD:
    prefill: VLLMEngine
    decode: VLLMEngine
    sp: EngineStore
    sd: EngineStore


@pytest.fixture(scope="module")
def pd(start_engine) -> Iterator[PD]:  # type: ignore[no-untyped-def]
    page_bytes = sealed_page_bytes(engine_block_nbytes(engine_model(), BLOCK), BLOCK)
    with (
        EngineStore(page_bytes=page_bytes, block_size=BLOCK, num_pages=64, name="sp") as sp,
        EngineStore(page_bytes=page_bytes, block_size=BLOCK, num_pages=64, name="sd") as sd,
    ):
        producer = connector_config(sp.address, sp.control_address, role="kv_producer")
        consumer = connector_config(
            sd.address, sd.control_address, role="kv_consumer", peers=[sp.address]
        )
        prefill = start_engine(
            EngineSpec(block_size=BLOCK, extra_args=("--kv-transfer-config", producer)),
            name="connector-prefill",
        )
        decode = start_engine(
            EngineSpec(block_size=BLOCK, extra_args=("--kv-transfer-config", consumer)),
            name="connector-decode",
        )
        yield PD(prefill, decode, sp, sd)


def test_prefill_then_decode_on_another_engine_gives_one_engines_tokens(pd: PD) -> None:
    prompt = prompt_of(21)
    complete(pd.prefill, prompt, max_tokens=1)  # the prefill: one token, the blocks saved
    assert pd.sp.service.prefix_length(digests(prompt)) == 6  # type: ignore[arg-type]
    before = external_hits(pd.decode)
    decoded = complete(pd.decode, prompt)
    assert external_hits(pd.decode) - before == 6 * BLOCK  # the prompt was loaded, not computed
    assert decoded == complete(pd.prefill, prompt)  # one engine, prompt and answer


def test_the_consumer_saves_nothing_and_the_producer_loads_nothing(pd: PD) -> None:
    prompt = prompt_of(22)
    complete(pd.decode, prompt)  # computed on the consumer: no blocks of it anywhere
    assert pd.sd.service.prefix_length(digests(prompt)) == 0  # type: ignore[arg-type]
    assert pd.sp.service.prefix_length(digests(prompt)) == 0  # type: ignore[arg-type]
    held = prompt_of(21)  # the first test's prompt: its blocks are in the producer's store
    reset_prefix_cache(pd.prefill)
    before = external_hits(pd.prefill)
    complete(pd.prefill, held)
    assert external_hits(pd.prefill) == before  # a producer never claims blocks
