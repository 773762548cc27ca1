"""`kvmesh gateway` in front of two real vLLM engines with KV events on.

The gateway runs as users run it (the ``kvmesh gateway`` command, its own
process); the engines are the tests/engines fixture's. What the engines
themselves report (``vllm:prefix_cache_hits``) confirms where the prefix
really was. The last test kills an engine, so it stays last in the module.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvmesh.benchmarks.bench_engines import reset_cache
from kvmesh.engine_launcher import REPO_ROOT, VLLMEngine, engine_model, free_port
from kvmesh.gateway.tokenizer import PromptTokenizer

BLOCK = 32
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 12


@dataclass
class Front:
    url: str
    engines: dict[str, VLLMEngine]
    process: subprocess.Popen[bytes]


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def prefix_hits(engine: VLLMEngine) -> float:
    """Prompt tokens the engine served from its own prefix cache so far."""
    return metric(httpx.get(engine.url + "/metrics").text, "vllm:prefix_cache_hits_total")


def event_batches(front: Front) -> float:
    return metric(httpx.get(front.url + "/metrics").text, "kvmesh_engine_event_batches_total")


def wait_until(check, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def front(start_engine) -> Iterator[Front]:  # type: ignore[no-untyped-def]
    engines = [start_engine(name="engine-0"), start_engine(name="engine-1")]
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvmesh.app.cli", "gateway",
        "--tokenizer", str(engine_model()), "--block-size", str(BLOCK),
        "--events-topic", engines[0].spec.topic, "--port", str(port),
        "--health-interval", "0.3", "--request-timeout", "120", "--log-level", "warning",
    ]  # fmt: skip
    for e in engines:
        cmd += ["--engine", e.url, "--name", e.name]
        cmd += ["--events", str(e.events_endpoint), "--replay", str(e.replay_endpoint)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    f = Front(f"http://127.0.0.1:{port}", {e.name: e for e in engines}, proc)
    try:
        # on 2 busy cores (the whole suite beside it) a start past 30 s was seen once
        wait_until(lambda: _healthy(f), "the gateway's /health", timeout=90.0)
        yield f
    finally:
        proc.terminate()
        proc.wait(20)


def _healthy(front: Front) -> bool:
    if front.process.poll() is not None:
        raise AssertionError(f"the gateway exited with {front.process.returncode}")
    try:
        return httpx.get(front.url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def chat(front: Front, messages: list[dict[str, str]], **extra: object) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 4, **extra}
    return httpx.post(front.url + "/v1/chat/completions", json=body, timeout=120)


def test_each_engine_passes_the_hash_parity_canary_when_the_gateway_starts(front: Front) -> None:
    def passed(name: str) -> float:
        text = httpx.get(front.url + "/metrics").text
        return metric(text, f'kvmesh_engine_canary_total{{engine="{name}",outcome="passed"}}')

    for name in front.engines:
        wait_until(lambda n=name: passed(n) >= 1, f"{name}'s canary")

    def fresh() -> bool:  # a gap the canary revealed is healed by replay just after
        health = httpx.get(front.url + "/health").json()["engines"]
        return not any(e["stale"] for e in health.values())

    wait_until(fresh, "every engine's index entries to be fresh")


def test_follow_up_turns_land_on_the_engine_holding_the_prefix(front: Front) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    batches = event_batches(front)
    answer = chat(front, messages)
    assert answer.status_code == 200, answer.text
    home = answer.headers["x-kvmesh-engine"]
    other = next(n for n in front.engines if n != home)
    matched_before = 0
    for turn in range(3):
        reply = answer.json()["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Tell me more about point {turn}, please. " * 3},
        ]
        # the previous turn's blocks reach the gateway as the engine's own events
        wait_until(lambda b=batches: event_batches(front) > b, "the engine's KV events")
        time.sleep(0.3)  # the rest of that turn's batches
        hits = {n: prefix_hits(e) for n, e in front.engines.items()}
        batches = event_batches(front)
        answer = chat(front, messages)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvmesh-engine"] == home
        matched = int(answer.headers["x-kvmesh-matched-blocks"])
        assert matched >= 4 and matched > matched_before
        matched_before = matched
        # the engine itself served at least the predicted blocks from its cache
        assert prefix_hits(front.engines[home]) - hits[home] >= matched * BLOCK
        assert prefix_hits(front.engines[other]) == hits[other]


def test_a_chat_stream_from_a_real_engine_is_relayed_as_chat_chunks(front: Front) -> None:
    messages = [{"role": "user", "content": "Count to three."}]
    resp = chat(front, messages, stream=True, max_tokens=5, ignore_eos=True)
    assert resp.status_code == 200, resp.text
    events = [e for e in resp.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) > 0


def test_token_ids_and_text_prompts_reach_the_engine_as_the_same_tokens(front: Front) -> None:
    text = "Once upon a time there was a little cache. " * 12
    by_text = httpx.post(
        front.url + "/v1/completions",
        json={"prompt": text, "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert by_text.status_code == 200, by_text.text
    time.sleep(0.5)
    usage = by_text.json()["usage"]
    ids = PromptTokenizer(engine_model()).encode(text)
    assert usage["prompt_tokens"] == len(ids)
    by_ids = httpx.post(
        front.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert by_ids.status_code == 200
    assert by_ids.headers["x-kvmesh-engine"] == by_text.headers["x-kvmesh-engine"]
    assert int(by_ids.headers["x-kvmesh-matched-blocks"]) == len(ids) // BLOCK
    assert by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"prompt": 12}', 400, "'prompt' must be"),
        (b'{"prompt": [1, 2, 99999999]}', 400, "token ids"),
        (b'{"messages": "hi"}', 400, "'prompt' is required"),
        (b'{"prompt": "hi", "model": "other-model"}', 404, "other-model"),
    ],
)
def test_malformed_bodies_get_clear_errors(
    front: Front, body: bytes, status: int, words: str
) -> None:
    resp = httpx.post(
        front.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status
    assert words in resp.json()["error"]["message"]


def test_a_request_the_engine_refuses_comes_back_with_the_engines_error(front: Front) -> None:
    too_long = [3 + i % 1000 for i in range(3000)]  # beyond the engines' --max-model-len 2048
    resp = httpx.post(
        front.url + "/v1/completions", json={"prompt": too_long, "max_tokens": 1}, timeout=60
    )
    assert resp.status_code == 400
    assert "error" in resp.json()
    assert "2048" in resp.text


def indexed_blocks(front: Front, engine: str) -> int:
    """The blocks the gateway's event-fed index holds for `engine` (its /health view)."""
    return int(httpx.get(front.url + "/health").json()["engines"][engine]["blocks"])


def test_an_engine_reset_between_bench_policies_leaves_the_gateways_index_empty(
    front: Front,
) -> None:
    """vLLM queues an idle engine's AllBlocksCleared until its next step; `bench engines`
    makes it step, so no gateway routes on the previous policy's blocks."""
    prompt = "Blocks the reset must clear from the index too. " * 20
    resp = httpx.post(
        front.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    home = resp.headers["x-kvmesh-engine"]
    wait_until(lambda: indexed_blocks(front, home) >= 4, "the prompt's blocks in the index")

    async def reset_all() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for engine in front.engines.values():
                await reset_cache(client, engine)

    asyncio.run(reset_all())
    wait_until(
        lambda: all(indexed_blocks(front, n) == 0 for n in front.engines),
        "the engines' AllBlocksCleared in the gateway's index",
        timeout=10,
    )


def test_a_killed_engine_is_routed_around_with_no_failed_request(front: Front) -> None:
    prompt = "The same prefix every time, for affinity. " * 10
    first = httpx.post(
        front.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120
    )
    victim = first.headers["x-kvmesh-engine"]
    survivor = next(n for n in front.engines if n != victim)
    front.engines[victim].kill()
    answers = []
    for i in range(6):  # the first may meet the dead engine before the health check does
        answers.append(
            httpx.post(
                front.url + "/v1/completions",
                json={"prompt": prompt + f" Turn {i}.", "max_tokens": 2},
                timeout=120,
            )
        )
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert {a.headers["x-kvmesh-engine"] for a in answers} == {survivor}
    # A request that met the dead engine marked it down at once; if none did (its
    # entries were stale, so load alone routed), the next health check does.
    deadline = time.monotonic() + 15
    while httpx.get(front.url + "/health").json()["engines"][victim]["up"]:
        assert time.monotonic() < deadline, "the killed engine was never marked down"
        time.sleep(0.2)
    after = [
        httpx.post(front.url + "/v1/completions", json={"prompt": prompt}, timeout=120)
        for _ in range(3)
    ]
    assert [a.status_code for a in after] == [200] * 3
