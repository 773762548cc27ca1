"""EnginePool's health rules: refused is down at once, slow or failing only after N in a row."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.gateway.config import EngineTarget
from kvmesh.gateway.engines import EnginePool
from kvmesh.types import WorkerId

pytestmark = pytest.mark.anyio


def client_answering(*outcomes: str) -> httpx.AsyncClient:
    """A client whose /health calls answer `outcomes` in turn: ok, 503, timeout, refused."""
    queue = list(outcomes)

    def answer(request: httpx.Request) -> httpx.Response:
        what = queue.pop(0)
        if what == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if what == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200 if what == "ok" else int(what))

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


async def states(pool: EnginePool, *outcomes: str) -> list[bool]:
    engine = pool[WorkerId("e")]
    seen = []
    async with client_answering(*outcomes) as client:
        for _ in outcomes:
            await pool.check(client, engine, 1.0)
            seen.append(engine.up)
    return seen


async def test_a_refused_connection_is_down_at_once_and_a_200_brings_it_back() -> None:
    pool = EnginePool([EngineTarget("e", "http://127.0.0.1:1")], down_after=3)
    assert await states(pool, "refused", "ok") == [False, True]


async def test_slow_or_failing_checks_are_down_only_after_n_in_a_row() -> None:
    pool = EnginePool([EngineTarget("e", "http://127.0.0.1:1")], down_after=2)
    assert await states(pool, "timeout", "ok", "503", "timeout", "ok") == [
        True,
        True,
        True,
        False,
        True,
    ]
    assert pool.loads(set()) and pool[WorkerId("e")].failed_checks == 0


async def test_an_engine_down_is_no_routing_candidate() -> None:
    pool = EnginePool(
        [EngineTarget("e", "http://127.0.0.1:1"), EngineTarget("f", "http://127.0.0.1:2")]
    )
    await states(pool, "refused")
    assert [load.worker_id for load in pool.loads(set())] == ["f"]
