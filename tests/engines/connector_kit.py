"""What the connector's engine tests share: prompts, greedy answers, the engines' counters."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from kvmesh.connector.blocks import BlockRun, block_run
from kvmesh.connector.store_client import StoreClient
from kvmesh.engine_hash import EngineExtraKeys, EngineHasher
from kvmesh.engine_launcher import VLLMEngine
from kvmesh.worker.engine_store import EngineStore

BLOCK = 32
MAX_TOKENS = 12


def metric(engine: VLLMEngine, name: str) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def external_hits(engine: VLLMEngine) -> float:
    return metric(engine, "vllm:external_prefix_cache_hits_total")


def complete(engine: VLLMEngine, prompt: list[int], **extra: Any) -> list[int]:
    """Greedy tokens the engine answers `prompt` (token ids) with."""
    body = {
        "model": engine.spec.served_model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def reset_prefix_cache(engine: VLLMEngine) -> None:
    r = httpx.post(engine.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text


def prompt_of(seed: int, blocks: int = 6, tail: int = 7) -> list[int]:
    """A prompt of `blocks` full blocks and a `tail`, distinct per seed (vocab 1728)."""
    return [3 + (seed * 7919 + i * 131) % 1700 for i in range(blocks * BLOCK + tail)]


def digests(prompt: list[int], salt: str | None = None) -> list[bytes]:
    hasher = EngineHasher("sha256", BLOCK, int_hashes=False)
    return list(hasher.hash_blocks(prompt, EngineExtraKeys(cache_salt=salt)).digests)


def run_of(prompt: list[int], salt: str | None = None) -> BlockRun:
    """The prompt's full blocks as the connector describes them to its store."""
    keys = EngineExtraKeys(cache_salt=salt)
    hashes = digests(prompt, salt)
    extra = [keys.for_block(i * BLOCK, (i + 1) * BLOCK) for i in range(len(hashes))]
    return block_run(hashes, prompt, extra, 0, len(hashes), BLOCK)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def wait_saved(client: StoreClient, prompt: list[int], salt: str | None = None) -> None:
    """Until the store holds every full block of `prompt` (saves run off the engine's step)."""
    run = run_of(prompt, salt)
    wait_until(lambda: client.prepare(run).held == len(run), "the engine's saves to land")


def held(store: EngineStore, prompt: list[int]) -> int:
    """The leading blocks of `prompt` the in-process `store` holds."""
    return store.service.prefix_length(digests(prompt))  # type: ignore[arg-type]


def computed_then_moved(
    engine: VLLMEngine, own: EngineStore, peer: EngineStore, prompt: list[int]
) -> list[int]:
    """`engine` computes `prompt` (saved into its store `own`); the blocks then move to `peer`
    and the engine's cache is reset, so that only `peer` holds them. The engine's answer."""
    answer = complete(engine, prompt)
    mine = StoreClient(own.address, own.control_address)
    theirs = StoreClient(peer.address, peer.control_address)
    try:
        wait_saved(mine, prompt)
        pages = mine.fetch(digests(prompt))
        assert all(page is not None for page in pages)
        theirs.save(run_of(prompt), [page for page in pages if page is not None])
        mine.forget(digests(prompt))
    finally:
        mine.close()
        theirs.close()
    reset_prefix_cache(engine)
    assert held(own, prompt) == 0 and held(peer, prompt) == len(digests(prompt))
    return answer
