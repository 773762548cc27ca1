"""What bounds a FetchPages stream on the serving side: pins, a deadline, an idle timeout.

A stream pins its pages a window (``fetch_window_pages``) at a time, within
caps per peer and for all streams together (`PinBudget`; a stream over one
waits ``fetch_pin_wait_s``, then `PinLimitExceeded`); `StreamWatch` cancels
the stream at its server-side deadline (``fetch_stream_timeout_s``) or when
one write waits longer than ``fetch_idle_timeout_s`` (a client that does not
read). Every pin is given back on every path (`FetchStream.release`).
All of it runs on the server's one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import InvariantViolation, PinLimitExceeded
from kvmesh.metrics import FETCH_PINNED_PAGES
from kvmesh.types import PageHash, PageId
from kvmesh.worker.page_service import PageService


@dataclass(frozen=True, slots=True)
class FetchLimits:
    """What FetchPages streams may hold on one pool, from `TransferConfig` (`fetch_limits`).

    Pins are page references: a page asked for twice in one window is two.
    """

    window_pages: int  # one stream, pinned as it goes
    peer_pins: int  # one peer's streams together
    total_pins: int  # every stream together; the rest of the pool stays for requests
    stream_timeout_s: float
    idle_timeout_s: float
    pin_wait_s: float


def fetch_limits(config: TransferConfig, num_pages: int) -> FetchLimits:
    """The FetchPages limits of `config` on a pool of `num_pages` (page 0 included); the
    caps are shares of the usable pages, at least one pin each (`TransferConfig` checks
    the settings' ranges)."""
    usable = max(1, num_pages - 1)
    return FetchLimits(
        window_pages=config.fetch_window_pages,
        peer_pins=max(1, int(config.fetch_peer_pin_fraction * usable)),
        total_pins=max(1, int(config.fetch_pin_fraction * usable)),
        stream_timeout_s=config.fetch_stream_timeout_s,
        idle_timeout_s=config.fetch_idle_timeout_s,
        pin_wait_s=config.fetch_pin_wait_s,
    )


class PinBudget:
    """Counts the pins FetchPages streams hold, in all and per peer, against two caps.

    `take` grants what fits under both caps (possibly fewer than asked, 0 when
    either is reached); every granted pin is given back with `give`. Not
    thread-safe: the server uses it from its one event loop.
    """

    __slots__ = ("_by_peer", "held", "per_peer", "total")

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self.held = 0
        self._by_peer: dict[str, int] = {}

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def take(self, peer: str, want: int) -> int:
        """Grant up to `want` pins to `peer`; how many were granted."""
        n = max(0, min(want, self.total - self.held, self.per_peer - self.held_by(peer)))
        if n:
            self.held += n
            self._by_peer[peer] = self.held_by(peer) + n
        return n

    def give(self, peer: str, n: int) -> None:
        """Return `n` pins `take` granted to `peer`."""
        if not n:
            return
        left = self.held_by(peer) - n
        if left < 0 or n < 0:
            raise InvariantViolation(
                f"peer {peer} gives back {n} fetch pins but holds {self.held_by(peer)}"
            )
        self.held -= n
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]


def peer_key(context: grpc.aio.ServicerContext) -> str:
    """Who a call comes from, for per-peer caps: its certificate's identity under mutual
    TLS, else its address without the port (on loopback every client is one peer)."""
    identities = context.peer_identities()
    if identities:
        return "cert:" + ",".join(bytes(i).decode(errors="replace") for i in identities)
    peer = context.peer() or "unknown"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() and host not in ("ipv4", "ipv6") else peer


class WriteFailed(Exception):
    """gRPC failed a FetchPages write: the call is broken (its cause says how)."""


class StreamWatch:
    """Cancels a FetchPages handler at its deadline, or when one write waits too long.

    A write waits when the client does not read: gRPC's flow-control window
    and buffers are full. `reason` says which limit fired ("fetch_deadline",
    "fetch_idle"); None when the handler was cancelled for another reason
    (client gone, server stopping).
    """

    __slots__ = ("_deadline", "_idle", "_idle_s", "_loop", "_task", "_writing_since", "reason")

    def __init__(self, limits: FetchLimits) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - handlers always run in a task
            raise InvariantViolation("a FetchPages handler runs outside an asyncio task")
        self._task = task
        self._idle_s = limits.idle_timeout_s
        self._writing_since: float | None = None
        self.reason: str | None = None
        self._deadline = self._loop.call_later(
            limits.stream_timeout_s, self._fire, "fetch_deadline"
        )
        self._idle = self._loop.call_later(self._idle_s, self._check_idle)

    async def write(self, context: grpc.aio.ServicerContext, message: bytes) -> None:
        """`context.write`, timed; `WriteFailed` when gRPC fails it (the call broke)."""
        self._writing_since = self._loop.time()
        try:
            await context.write(message)
        except Exception as exc:
            raise WriteFailed from exc
        self._writing_since = None

    def _check_idle(self) -> None:
        since, now = self._writing_since, self._loop.time()
        if since is not None and now - since >= self._idle_s:
            self._fire("fetch_idle")
            return
        at = since + self._idle_s if since is not None else now + self._idle_s / 2
        self._idle = self._loop.call_at(at, self._check_idle)

    def _fire(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self._task.cancel()

    def close(self) -> None:
        self._deadline.cancel()
        self._idle.cancel()


class FetchPins:
    """Pins pages for FetchPages streams within a `PinBudget`, on the server's event loop.

    A stream over a cap waits up to `fetch_pin_wait_s` for another stream to
    give pins back, then is refused with `PinLimitExceeded`.
    """

    __slots__ = ("_config", "_gauge", "_waiters", "budget", "limits", "service")

    def __init__(self, service: PageService, config: TransferConfig) -> None:
        self.service = service
        self._config = config
        self.limits = fetch_limits(config, service.pool.num_pages)
        self.budget = PinBudget(self.limits.total_pins, self.limits.peer_pins)
        self._waiters: set[asyncio.Future[None]] = set()
        self._gauge: Any = None

    def label(self, worker: str) -> None:
        """Report the pins held under `worker` in `FETCH_PINNED_PAGES`."""
        self._gauge = FETCH_PINNED_PAGES.labels(worker=worker)
        self._gauge.set(self.budget.held)

    async def pin(self, peer: str, hashes: Sequence[PageHash]) -> list[PageId | None]:
        """Pin the first n >= 1 of `hashes` (n: what the caps grant); None for a miss."""
        want = len(hashes)
        granted = self.budget.take(peer, want) or await self._wait(peer, want)
        try:
            ids = self.service.pin(hashes[:granted])
        except BaseException:
            self.budget.give(peer, granted)
            raise
        self.budget.give(peer, sum(1 for pid in ids if pid is None))
        self._changed()
        return ids

    def unpin(self, peer: str, ids: Sequence[PageId | None]) -> None:
        self.service.unpin(ids)
        self.budget.give(peer, sum(1 for pid in ids if pid is not None))
        self._changed()

    def _changed(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self.budget.held)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, peer: str, want: int) -> int:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.limits.pin_wait_s
        while True:
            granted = self.budget.take(peer, want)
            if granted:
                return granted
            left = end - loop.time()
            if left <= 0:
                raise PinLimitExceeded(self._refusal(peer))
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)

    def _refusal(self, peer: str) -> str:
        budget, cfg = self.budget, self._config
        waited = f"no pin came free within TransferConfig.fetch_pin_wait_s={cfg.fetch_pin_wait_s}s"
        if budget.held >= budget.total:
            return (
                f"FetchPages streams hold {budget.held} pinned pages, the cap for all peers "
                f"together (TransferConfig.fetch_pin_fraction={cfg.fetch_pin_fraction} of the "
                f"pool: {budget.total}; the rest stays free for requests); {waited}. Retry later"
            )
        return (
            f"FetchPages streams from {peer} hold {budget.held_by(peer)} pinned pages, the cap "
            f"per peer (TransferConfig.fetch_peer_pin_fraction={cfg.fetch_peer_pin_fraction} of "
            f"the pool: {budget.per_peer}); {waited}. Read or close the streams already open, "
            "or retry later"
        )


class FetchStream:
    """One FetchPages stream: its peer, the pins it holds, the pages it has sent."""

    __slots__ = ("_held", "_pins", "peer", "sent")

    def __init__(self, pins: FetchPins, peer: str) -> None:
        self._pins = pins
        self.peer = peer
        self.sent = 0
        self._held: list[PageId | None] = []

    async def pin(self, hashes: Sequence[PageHash]) -> list[PageId | None]:
        ids = await self._pins.pin(self.peer, hashes)
        self._held.extend(pid for pid in ids if pid is not None)
        return ids

    def release(self) -> None:
        """Give back every pin the stream holds (idempotent)."""
        held, self._held = self._held, []
        if held:
            self._pins.unpin(self.peer, held)
