"""The engines behind the gateway: their health and the load the gateway put on them.

Load is what this gateway has in flight on each engine: requests, and the
prompt tokens still to prefill (counted from the moment a request is sent
until the engine's first bytes come back, minus the prefix the index said
the engine holds). That is the queue the `kv_aware` cost weighs.

Health: an engine is up until a connection to it is refused (a request's
or a health check's), or its ``/health`` times out or answers other than
200 in `down_after` checks in a row; it is up again when ``/health``
answers 200. A down engine is never a routing candidate, so
once a health check (or a failed request) has seen it die, no request is
sent to it. The state is plain data changed only on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from kvmesh.gateway.config import EngineTarget
from kvmesh.load import WorkerLoad
from kvmesh.metrics import (
    GATEWAY_ENGINE_DOWN,
    GATEWAY_ENGINE_UP,
    GATEWAY_INFLIGHT,
    GATEWAY_INFLIGHT_PREFILL,
)
from kvmesh.types import PageHash, WorkerId

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineState:
    """One engine's health and the gateway's load on it (mutable, event loop only)."""

    spec: EngineTarget
    up: bool = True
    inflight_requests: int = 0
    inflight_prefill_tokens: int = 0
    last_error: str = ""
    failed_checks: int = 0  # consecutive health checks that timed out or were not 200
    prefilling: list[Ticket] = field(default_factory=list)
    """Requests sent here whose prefill has not finished: their blocks are about to be cached."""

    @property
    def worker_id(self) -> WorkerId:
        return WorkerId(self.spec.name)


@dataclass(slots=True, eq=False)  # one ticket is one request: compared by identity
class Ticket:
    """One request in flight on one engine; `prefill_done` ends its prefill share early."""

    engine: EngineState
    prefill_tokens: int
    hashes: tuple[PageHash, ...] = ()
    prefilling: bool = True
    open: bool = True

    def prefill_done(self) -> None:
        if self.prefilling:
            self.prefilling = False
            self.engine.inflight_prefill_tokens -= self.prefill_tokens
            self.engine.prefilling.remove(self)

    def close(self) -> None:
        """Idempotent: the request left the engine (answered, failed or cancelled)."""
        if self.open:
            self.open = False
            self.prefill_done()
            self.engine.inflight_requests -= 1


def _export(state: EngineState) -> None:
    """Point the engine's gauges at its state (read at scrape time; one gateway per process)."""
    name = state.spec.name
    GATEWAY_ENGINE_UP.labels(name).set_function(lambda: float(state.up))
    GATEWAY_INFLIGHT.labels(name).set_function(lambda: float(state.inflight_requests))
    GATEWAY_INFLIGHT_PREFILL.labels(name).set_function(lambda: float(state.inflight_prefill_tokens))


class EnginePool:
    """The engines by name, their load as `WorkerLoad`s, and the health loop."""

    def __init__(self, specs: Iterable[EngineTarget], down_after: int = 2) -> None:
        self.engines: dict[WorkerId, EngineState] = {
            WorkerId(s.name): EngineState(s) for s in specs
        }
        self.down_after = down_after
        self.on_up: Callable[[EngineState], None] | None = None
        """Called when a down engine answers its health check again (a restart, maybe)."""
        for state in self.engines.values():
            _export(state)

    def __getitem__(self, worker_id: WorkerId) -> EngineState:
        return self.engines[worker_id]

    def up(self) -> list[EngineState]:
        return [e for e in self.engines.values() if e.up]

    def loads(
        self, stale: Collection[WorkerId], exclude: Collection[WorkerId] = ()
    ) -> list[WorkerLoad]:
        """Routing candidates: every engine up and not excluded, with its in-flight load.

        `stale`: engines whose index entries are not trusted (a gap in their
        events, or a failed canary); they stay candidates without affinity.
        """
        return [
            WorkerLoad(
                e.worker_id,
                active_prefill_tokens=e.inflight_prefill_tokens,
                active_requests=e.inflight_requests,
                stale=e.worker_id in stale,
            )
            for e in self.engines.values()
            if e.up and e.worker_id not in exclude
        ]

    def begin(
        self, engine: EngineState, prefill_tokens: int, hashes: Sequence[PageHash] = ()
    ) -> Ticket:
        """A request goes to `engine`; `hashes`: its prompt's blocks, which the engine will
        hold once the prefill is done (see `prefilling`)."""
        engine.inflight_requests += 1
        engine.inflight_prefill_tokens += prefill_tokens
        ticket = Ticket(engine, prefill_tokens, tuple(hashes))
        engine.prefilling.append(ticket)
        return ticket

    def prefilling(
        self, exclude: Collection[WorkerId] = ()
    ) -> dict[WorkerId, list[tuple[PageHash, ...]]]:
        """The block hashes of the requests each engine is prefilling now.

        Their blocks reach the index only with the engine's events after the
        prefill; until then a router that ignored them would send the next
        request with the same new prefix (a shared system prompt, two turns
        close together) to another engine, computing and caching it twice.
        Like the loads, this is the gateway's own in-flight state: two
        gateways fed the same events and the same requests decide alike.
        """
        return {
            e.worker_id: [t.hashes for t in e.prefilling if t.hashes]
            for e in self.engines.values()
            if e.up and e.worker_id not in exclude and any(t.hashes for t in e.prefilling)
        }

    def mark_down(self, engine: EngineState, reason: str) -> None:
        if engine.up:
            log.warning("engine %s is down: %s", engine.spec.name, reason)
            GATEWAY_ENGINE_DOWN.labels(engine.spec.name).inc()
        engine.up = False
        engine.last_error = reason

    def mark_up(self, engine: EngineState) -> None:
        was_down = not engine.up
        engine.up = True
        engine.last_error = ""
        if was_down:
            log.info("engine %s is up again", engine.spec.name)
            if self.on_up is not None:
                self.on_up(engine)

    async def check(self, client: httpx.AsyncClient, engine: EngineState, timeout_s: float) -> bool:
        """One ``GET /health``; marks the engine up or down and says whether it answered.

        A refused connection (nothing listens) marks the engine down at once;
        a timeout or an answer other than 200 does after `down_after` such
        checks in a row, so one slow answer from a busy engine is no outage.
        """
        try:
            resp = await client.get(engine.spec.base_url + "/health", timeout=timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.mark_down(engine, f"/health: {type(exc).__name__}: {exc}")
            return False
        except httpx.HTTPError as exc:
            self._failed(engine, f"/health: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code != 200:
            self._failed(engine, f"/health answered {resp.status_code}")
            return False
        engine.failed_checks = 0
        self.mark_up(engine)
        return True

    def _failed(self, engine: EngineState, reason: str) -> None:
        engine.failed_checks += 1
        engine.last_error = reason
        if engine.failed_checks >= self.down_after:
            self.mark_down(engine, f"{reason} ({engine.failed_checks} checks in a row)")

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self.check(client, e, timeout_s) for e in self.engines.values()))

    async def health_loop(
        self, client: httpx.AsyncClient, interval_s: float, timeout_s: float
    ) -> None:
        """Check every engine each `interval_s` until cancelled."""
        while True:
            await self.check_all(client, timeout_s)
            await asyncio.sleep(interval_s)
