"""Real vLLM engines with kvmesh's KV connector: the mesh as the engines' KV cache.

Two engines, each with a kvmesh store beside it (`EngineStore`, run in this
process so a test can reach a stored page), each store the other's peer::

    engine A ── store SA ◄── peer ──► store SB ── engine B

What the engines report (``vllm:external_prefix_cache_hits``: prompt tokens
loaded through the connector) and their greedy tokens are the evidence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from kvmesh.connector.blocks import sealed_page_bytes
from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.store_launcher import engine_block_nbytes
from kvmesh.engine_launcher import EngineSpec, VLLMEngine, engine_model
from kvmesh.types import PageHash
from kvmesh.worker.engine_store import BlockRun as StoreRun
from kvmesh.worker.engine_store import EngineStore
from tests.engines.connector_kit import (
    BLOCK,
    complete,
    digests,
    external_hits,
    prompt_of,
    reset_prefix_cache,
    wait_until,
)


@dataclass
class Mesh:
    a: VLLMEngine
    b: VLLMEngine
    sa: EngineStore
    sb: EngineStore


def held(store: EngineStore, prompt: list[int], salt: str | None = None) -> int:
    return store.service.prefix_length(digests(prompt, salt))  # type: ignore[arg-type]


def saved(store: EngineStore, prompt: list[int], salt: str | None = None) -> None:
    """Until `store` holds the prompt's 6 full blocks (the engine saves off its step)."""
    wait_until(lambda: held(store, prompt, salt) == 6, "the engine's saves to land")


@pytest.fixture(scope="module")
def mesh(start_engine) -> Iterator[Mesh]:  # type: ignore[no-untyped-def]
    page_bytes = sealed_page_bytes(engine_block_nbytes(engine_model(), BLOCK), BLOCK)
    with (
        EngineStore(page_bytes=page_bytes, block_size=BLOCK, num_pages=128, name="sa") as sa,
        EngineStore(page_bytes=page_bytes, block_size=BLOCK, num_pages=128, name="sb") as sb,
    ):
        specs = [
            EngineSpec(
                block_size=BLOCK,
                extra_args=(
                    "--kv-transfer-config",
                    connector_config(own.address, own.control_address, peers=[other.address]),
                ),
            )
            for own, other in ((sa, sb), (sb, sa))
        ]
        a = start_engine(specs[0], name="connector-a")
        b = start_engine(specs[1], name="connector-b")
        yield Mesh(a, b, sa, sb)


def test_an_engine_saves_every_full_block_it_computes_into_its_store(mesh: Mesh) -> None:
    prompt = prompt_of(1)
    complete(mesh.a, prompt)
    saved(mesh.sa, prompt)
    assert held(mesh.sb, prompt) == 0


def test_a_fresh_engine_loads_a_prompt_its_peer_store_holds_and_answers_the_same(
    mesh: Mesh,
) -> None:
    prompt = prompt_of(2)
    expected = complete(mesh.a, prompt)
    saved(mesh.sa, prompt)
    assert held(mesh.sb, prompt) == 0
    before = external_hits(mesh.b)
    assert complete(mesh.b, prompt) == expected
    assert external_hits(mesh.b) - before == 6 * BLOCK  # every full block loaded, none computed
    assert held(mesh.sb, prompt) == 6  # pulled from SA over the Peer contract


def test_an_engine_loads_from_its_own_store_after_its_prefix_cache_is_gone(mesh: Mesh) -> None:
    prompt = prompt_of(3)
    expected = complete(mesh.a, prompt)
    saved(mesh.sa, prompt)
    reset_prefix_cache(mesh.a)
    before = external_hits(mesh.a)
    assert complete(mesh.a, prompt) == expected
    assert external_hits(mesh.a) - before == 6 * BLOCK


def test_a_corrupted_stored_block_is_refused_and_recomputed_with_the_right_answer(
    mesh: Mesh,
) -> None:
    prompt = prompt_of(4)
    expected = complete(mesh.a, prompt)
    saved(mesh.sa, prompt)
    reset_prefix_cache(mesh.a)
    with mesh.sa.service.pinned(digests(prompt)[2:3]) as ids:  # type: ignore[arg-type]
        (page_id,) = ids
        assert page_id is not None
        mesh.sa.kv.kv[page_id].fill_(7)  # the stored bytes change under the seal
    assert complete(mesh.a, prompt) == expected
    assert "check of block" in mesh.a.log_tail(400)
    # the refused block was dropped from the store and saved again as recomputed
    saved(mesh.sa, prompt)
    reset_prefix_cache(mesh.a)
    before = external_hits(mesh.a)
    assert complete(mesh.a, prompt) == expected
    assert external_hits(mesh.a) - before == 6 * BLOCK


def test_tenants_never_load_each_others_blocks(mesh: Mesh) -> None:
    prompt = prompt_of(5)
    expected = complete(mesh.a, prompt, cache_salt="tenant-1")
    saved(mesh.sa, prompt, "tenant-1")
    assert held(mesh.sa, prompt) == 0  # another name for every block
    before = external_hits(mesh.b)
    assert complete(mesh.b, prompt, cache_salt="tenant-2") == expected
    assert external_hits(mesh.b) == before  # nothing of tenant-1 was loaded
    assert complete(mesh.b, prompt, cache_salt="tenant-1") == expected
    assert external_hits(mesh.b) - before == 6 * BLOCK  # the same tenant does load


def test_nothing_is_claimed_when_the_store_holds_nothing(mesh: Mesh) -> None:
    before = external_hits(mesh.b)
    complete(mesh.b, prompt_of(6))
    assert external_hits(mesh.b) == before


def test_blocks_move_through_the_stores_shared_memory_not_the_socket(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged: list[int] = []
    located: list[int] = []
    prepared: list[int] = []
    save_staged, locate, prepare = mesh.sa.save_staged, mesh.sa.locate, mesh.sa.prepare

    def saving(run: StoreRun, lease: bytes, slots: Sequence[int]) -> list[bool]:
        staged.append(len(slots))
        return save_staged(run, lease, slots)

    def locating(hashes: Sequence[PageHash]) -> list[int]:
        slots = locate(hashes)
        located.append(len(slots))
        return slots

    def preparing(run: StoreRun, peers: Sequence[str] = ()) -> tuple[int, int, str | None]:
        prepared.append(len(run.digests))
        return prepare(run, peers)

    monkeypatch.setattr(mesh.sa, "save_staged", saving)
    monkeypatch.setattr(mesh.sa, "locate", locating)
    monkeypatch.setattr(mesh.sa, "prepare", preparing)
    prompt = prompt_of(7)
    expected = complete(mesh.a, prompt)
    saved(mesh.sa, prompt)
    assert sum(staged) >= 6  # saved from staging slots, not as bytes in the call
    reset_prefix_cache(mesh.a)
    prepared.clear()  # saved() asks by Prepare; the engine should not
    before = external_hits(mesh.a)
    assert complete(mesh.a, prompt) == expected
    assert external_hits(mesh.a) - before == 6 * BLOCK
    # the store held every block: claimed and loaded from the arena's directory and pages,
    # with no Prepare and no Locate (FetchPages is the fallback only)
    assert prepared == [] and located == []


def test_a_stored_page_reused_for_another_block_is_refused_and_recomputed(mesh: Mesh) -> None:
    prompt, other = prompt_of(8), prompt_of(9)
    expected = complete(mesh.a, prompt)
    complete(mesh.a, other)
    saved(mesh.sa, prompt)
    saved(mesh.sa, other)
    reset_prefix_cache(mesh.a)
    hashes = [digests(prompt)[3], digests(other)[0]]
    with mesh.sa.service.pinned(hashes) as (page_id, other_id):  # type: ignore[arg-type]
        assert page_id is not None and other_id is not None
        # the store's page now holds another block, whole and sealed as that block
        mesh.sa.kv.kv[page_id].copy_(mesh.sa.kv.kv[other_id])
    assert complete(mesh.a, prompt) == expected
    assert "HashMismatch" in mesh.a.log_tail(400)
