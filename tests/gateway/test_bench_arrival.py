"""How `kvmesh bench engines` sends a slice: the trace's own arrivals (open loop) or clients
that wait for their answers (closed loop); a follow-up turn always waits for its answer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from gateway_kit import serve

from kvmesh.app.cli import main
from kvmesh.benchmarks.bench_engines import (
    CPU_CLASSES,
    Measured,
    Replay,
    Turn,
    cpu_by_class,
    joined,
    previous_turns,
    replay,
    replay_open,
    send_times,
    summarize,
    to_turns,
)
from kvmesh.benchmarks.engine_slices import trace_slice
from kvmesh.engine_launcher import VLLMEngine
from kvmesh.errors import ConfigError
from kvmesh.trace import TraceRequest

pytestmark = pytest.mark.anyio


def turns_at(*spec: tuple[int, float]) -> list[Turn]:
    """Turns of the given conversations at the given trace times, each prompt naming its turn."""
    return [Turn(c, (i,), at) for i, (c, at) in enumerate(spec)]


def test_send_times_keep_the_traces_gaps_at_the_asked_rate() -> None:
    turns = turns_at((0, 100.0), (1, 101.0), (0, 103.0), (2, 108.0))
    at = send_times(turns, rate=3.0)  # 3 gaps in 1 s at 3 requests/s: the trace runs 8x faster
    assert at == pytest.approx([0.0, 0.125, 0.375, 1.0])
    assert send_times(turns_at((0, 5.0), (1, 5.0), (2, 5.0)), rate=2.0) == [0.0, 0.5, 1.0]
    with pytest.raises(ConfigError, match="positive"):
        send_times(turns, rate=0.0)


def test_a_turn_waits_for_its_conversations_previous_turn() -> None:
    turns = turns_at((7, 0.0), (8, 0.0), (7, 0.0), (9, 0.0), (8, 0.0), (7, 0.0))
    assert previous_turns(turns) == [None, None, 0, None, 1, 2]


def test_to_turns_carry_the_traces_times_from_the_first_request() -> None:
    trace = [TraceRequest(5000 + 1000 * i, 1024, 1, (0, 1 + i % 2, 3 + i)) for i in range(4)]
    picked = trace_slice(trace, 4, 1, 10, "fitting-requests")
    assert [t.at_s for t in to_turns(picked, block_tokens=32, vocab=100)] == [0.0, 1.0, 2.0, 3.0]


class SlowEngine:
    """Answers a streamed completion after `delay_s`, recording when each prompt arrived and
    when its answer ended."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.arrived: dict[int, float] = {}
        self.answered: dict[int, float] = {}
        self.in_flight = 0
        self.most_in_flight = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            turn = (await request.json())["prompt"][0]
            self.arrived[turn] = time.monotonic()
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

            async def chunks():  # type: ignore[no-untyped-def]
                await asyncio.sleep(self.delay_s)
                yield b'data: {"choices": [{"text": "x"}]}\n\n'
                self.in_flight -= 1
                self.answered[turn] = time.monotonic()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        return app


async def test_the_open_loop_sends_whatever_is_in_flight_but_holds_follow_ups() -> None:
    engine = SlowEngine(delay_s=0.3)
    served = await serve(engine.app())
    try:
        # four conversations arrive together, then conversation 0's follow-up, due long
        # before its first turn is answered
        turns = turns_at((0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (0, 0.01))
        out = Replay()
        await replay_open(served.url, turns, rate=1000.0, max_tokens=1, out=out)
    finally:
        await served.stop()
    assert out.errors == 0 and len(out.ttfts) == 5
    assert engine.most_in_flight == 4  # none waited for another conversation's answer
    assert out.held == 1
    assert engine.arrived[4] >= engine.answered[0]


async def test_the_closed_loop_keeps_at_most_its_clients_in_flight() -> None:
    engine = SlowEngine(delay_s=0.05)
    served = await serve(engine.app())
    try:
        turns = turns_at(*((i % 3, 0.0) for i in range(9)))
        out = Replay()
        await replay(served.url, turns, concurrency=2, max_tokens=1, out=out)
    finally:
        await served.stop()
    assert out.errors == 0 and len(out.ttfts) == 9
    assert engine.most_in_flight == 2
    for i in range(3, 9):
        assert engine.arrived[i] >= engine.answered[i - 3]


async def test_requests_are_spread_over_gateway_replicas_in_turn() -> None:
    """A load balancer in front of replicas knows no conversations: request `i` goes to
    replica ``i % N``, so a conversation's turns reach different replicas."""
    first, second = SlowEngine(delay_s=0.01), SlowEngine(delay_s=0.01)
    served = [await serve(first.app()), await serve(second.app())]
    try:
        turns = turns_at(*((i % 2, 0.0) for i in range(5)))  # two conversations, alternating
        out = Replay()
        await replay([s.url for s in served], turns, concurrency=2, max_tokens=1, out=out)
        opened = Replay()
        await replay_open([s.url for s in served], turns, rate=1000.0, max_tokens=1, out=opened)
    finally:
        for s in served:
            await s.stop()
    assert out.errors == 0 and opened.errors == 0
    assert sorted(first.arrived) == [0, 2, 4] and sorted(second.arrived) == [1, 3]


def test_decision_records_are_joined_per_gateway_replica() -> None:
    """Each replica numbers its decisions from its own counter: the same id on two replicas
    names two requests."""
    turns = turns_at((0, 0.0), (1, 0.0), (0, 1.0))
    replay_ = Replay(decision_of={0: 1, 1: 1, 2: 2}, ttft_of={0: 0.5, 1: 0.25, 2: 0.125})
    records = [
        [{"id": 1, "engine": "engine-0"}, {"id": 2, "engine": "engine-1"}],  # turns 0 and 2
        [{"id": 1, "engine": "engine-1"}],  # turn 1
    ]
    out = joined(records, replay_, turns, round_=0)
    assert [(r["turn"], r["gateway"], r["engine"], r["ttft_ms"]) for r in out] == [
        (0, 0, "engine-0", 500.0),
        (1, 1, "engine-1", 250.0),
        (2, 0, "engine-1", 125.0),
    ]


def test_a_rate_with_the_closed_loop_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "engines", "--arrival", "closed", "--rate", "2"])
    assert code != 0
    assert "--rate sets trace arrivals" in capsys.readouterr().err


def test_the_engines_own_times_are_means_per_request() -> None:
    m = Measured(wall_s=1.0)
    m.replay.ttfts = [0.2, 0.4]
    m.spent = {"queue_s": 0.1, "prefill_s": 0.3, "ttft_s": 0.5, "requests": 2.0}
    m.decisions = [
        {"route_ms": 1.0, "first_byte_ms": 100.0},
        {"route_ms": 3.0, "first_byte_ms": 200.0},
        {"route_ms": None, "first_byte_ms": None},  # a request that never reached an engine
    ]
    r = summarize("kv_aware", m, bound=0.7)
    assert (r.gateway_route_ms, r.gateway_first_byte_ms) == (2.0, 150.0)
    assert (r.engine_queue_ms, r.engine_prefill_ms, r.engine_ttft_ms) == pytest.approx(
        (50.0, 150.0, 250.0)
    )
    assert r.ttft_mean_ms == pytest.approx(300.0)


BURN = """
import subprocess, sys
if sys.argv[1] == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]]).wait()
else:
    open("/proc/self/comm", "w").write("VLLM::Worker")
    while True:
        pass
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_cpu_is_counted_by_the_engines_process_classes() -> None:
    """The engine's process tree is walked: a child named as vLLM names its model runner
    counts as the model, the engine's own process as its API server."""
    parent = subprocess.Popen([sys.executable, "-c", BURN, "parent", BURN], start_new_session=True)
    try:
        engine = cast(VLLMEngine, SimpleNamespace(process=parent))
        deadline = time.monotonic() + 30
        during = cpu_by_class([engine], gateways=[os.getpid()])
        while during["model"] == 0.0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child has named itself and run a clock tick
            during = cpu_by_class([engine], gateways=[os.getpid()])
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    assert set(during) == set(CPU_CLASSES)
    assert during["model"] > 0.0
    assert during["engine core"] == 0.0 and during["stores"] == 0.0
    assert during["gateway"] > 0.0 and during["client"] > 0.0  # this process played both


def test_cpu_per_request_divides_by_the_answered_requests() -> None:
    m = Measured(wall_s=1.0)
    m.replay.ttfts = [0.1] * 4
    m.cpu = {"model": 0.2, "API server": 0.04}
    r = summarize("round_robin", m, bound=0.7)
    assert r.cpu_ms_per_request == {"model": 50.0, "API server": 10.0}
