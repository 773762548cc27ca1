"""The hash-parity canary's retries, around an engine whose first events are lost.

A publisher that has only just connected to the subscriber drops what it sent
before it was connected (ZMQ's slow joiner), and a lone lost batch shows no
gap. These tests are about the canary around that, so the engine's HTTP API
is httpx's mock transport and the subscriber a stand-in that delivers (or
loses) one batch per completion; real engines run the canary in
tests/engines/.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from kvmesh.engine_canary import run_hash_parity_canary
from kvmesh.engine_hash import EngineHasher
from kvmesh.errors import DeadlineExceeded
from kvmesh.events import EventBatch, PagesStored
from kvmesh.types import WorkerId

HASHER = EngineHasher("sha256", 32, None, True)
ENGINE = "engine-0"


class LossyEngine:
    """Answers completions and publishes their blocks' events, losing the first `lose`."""

    def __init__(self, lose: int) -> None:
        self.lose = lose
        self.listeners: list[object] = []
        self.quarantined: str | None = None
        self.released = 0
        self.prompts: list[list[int]] = []

    # -- the subscriber's side the canary uses
    def worker_ids(self, engine_id: str) -> list[WorkerId]:
        return [WorkerId(engine_id)]

    def add_listener(self, listener: object) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: object) -> None:
        self.listeners.remove(listener)

    def quarantine(self, engine_id: str, reason: str) -> None:
        self.quarantined = reason

    def release(self, engine_id: str) -> None:
        self.released += 1

    # -- the engine's HTTP API
    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        prompt = json.loads(request.content)["prompt"]
        self.prompts.append(prompt)
        if len(self.prompts) > self.lose:
            full = len(prompt) // 32 * 32
            event = PagesStored(
                tuple(HASHER.hash_prompt(prompt)), None, tuple(prompt[:full]), 32, None, "GPU"
            )
            batch = EventBatch((event,), WorkerId(ENGINE), "life", len(self.prompts))
            for listener in list(self.listeners):
                listener(WorkerId(ENGINE), batch)  # type: ignore[operator]
        return httpx.Response(200, json={"choices": [{"text": "x"}]})


def run(engine: LossyEngine, attempts: int = 3) -> object:
    async def go() -> object:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine.handle))
        async with client:
            return await run_hash_parity_canary(
                engine,  # type: ignore[arg-type]
                ENGINE,
                "http://engine",
                HASHER,
                timeout_s=0.6,
                attempts=attempts,
                rng=random.Random(7),
                client=client,
            )

    return asyncio.run(go())


def test_a_lost_first_canary_batch_is_retried_with_a_fresh_prompt_and_passes() -> None:
    engine = LossyEngine(lose=1)
    result = run(engine)
    assert len(engine.prompts) == 2
    assert engine.prompts[0] != engine.prompts[1]  # fresh: the first may be cached by now
    assert list(result.prompt) == engine.prompts[1]  # type: ignore[attr-defined]
    assert engine.quarantined is None and engine.released == 1


def test_when_every_attempt_is_lost_the_engine_is_quarantined_with_a_clear_error() -> None:
    engine = LossyEngine(lose=99)
    with pytest.raises(DeadlineExceeded, match="no KV events for 3 canary prompts"):
        run(engine)
    assert len(engine.prompts) == 3
    assert engine.quarantined is not None and "--kv-events-config" in engine.quarantined
    assert engine.listeners == []  # nothing left listening
