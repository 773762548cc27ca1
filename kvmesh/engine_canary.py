"""The hash-parity canary: prove kvmesh hashes prompts exactly as an engine does.

If kvmesh's `EngineHasher` and the engine disagree (another algorithm, seed,
block size or hash form), the engine's events name blocks no request hash
ever matches: routing would silently find zero hits. The canary makes that
loud when an engine registers: it sends one short prompt of fresh random
token ids (fresh, so no block of it can already be cached, since a cached
prefix publishes nothing) with ``max_tokens=1`` to the engine's HTTP API,
waits for the BlockStored events of its full blocks, and compares their
hashes with kvmesh's own. A mismatch raises `HashParityError` naming what
differs (it tries the other algorithms and hash forms to say which one the
engine uses) and quarantines the engine in the subscriber: it gets no cache
affinity until a later canary passes.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx

from kvmesh.engine_hash import DEFAULT_ENGINE_SEED, ENGINE_HASH_ALGORITHMS, EngineHasher
from kvmesh.engine_subscriber import EngineSubscriber
from kvmesh.errors import DeadlineExceeded, HashParityError, TransportError
from kvmesh.events import EventBatch, PagesStored
from kvmesh.metrics import ENGINE_CANARY
from kvmesh.types import PageHash, WorkerId


@dataclass(frozen=True, slots=True)
class CanaryResult:
    """A passed canary: the prompt sent and the block hashes engine and kvmesh agree on."""

    engine_id: str
    prompt: tuple[int, ...]
    page_hashes: tuple[PageHash, ...]
    worker_id: WorkerId


class _Collector:
    """Gathers the engine's hash of each full block of one prompt from its events."""

    def __init__(self, workers: set[WorkerId], prompt: tuple[int, ...], block_size: int) -> None:
        self.workers = workers
        self.prompt = prompt
        self.block_size = block_size
        self.blocks = len(prompt) // block_size
        self.hashes: dict[int, PageHash] = {}
        self.worker: WorkerId | None = None
        self.wrong_size: int | None = None
        self.done = asyncio.Event()

    def __call__(self, worker_id: WorkerId, batch: EventBatch) -> None:
        if worker_id not in self.workers:
            return
        for event in batch.events:
            if isinstance(event, PagesStored) and event.token_ids:
                self._take(worker_id, event)
        if len(self.hashes) == self.blocks or self.wrong_size is not None:
            self.done.set()

    def _take(self, worker_id: WorkerId, event: PagesStored) -> None:
        size, tokens, prompt = event.page_size, event.token_ids, self.prompt
        for start in range(0, len(prompt) - len(tokens) + 1, size):
            if prompt[start : start + len(tokens)] == tokens:
                break
        else:
            return  # another request's blocks
        if size != self.block_size:
            self.wrong_size = size
            return
        self.worker = worker_id
        first = start // size
        for i, h in enumerate(event.page_hashes):
            self.hashes.setdefault(first + i, h)


def _diagnose(hasher: EngineHasher, prompt: tuple[int, ...], engine: list[PageHash]) -> str:
    """Which other hasher configuration reproduces the engine's hashes, in words."""
    seeds = {hasher.seed, None}
    for name, algo in ENGINE_HASH_ALGORITHMS.items():
        for seed in seeds:
            if seed is None and algo.needs_seed:
                continue
            for ints in (True, False):
                other = EngineHasher(name, hasher.block_size, seed, ints)
                if other.hash_prompt(prompt) == engine:
                    return (
                        f"the engine's hashes match algo={name!r}, "
                        f"seed={seed if seed is not None else DEFAULT_ENGINE_SEED!r} "
                        f"(PYTHONHASHSEED {'unset' if seed is None else 'set'}), "
                        f"int_hashes={ints}: configure kvmesh's engine hashing the same way"
                    )
    forms = {len(h) for h in engine}
    return (
        f"no known algorithm with seed {hasher.seed!r} or the default reproduces them "
        f"(engine hashes are {sorted(forms)} bytes): the engine probably runs another "
        "PYTHONHASHSEED; give kvmesh the engine's exact seed"
    )


async def _model_of(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    data: Any = response.json()
    return str(data["data"][0]["id"])


async def run_hash_parity_canary(
    subscriber: EngineSubscriber,
    engine_id: str,
    engine_url: str,
    hasher: EngineHasher,
    *,
    model: str | None = None,
    blocks: int = 2,
    token_range: tuple[int, int] = (100, 1000),
    timeout_s: float = 30.0,
    attempts: int = 3,
    rng: random.Random | None = None,
    client: httpx.AsyncClient | None = None,
) -> CanaryResult:
    """Send the canary prompt to `engine_url` and check its events against `hasher`.

    Raises `HashParityError` on a mismatch (and quarantines the engine),
    `DeadlineExceeded` when no events arrive for any of `attempts` fresh
    prompts within `timeout_s` in all (quarantined too: parity is unproven), `TransportError` when the
    engine's HTTP API fails. A pass releases an engine quarantined before.
    The subscriber must be running and follow `engine_id`.
    """
    rng = rng or random.Random()  # fresh, not secret: the prompt must not be cached yet
    size = hasher.block_size
    own_client = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)
    try:
        try:
            name = model or await _model_of(http, engine_url)
        except httpx.HTTPError as exc:
            raise TransportError(
                f"canary request to engine {engine_id} at {engine_url} failed: {exc}"
            ) from exc
        # A publisher that has only just connected to the subscriber drops what it sent
        # before (ZMQ), and a lone lost batch shows no gap: a fresh prompt per attempt
        # both arrives live and reveals the lost one, which replay then heals.
        for attempt in range(attempts):
            prompt = tuple(rng.randrange(*token_range) for _ in range(blocks * size + 1))
            collector = _Collector(set(subscriber.worker_ids(engine_id)), prompt, size)
            if await _send_and_collect(
                subscriber, collector, http, engine_url, engine_id, name, timeout_s / attempts
            ):
                break
            if attempt + 1 == attempts:
                ENGINE_CANARY.labels(engine_id, "timeout").inc()
                reason = (
                    f"no KV events for {attempts} canary prompts from engine {engine_id} within "
                    f"{timeout_s} s ({len(collector.hashes)}/{collector.blocks} blocks of the last "
                    "seen): check its --kv-events-config endpoint, topic and that prefix "
                    "caching is on"
                )
                subscriber.quarantine(engine_id, reason)
                raise DeadlineExceeded(reason)
    finally:
        if own_client:
            await http.aclose()
    want = hasher.hash_prompt(prompt)
    if collector.wrong_size is not None:
        reason = (
            f"engine {engine_id} stores blocks of {collector.wrong_size} tokens, kvmesh hashes "
            f"blocks of {size}: set kvmesh's block size to the engine's --block-size"
        )
        _fail(subscriber, engine_id, reason)
    engine = [collector.hashes[i] for i in range(collector.blocks)]
    if engine != want:
        reason = (
            f"hash parity failed for engine {engine_id}: kvmesh ({hasher!r}) hashed the canary's "
            f"first block to {want[0].hex()}, the engine to {engine[0].hex()}; "
            + _diagnose(hasher, prompt, engine)
        )
        _fail(subscriber, engine_id, reason)
    ENGINE_CANARY.labels(engine_id, "passed").inc()
    subscriber.release(engine_id)
    worker = collector.worker if collector.worker is not None else WorkerId(engine_id)
    return CanaryResult(engine_id, prompt, tuple(want), worker)


async def _send_and_collect(
    subscriber: EngineSubscriber,
    collector: _Collector,
    http: httpx.AsyncClient,
    engine_url: str,
    engine_id: str,
    model: str,
    wait_s: float,
) -> bool:
    """Send one canary prompt; True once the events of all its full blocks arrived."""
    subscriber.add_listener(collector)
    try:
        try:
            response = await http.post(
                f"{engine_url}/v1/completions",
                json={
                    "model": model,
                    "prompt": list(collector.prompt),
                    "max_tokens": 1,
                    "temperature": 0,
                },
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise TransportError(
                f"canary request to engine {engine_id} at {engine_url} failed: {exc}"
            ) from exc
        try:
            await asyncio.wait_for(collector.done.wait(), wait_s)
        except TimeoutError:
            return False
        return True
    finally:
        subscriber.remove_listener(collector)


def _fail(subscriber: EngineSubscriber, engine_id: str, reason: str) -> NoReturn:
    ENGINE_CANARY.labels(engine_id, "mismatch").inc()
    subscriber.quarantine(engine_id, reason)
    raise HashParityError(reason)
