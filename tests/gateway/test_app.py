"""The gateway's HTTP behaviour in front of fake engines (real HTTP on loopback).

What is pinned here is the gateway's own: token ids forwarded, chat shape,
SSE relayed, OpenAI-shaped errors, timeouts, routing around dead engines,
decisions that follow the index. tests/engines/ repeat the routing checks
in front of real vLLM engines.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gateway_kit import BLOCK, MODEL, FakeEngine, engines_and_gateway
from prometheus_client import REGISTRY

from kvmesh.engine_hash import EngineHasher
from kvmesh.events import PagesStored, make_batch
from kvmesh.gateway.app import ENGINE_HEADER, MATCHED_HEADER, Gateway
from kvmesh.gateway.config import EngineTarget
from kvmesh.gateway.tokenizer import PromptTokenizer
from kvmesh.security import TenantPolicy
from kvmesh.types import WorkerId

pytestmark = pytest.mark.anyio

PROMPT = "hello world, a system prompt for every turn of a long conversation"


def two_engines() -> list[FakeEngine]:
    return [FakeEngine("engine-0"), FakeEngine("engine-1")]


def hold(gateway: Gateway, engine: str, token_ids: list[int], seq: int = 0) -> None:
    """Tell the gateway's index that `engine` caches the full blocks of `token_ids`."""
    hashes = EngineHasher(block_size=BLOCK).hash_prompt(token_ids)
    event = PagesStored(tuple(hashes), None, tuple(token_ids[: len(hashes) * BLOCK]), BLOCK)
    gateway.index.apply(make_batch([event], WorkerId(engine), "test", seq))


def assert_openai_error(resp: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status
    for w in words:
        assert w in err["message"], err["message"]
    return err


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


# ------------------------------------------------------------------------ forwarding


async def test_a_text_prompt_reaches_the_engine_as_the_tokenizers_ids(
    tokenizer: PromptTokenizer,
) -> None:
    engines = [FakeEngine("engine-0")]
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    (sent,) = engines[0].seen
    ids = tokenizer.encode(PROMPT)
    assert sent["prompt"] == ids
    assert sent["model"] == MODEL
    assert sent["max_tokens"] == 2
    assert resp.json()["choices"][0]["text"] == f"engine-0:{len(ids)}"
    assert resp.headers[ENGINE_HEADER] == "engine-0"


async def test_token_id_prompts_are_forwarded_unchanged(tokenizer: PromptTokenizer) -> None:
    engines = [FakeEngine("engine-0")]
    ids = [5, 6, 7, 8, 9, 10]
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(s.url + "/v1/completions", json={"prompt": [ids], "model": MODEL})
    assert resp.status_code == 200, resp.text
    assert engines[0].seen[0]["prompt"] == ids


async def test_a_chat_request_is_rendered_by_the_chat_template_and_answered_as_chat(
    tokenizer: PromptTokenizer,
) -> None:
    engines = [FakeEngine("engine-0")]
    messages = [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
    ]
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(
            s.url + "/v1/chat/completions",
            json={"messages": messages, "max_completion_tokens": 3},
        )
    assert resp.status_code == 200, resp.text
    sent = engines[0].seen[0]
    flat = [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "hello world"},
    ]
    assert sent["prompt"] == tokenizer.render_chat(flat)
    assert tokenizer.decode(sent["prompt"]).endswith("<|assistant|>\n")
    assert sent["max_tokens"] == 3 and "messages" not in sent
    answer = resp.json()
    assert answer["object"] == "chat.completion"
    assert answer["id"].startswith("chatcmpl-")
    assert answer["choices"][0]["message"] == {
        "role": "assistant",
        "content": f"engine-0:{len(sent['prompt'])}",
    }
    assert answer["usage"]["prompt_tokens"] == len(sent["prompt"])


async def test_a_completion_stream_is_relayed_event_by_event(tokenizer: PromptTokenizer) -> None:
    engines = [FakeEngine("engine-0", chunks=4)]
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(s.url + "/v1/completions", json={"prompt": PROMPT, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    n = len(tokenizer.encode(PROMPT))
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert texts == [f"engine-0:{n}#{i}" for i in range(4)]


async def test_a_chat_stream_becomes_chat_chunks_with_the_role_first(
    tokenizer: PromptTokenizer,
) -> None:
    engines = [FakeEngine("engine-0", chunks=3)]
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(s.url + "/v1/chat/completions", json=body)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_models_health_and_metrics_answer(tokenizer: PromptTokenizer) -> None:
    async with engines_and_gateway(two_engines(), tokenizer) as s, httpx.AsyncClient() as c:
        await c.post(s.url + "/v1/completions", json={"prompt": PROMPT})
        models = await c.get(s.url + "/v1/models")
        health = await c.get(s.url + "/health")
        metrics = await c.get(s.url + "/metrics")
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    assert health.status_code == 200
    assert set(health.json()["engines"]) == {"engine-0", "engine-1"}
    assert 'kvmesh_gateway_requests_total{endpoint="completions",status="200"}' in metrics.text
    assert "kvmesh_gateway_engine_up" in metrics.text


# ------------------------------------------------------------------------ bad requests


@pytest.mark.parametrize(
    ("path", "content", "status", "words"),
    [
        ("/v1/completions", b"{not json", 400, ["not valid JSON"]),
        ("/v1/completions", b"", 400, ["empty"]),
        ("/v1/completions", b"[1, 2]", 400, ["JSON object"]),
        ("/v1/completions", b'{"max_tokens": 3}', 400, ["'prompt' is required"]),
        ("/v1/completions", b'{"prompt": 7}', 400, ["'prompt' must be"]),
        ("/v1/completions", b'{"prompt": ""}', 400, ["'prompt' is empty"]),
        ("/v1/completions", b'{"prompt": [1, -2]}', 400, ["token ids"]),
        ("/v1/completions", b'{"prompt": [1, 99999]}', 400, ["token ids"]),
        ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, ["2 prompts"]),
        ("/v1/completions", b'{"prompt": "a", "stream": "yes"}', 400, ["'stream'"]),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": -1}', 400, ["max_tokens"]),
        ("/v1/completions", b'{"prompt": "a", "cache_salt": 5}', 400, ["cache_salt"]),
        ("/v1/completions", b'{"prompt": "a", "model": "gpt-9"}', 404, ["gpt-9"]),
        ("/v1/chat/completions", b'{"messages": []}', 400, ["'messages'"]),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, ["'role'"]),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            ["image_url"],
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}',
            400,
            ["tool calling"],
        ),
    ],
)
async def test_bad_bodies_get_openai_shaped_errors_and_reach_no_engine(
    tokenizer: PromptTokenizer, path: str, content: bytes, status: int, words: list[str]
) -> None:
    engines = two_engines()
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(
            s.url + path, content=content, headers={"content-type": "application/json"}
        )
        assert_openai_error(resp, status, *words)
        ok = await c.post(s.url + "/v1/completions", json={"prompt": PROMPT})
    assert ok.status_code == 200
    assert sum(len(e.seen) for e in engines) == 1


async def test_an_oversized_body_is_refused_with_413(tokenizer: PromptTokenizer) -> None:
    async with (
        engines_and_gateway(two_engines(), tokenizer, max_body_bytes=1000) as s,
        httpx.AsyncClient() as c,
    ):
        resp = await c.post(s.url + "/v1/completions", json={"prompt": "x" * 2000})
    assert_openai_error(resp, 413, "limit")


async def test_unknown_paths_and_methods_get_openai_shaped_errors(
    tokenizer: PromptTokenizer,
) -> None:
    async with engines_and_gateway(two_engines(), tokenizer) as s, httpx.AsyncClient() as c:
        missing = await c.post(s.url + "/v1/embeddings", json={})
        wrong_method = await c.get(s.url + "/v1/completions")
    assert_openai_error(missing, 404, "/v1/embeddings")
    assert_openai_error(wrong_method, 405)


async def test_an_engines_own_error_passes_through_with_its_status(
    tokenizer: PromptTokenizer,
) -> None:
    async with engines_and_gateway(two_engines(), tokenizer) as s, httpx.AsyncClient() as c:
        resp = await c.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
        streamed = await c.post(
            s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "stream": True}
        )
    for r in (resp, streamed):
        assert r.status_code == 400
        assert "max_tokens must be at least 1" in r.json()["error"]["message"]


# ------------------------------------------------------------------------ engines failing


async def test_no_reachable_engine_is_a_503_not_a_hang(tokenizer: PromptTokenizer) -> None:
    async with engines_and_gateway(two_engines(), tokenizer) as s, httpx.AsyncClient() as c:
        await s.kill("engine-0")
        await s.kill("engine-1")
        resp = await c.post(s.url + "/v1/completions", json={"prompt": PROMPT}, timeout=10)
        health = await c.get(s.url + "/health")
    assert_openai_error(resp, 503, "no engine")
    assert health.status_code == 503


async def test_an_engine_that_does_not_answer_in_time_is_a_504(
    tokenizer: PromptTokenizer,
) -> None:
    engines = [FakeEngine("engine-0", hang_s=5)]
    async with (
        engines_and_gateway(engines, tokenizer, request_timeout_s=0.3) as s,
        httpx.AsyncClient() as c,
    ):
        resp = await c.post(s.url + "/v1/completions", json={"prompt": PROMPT}, timeout=10)
        gateway = s.gateway
        assert all(e.inflight_requests == 0 for e in gateway.pool.engines.values())
    assert_openai_error(resp, 504, "engine-0", "--request-timeout")


def _retries(engine: str) -> float:
    return sum(
        REGISTRY.get_sample_value(
            "kvmesh_gateway_engine_retries_total", {"engine": engine, "reason": reason}
        )
        or 0.0
        for reason in ("ConnectError", "ConnectTimeout", "RemoteProtocolError", "ReadError")
    )


async def test_a_killed_engine_is_routed_around_and_no_request_fails(
    tokenizer: PromptTokenizer,
) -> None:
    engines = two_engines()
    ids = tokenizer.encode(PROMPT)
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        hold(s.gateway, "engine-0", ids)  # engine-0 holds the prefix: it is chosen first
        first = await c.post(s.url + "/v1/completions", json={"prompt": ids})
        assert first.headers[ENGINE_HEADER] == "engine-0"
        await s.kill("engine-0")
        before = _retries("engine-0")
        answers = [
            await c.post(s.url + "/v1/completions", json={"prompt": [*ids, i]}) for i in range(6)
        ]
        retried = _retries("engine-0") - before
        health = (await c.get(s.url + "/health")).json()
    assert [a.status_code for a in answers] == [200] * 6
    assert {a.headers[ENGINE_HEADER] for a in answers} == {"engine-1"}
    assert retried <= 1  # at most the request that found it dead before the health check
    assert health["engines"]["engine-0"]["up"] is False


async def test_an_engine_failing_its_health_check_gets_no_requests_until_it_recovers(
    tokenizer: PromptTokenizer,
) -> None:
    import asyncio

    engines = two_engines()
    ids = tokenizer.encode(PROMPT)
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        hold(s.gateway, "engine-0", ids)
        engines[0].sick = True
        await asyncio.sleep(1.0)  # > health_failures * health_interval_s
        sick = [await c.post(s.url + "/v1/completions", json={"prompt": ids}) for _ in range(3)]
        engines[0].sick = False
        await asyncio.sleep(0.5)
        well = await c.post(s.url + "/v1/completions", json={"prompt": ids})
    assert {r.headers[ENGINE_HEADER] for r in sick} == {"engine-1"}
    assert well.headers[ENGINE_HEADER] == "engine-0"


async def test_an_engine_is_verified_when_first_up_and_again_after_it_was_down(
    tokenizer: PromptTokenizer,
) -> None:
    import asyncio

    from kvmesh.errors import HashParityError

    engines = two_engines()
    checked: list[str] = []

    async def verify(target: EngineTarget) -> None:
        checked.append(target.name)
        if target.name == "engine-0":
            raise HashParityError("engine-0 hashes differently")

    async with (
        engines_and_gateway(engines, tokenizer, verify=verify) as s,
        httpx.AsyncClient() as c,
    ):
        await asyncio.sleep(0.1)
        assert sorted(checked) == ["engine-0", "engine-1"]
        engines[1].sick = True
        await asyncio.sleep(1.0)
        engines[1].sick = False
        await asyncio.sleep(0.5)
        # a failed check is loud but the engine still serves
        answers = [
            await c.post(s.url + "/v1/completions", json={"prompt": [i] * 9}) for i in range(8)
        ]
    assert sorted(checked) == ["engine-0", "engine-1", "engine-1"]
    assert {a.status_code for a in answers} == {200}


# ------------------------------------------------------------------------ routing


async def test_kv_aware_sends_a_prompt_to_the_engine_whose_events_hold_its_prefix(
    tokenizer: PromptTokenizer,
) -> None:
    ids = tokenizer.encode(PROMPT)
    async with engines_and_gateway(two_engines(), tokenizer) as s, httpx.AsyncClient() as c:
        for holder in ("engine-1", "engine-0"):
            s.gateway.index.remove_worker(WorkerId("engine-0"))
            s.gateway.index.remove_worker(WorkerId("engine-1"))
            hold(s.gateway, holder, ids)
            resp = await c.post(s.url + "/v1/completions", json={"prompt": [*ids, 3, 4]})
            assert resp.headers[ENGINE_HEADER] == holder
            assert int(resp.headers[MATCHED_HEADER]) == len(ids) // BLOCK


async def test_health_says_what_the_index_holds_per_engine(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    async with engines_and_gateway(two_engines(), tokenizer) as s, httpx.AsyncClient() as c:
        before = (await c.get(s.url + "/health")).json()["engines"]
        hold(s.gateway, "engine-1", ids, seq=0)
        after = (await c.get(s.url + "/health")).json()["engines"]
    assert before["engine-1"]["events_seq"] == -1 and before["engine-1"]["blocks"] == 0
    assert after["engine-1"]["blocks"] == len(ids) // BLOCK
    assert after["engine-1"]["events_seq"] == 0
    assert after["engine-0"]["blocks"] == 0


async def test_two_gateways_fed_the_same_events_make_the_same_decisions(
    tokenizer: PromptTokenizer,
) -> None:
    engines = two_engines()
    base = tokenizer.encode(PROMPT)
    prompts = [base[:k] + [i] * 9 for i in range(12) for k in (8, len(base))]
    async with (
        engines_and_gateway(engines, tokenizer) as a,
        engines_and_gateway(engines, tokenizer) as b,
        httpx.AsyncClient() as c,
    ):
        # a's own history differs: it has served other requests before.
        for i in range(5):
            await c.post(a.url + "/v1/completions", json={"prompt": [i + 1] * 13})
        for g in (a.gateway, b.gateway):
            hold(g, "engine-0", base[:8], seq=0)
            hold(g, "engine-1", base, seq=0)
        picks = []
        for url in (a.url, b.url):
            answers = [await c.post(url + "/v1/completions", json={"prompt": p}) for p in prompts]
            picks.append([r.headers[ENGINE_HEADER] for r in answers])
    assert picks[0] == picks[1]
    assert set(picks[0]) == {"engine-0", "engine-1"}


async def test_approx_prefix_routes_a_follow_up_turn_from_its_own_history(
    tokenizer: PromptTokenizer,
) -> None:
    engines = two_engines()
    async with (
        engines_and_gateway(engines, tokenizer, policy="approx_prefix") as s,
        httpx.AsyncClient() as c,
    ):
        for conv in range(4):
            turn = [conv + 10] * 12
            where = []
            for t in range(3):
                turn = turn + [t + 50] * 8
                resp = await c.post(s.url + "/v1/completions", json={"prompt": turn})
                where.append(resp.headers[ENGINE_HEADER])
                if t:
                    assert int(resp.headers[MATCHED_HEADER]) > 0
            assert len(set(where)) == 1, where
        assert len(s.gateway.index) == 0  # it never read (or was fed) any event


# ------------------------------------------------------------------------ tenants


async def test_the_request_salt_is_forwarded_and_separates_the_prefix(
    tokenizer: PromptTokenizer,
) -> None:
    engines = two_engines()
    ids = tokenizer.encode(PROMPT)
    async with engines_and_gateway(engines, tokenizer) as s, httpx.AsyncClient() as c:
        hold(s.gateway, "engine-0", ids)
        plain = await c.post(s.url + "/v1/completions", json={"prompt": ids})
        salted = await c.post(
            s.url + "/v1/completions", json={"prompt": ids, "cache_salt": "tenant-a"}
        )
    assert int(plain.headers[MATCHED_HEADER]) == len(ids) // BLOCK
    assert int(salted.headers[MATCHED_HEADER]) == 0
    sent = engines[0].seen + engines[1].seen
    assert [b.get("cache_salt") for b in sent] == [None, "tenant-a"]


async def test_a_salt_bound_to_the_api_key_wins_and_unknown_keys_are_refused(
    tokenizer: PromptTokenizer,
) -> None:
    engines = two_engines()
    tenants = TenantPolicy({"key-of-tenant-a-0001": "salt-a"})
    async with (
        engines_and_gateway(engines, tokenizer, tenants=tenants) as s,
        httpx.AsyncClient() as c,
    ):
        body = {"prompt": PROMPT, "cache_salt": "salt-b"}
        nokey = await c.post(s.url + "/v1/completions", json=body)
        badkey = await c.post(
            s.url + "/v1/completions", json=body, headers={"authorization": "Bearer nope"}
        )
        good = await c.post(
            s.url + "/v1/completions",
            json=body,
            headers={"authorization": "Bearer key-of-tenant-a-0001"},
        )
    assert_openai_error(nokey, 401, "API key")
    assert_openai_error(badkey, 401, "unknown API key")
    assert good.status_code == 200
    sent = engines[0].seen + engines[1].seen
    assert [b["cache_salt"] for b in sent] == ["salt-a"]
