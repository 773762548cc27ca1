"""Each routing decision is kept with what the router saw and what the engine then reused.

The log is how a benchmark tells why a policy's engine hits fall short
(`benchmarks/engine_decisions.py`), so what is pinned here is that the
record says what the router really counted, per engine, and that the
realized side is the engine's own ``cached_tokens`` (answers and streams).
"""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_kit import BLOCK, FakeEngine, engines_and_gateway
from test_app import hold

from kvmesh.benchmarks import engine_decisions
from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.errors import ConfigError
from kvmesh.gateway.config import EngineTarget, GatewayConfig
from kvmesh.gateway.decisions import DECISION_HEADER, DecisionLog, cached_tokens, usage_in_sse
from kvmesh.gateway.routing import make_router
from kvmesh.gateway.tokenizer import PromptTokenizer
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId

A, B = WorkerId("engine-0"), WorkerId("engine-1")


def h(*xs: int) -> list[PageHash]:
    return [PageHash(x.to_bytes(8, "big")) for x in xs]


# ------------------------------------------------------------------------ the log


def test_the_log_keeps_the_newest_records_and_completes_them_by_id() -> None:
    log = DecisionLog(capacity=2)
    loads = [WorkerLoad(A, active_prefill_tokens=64), WorkerLoad(B, stale=True)]
    ids = [
        log.record(
            policy="kv_aware",
            engine=str(A),
            prompt_blocks=3,
            predicted_blocks=2,
            pull_blocks=0,
            overlaps={A: 2},
            loads=loads,
            prefix=b"\x01\x02",
            attempt=0,
        )
        for _ in range(3)
    ]
    assert ids == [0, 1, 2]
    assert [r.id for r in log.records()] == [1, 2]  # the oldest went
    log.realize(2, 1)
    log.realize(0, 5)  # gone: ignored
    record = log.get(2)
    assert record is not None and record.realized_blocks == 1
    assert record.overlaps == {"engine-0": 2, "engine-1": 0}
    assert record.queued_tokens == {"engine-0": 64, "engine-1": 0}
    assert record.stale == ["engine-1"] and record.prefix == "0102"
    assert [r.id for r in log.records(since=2)] == [2]


def test_a_log_of_no_records_still_counts_ids_and_a_negative_size_is_refused() -> None:
    log = DecisionLog(0)
    kw = dict(policy="p", engine="e", prompt_blocks=0, predicted_blocks=0, pull_blocks=0)
    assert log.record(**kw, overlaps={}, loads=[], prefix=b"", attempt=0) == 0  # type: ignore[arg-type]
    assert log.record(**kw, overlaps={}, loads=[], prefix=b"", attempt=0) == 1  # type: ignore[arg-type]
    assert log.records() == []
    with pytest.raises(ConfigError, match="decision log"):
        DecisionLog(-1)
    with pytest.raises(ConfigError, match="decision_log"):
        GatewayConfig((EngineTarget("e", "http://127.0.0.1:1"),), decision_log=-1)


def test_cached_tokens_are_read_from_usage_and_from_a_streams_last_usage_chunk() -> None:
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 64}}) == 64
    nothing: list[object] = [
        None,
        {},
        {"prompt_tokens_details": None},
        {"prompt_tokens_details": {}},
    ]
    for usage in nothing:
        assert cached_tokens(usage) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": -1}}) is None
    chunk = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 96}}}
    stream = b'data: {"choices": [{"text": "a"}]}\n\ndata: ' + json.dumps(chunk).encode()
    assert usage_in_sse(stream + b"\n\ndata: [DONE]\n\n") == 96
    assert usage_in_sse(b'data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    assert usage_in_sse(b'ge": {"prompt_tokens_details": {"cached_tokens": 3}}}\n\n') is None


# ------------------------------------------------------------------------ the router's view


def test_overlaps_then_choose_is_route_and_the_history_router_records_its_choice() -> None:
    index = GlobalIndex()
    router = make_router("kv_aware", index, CoordinatorConfig())
    request = RouteRequest(h(1, 2), 2 * 32, page_size=32)
    loads = [WorkerLoad(A), WorkerLoad(B)]
    seen = router.overlaps(request, {B: [h(1)]})
    assert seen == {B: 1}  # a prefilling prompt counts as held
    assert router.choose(request, seen, loads, b"k") == router.route(
        request, loads, b"k", {B: [h(1)]}
    )
    history = make_router("approx_prefix", index, CoordinatorConfig())
    first = history.choose(request, history.overlaps(request), loads, b"k")
    assert history.overlaps(request) == {first.worker_id: 2}


# ------------------------------------------------------------------------ through the gateway


@pytest.mark.anyio
async def test_each_request_names_its_record_which_holds_the_view_and_the_engines_reuse(
    tokenizer: PromptTokenizer,
) -> None:
    engines = [FakeEngine("engine-0", cached=2 * BLOCK), FakeEngine("engine-1", cached=2 * BLOCK)]
    async with engines_and_gateway(engines, tokenizer) as s:
        ids = list(range(1, 3 * BLOCK + 2))  # three full blocks and one token
        hold(s.gateway, "engine-1", ids[: 2 * BLOCK])
        async with httpx.AsyncClient(timeout=10) as client:
            plain = await client.post(
                s.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}
            )
            streamed = await client.post(
                s.url + "/v1/completions",
                json={
                    "prompt": ids,
                    "max_tokens": 1,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            unasked = await client.post(
                s.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "stream": True}
            )
            listed = (await client.get(s.url + "/kvmesh/decisions")).json()["decisions"]
            later = (await client.get(s.url + "/kvmesh/decisions", params={"since": 2})).json()
    assert [r.headers[DECISION_HEADER] for r in (plain, streamed, unasked)] == ["0", "1", "2"]
    assert [r["id"] for r in later["decisions"]] == [2]
    first, second, third = listed
    assert first["engine"] == "engine-1" and first["policy"] == "kv_aware"
    assert first["overlaps"] == {"engine-0": 0, "engine-1": 2}
    assert first["prompt_blocks"] == 3 and first["predicted_blocks"] == 2
    assert first["realized_blocks"] == 2 and first["attempt"] == 0
    assert first["route_ms"] >= 0 and first["first_byte_ms"] > 0
    assert second["first_byte_ms"] > 0  # the stream's first chunk
    assert second["realized_blocks"] == 2  # from the stream's usage chunk
    assert third["realized_blocks"] is None  # the stream carried no usage


# ------------------------------------------------------------------------ the benchmark's reading


def record(turn: int, engine: str, overlaps: dict[str, int], predicted: int, realized: int,
           conversation: int = 0) -> dict[str, object]:  # fmt: skip
    return {
        "round": 0, "turn": turn, "conversation": conversation, "engine": engine,
        "overlaps": overlaps, "prompt_blocks": 4, "predicted_blocks": predicted,
        "realized_blocks": realized,
    }  # fmt: skip


def test_a_loss_is_classed_away_overestimated_unseen_or_nowhere() -> None:
    assert engine_decisions.loss_class(record(0, "a", {"a": 1, "b": 3}, 1, 1)) == "away"
    assert engine_decisions.loss_class(record(0, "a", {"a": 3, "b": 1}, 3, 1)) == "overestimated"
    assert engine_decisions.loss_class(record(0, "a", {"a": 1, "b": 0}, 1, 3)) == "unseen"
    assert engine_decisions.loss_class(record(0, "a", {"a": 1, "b": 1}, 1, 1)) == "nowhere"


def test_policies_are_summed_and_compared_on_the_same_turns() -> None:
    mine = [record(0, "a", {"a": 0, "b": 0}, 0, 0), record(1, "b", {"a": 2, "b": 0}, 0, 0)]
    theirs = [record(0, "a", {}, 0, 0), record(1, "a", {}, 2, 3)]
    s = engine_decisions.summarize("kv_aware", mine)
    assert (s.requests, s.prompt_blocks, s.realized_blocks) == (2, 8, 0)
    assert (s.away, s.away_blocks) == (1, 2)
    assert (s.follow_ups, s.stayed) == (1, 0)
    t = engine_decisions.summarize("approx_prefix", theirs)
    assert (t.unseen_blocks, t.stayed, t.hit_ratio) == (1, 1, 3 / 8)
    c = engine_decisions.compare("kv_aware", mine, "approx_prefix", theirs)
    assert (c.turns, c.a_more, c.b_more) == (2, 0, 1)
    assert c.lost["away"] == 3 and c.lost_turns["away"] == 1
    text = engine_decisions.report({"kv_aware": mine, "approx_prefix": theirs})
    assert "kv_aware vs approx_prefix on 2 turns" in text and "away 3 blocks/1 turns" in text


def test_a_kv_mesh_prediction_counts_store_loads_and_pulls_beside_the_own_cache() -> None:
    mesh = {**record(0, "a", {"a": 3}, 1, 3), "store_blocks": 2, "pull_blocks": 0,
            "predicted_total": 3}  # fmt: skip
    assert engine_decisions.loss_class(mesh) == "nowhere"  # the store's 2 blocks were foreseen
    pulled = {**record(1, "a", {"a": 1}, 1, 4), "pull_blocks": 2, "predicted_total": 3}
    s = engine_decisions.summarize("kv_mesh", [mesh, pulled])
    assert (s.predicted_blocks, s.realized_blocks, s.unseen_blocks) == (6, 7, 1)
    log = DecisionLog(4)
    rid = log.record(policy="kv_mesh", engine="a", prompt_blocks=4, predicted_blocks=1,
                     pull_blocks=1, overlaps={WorkerId("a"): 3}, loads=[WorkerLoad(WorkerId("a"))],
                     prefix=b"", attempt=0, store_blocks=2,
                     store_overlaps={WorkerId("a"): 2})  # fmt: skip
    written = log.get(rid)
    assert written is not None and written.as_dict()["predicted_total"] == 4
    assert written.store_overlaps == {"a": 2}
