"""`kvmesh bench engines` empties each engine's prefix cache between policies, and makes it say so.

vLLM answers ``POST /reset_prefix_cache`` with ``{"success": false}`` while
blocks are in use, and an idle engine publishes its ``AllBlocksCleared``
event only at its next step. The engine here is an HTTP stand-in
(`httpx.MockTransport`) answering as vLLM 0.32 does: the tests are about
what the benchmark does with those answers, not about the engine.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvmesh.benchmarks.bench_engines import reset_cache
from kvmesh.engine_launcher import EngineSpec, VLLMEngine
from kvmesh.errors import ConfigError, DeadlineExceeded, TransportError


class EngineAnswers:
    """Answers `/reset_prefix_cache` with `successes` in turn (the last one repeated) and
    `/v1/completions` with `completion_status`; keeps every request's path and body."""

    def __init__(
        self, successes: list[bool], reset_status: int = 200, completion_status: int = 200
    ) -> None:
        self.successes = successes
        self.reset_status = reset_status
        self.completion_status = completion_status
        self.calls: list[tuple[str, dict[str, object]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.url.path, body))
        if request.url.path == "/reset_prefix_cache":
            if self.reset_status != 200:
                return httpx.Response(self.reset_status, json={"detail": "Not Found"})
            n = sum(path == "/reset_prefix_cache" for path, _ in self.calls)
            return httpx.Response(
                200, json={"success": self.successes[min(n, len(self.successes)) - 1]}
            )
        return httpx.Response(self.completion_status, json={"choices": [{"text": "x"}]})

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]


def reset(answers: EngineAnswers, timeout_s: float = 5.0) -> None:
    engine = VLLMEngine(EngineSpec(block_size=32), name="engine-0")

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answers)) as client:
            await reset_cache(client, engine, timeout_s=timeout_s, every_s=0.01)

    asyncio.run(go())


def test_a_reset_refused_while_blocks_are_in_use_is_asked_again_until_it_succeeds() -> None:
    answers = EngineAnswers([False, False, True])
    reset(answers)
    assert answers.paths() == ["/reset_prefix_cache"] * 3 + ["/v1/completions"]


def test_after_the_reset_one_request_shorter_than_a_block_makes_the_engine_publish_the_clear() -> (
    None
):
    answers = EngineAnswers([True])
    reset(answers)
    path, body = answers.calls[-1]
    assert path == "/v1/completions"
    prompt = body["prompt"]
    assert isinstance(prompt, list) and len(prompt) + int(str(body["max_tokens"])) < 32


def test_an_engine_that_never_resets_is_a_deadline_naming_its_answer() -> None:
    answers = EngineAnswers([False])
    with pytest.raises(DeadlineExceeded, match=r"engine-0 did not reset .* success false"):
        reset(answers, timeout_s=0.05)
    assert "/v1/completions" not in answers.paths()


def test_an_engine_without_the_dev_route_is_told_to_start_with_dev_mode() -> None:
    answers = EngineAnswers([True], reset_status=404)
    with pytest.raises(ConfigError, match="VLLM_SERVER_DEV_MODE=1"):
        reset(answers)
    assert answers.paths() == ["/reset_prefix_cache"]


def test_a_failed_publishing_request_is_a_transport_error() -> None:
    answers = EngineAnswers([True], completion_status=500)
    with pytest.raises(TransportError, match="failed the request that makes it publish"):
        reset(answers)
