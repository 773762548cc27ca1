"""Peers: one contract for moving pages to and from another worker, whatever carries them.

::

    Peers.get(address) ─► Peer          (TRANSPORTS[TransferConfig.transport])
      .pull_into(receiver, hashes, deadline_s=) ─► PullOutcome
      .push(service, hashes, ticket, deadline_s=) ─► PushOutcome

A pull lands every page through the `PageReceiver` it is given (bound to
the puller's own `ProofBook`), so a page enters the pool whole, checked and
proven once, on every transport. A push presents the receiving worker's
grant ticket. `GrpcPeer` talks to the peer's gRPC server (`SyncPeerClient`);
`DistPeer` moves pages over a torch.distributed link (`DistLinks`) and,
when the link fails, drops it, logs the reason and redoes the transfer over
its `GrpcPeer` (the outcome carries the reason). The caller never branches
on the transport: it asks `Peers` for the peer at an address.

Counting: pulls and pushes per transport and dist fallbacks are metrics
(`kvmesh_peer_transfers_total`, `kvmesh_dist_fallbacks_total`, by worker);
`Peers.counts` reads them back for `WorkerStats`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, KVMeshError, PermissionDenied, TransportError
from kvmesh.metrics import DIST_FALLBACKS, PEER_TRANSFERS, counter_value
from kvmesh.rendezvous import LINK_SERVER_RANK
from kvmesh.types import PageHash
from kvmesh.worker.links import DistLinks
from kvmesh.worker.page_service import PageReceiver, PageService, PullOutcome
from kvmesh.worker.transfer_client import SyncPeerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PushOutcome:
    """How one push went: the transport that delivered (after any fallback), the pages
    offered and the pages the receiver holds now, and why the configured transport was
    left, if it was."""

    transport: str
    sent: int
    stored: int
    fallback_reason: str | None = None


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """Transfers a worker started since it started (or since `Peers.reset_counts`)."""

    pulls_grpc: int = 0  # a dist fallback counts here too
    pulls_dist: int = 0
    pushes_grpc: int = 0
    pushes_dist: int = 0
    dist_fallbacks: int = 0  # torch.distributed transfers that failed and went over gRPC


class Peer(Protocol):
    """Another worker, as the one at `address` is reached over `transport`."""

    address: str
    transport: str

    def pull_into(
        self, receiver: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> PullOutcome:
        """Fetch `hashes` (in order, stopping at the first the peer lacks) into `receiver`.

        A failure part-way is not raised: the outcome's `error` says why, and the
        pages cached before it count. Raises `TransportError` only for a fault of
        the transport code itself."""
        ...

    def push(
        self,
        service: PageService,
        hashes: Sequence[PageHash],
        ticket: bytes,
        *,
        deadline_s: float | None = None,
    ) -> PushOutcome:
        """Send the pages of `hashes` `service` holds under the receiver's grant `ticket`.

        Raises `PermissionDenied` when the receiver refused them (no live grant, pages
        its request does not prove), another `KVMeshError` when the push failed."""
        ...

    def close(self) -> None: ...


class _Tally:
    """A worker's transfer counters: named metrics (`kvmesh.metrics`), read back as the
    change since this worker started or last reset them."""

    __slots__ = ("_base", "worker")

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._base = self._read()

    def moved(self, direction: str, transport: str) -> None:
        PEER_TRANSFERS.labels(self.worker, direction, transport).inc()

    def fell_back(self, direction: str) -> None:
        DIST_FALLBACKS.labels(self.worker, direction).inc()

    def snapshot(self) -> TransferCounts:
        now, base = self._read(), self._base
        return TransferCounts(
            *(getattr(now, f.name) - getattr(base, f.name) for f in dataclasses.fields(now))
        )

    def reset(self) -> None:
        self._base = self._read()

    def _read(self) -> TransferCounts:
        def moved(direction: str, transport: str) -> int:
            labels = {"worker": self.worker, "direction": direction, "transport": transport}
            return counter_value("kvmesh_peer_transfers", **labels)

        fallbacks = sum(
            counter_value("kvmesh_dist_fallbacks", worker=self.worker, direction=d)
            for d in ("pull", "push")
        )
        return TransferCounts(
            moved("pull", "grpc"),
            moved("pull", "dist"),
            moved("push", "grpc"),
            moved("push", "dist"),
            fallbacks,
        )


class GrpcPeer:
    """A peer reached over its gRPC server; one reused `SyncPeerClient` (its channels)."""

    transport = "grpc"

    def __init__(self, address: str, config: TransferConfig, tally: _Tally) -> None:
        self.address = address
        self.client = SyncPeerClient(address, config)
        self._tally = tally

    def pull_into(
        self, receiver: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> PullOutcome:
        self._tally.moved("pull", self.transport)
        asked = tuple(hashes)
        try:
            inserted = self.client.pull_into(receiver, list(asked), deadline_s=deadline_s)
        except KVMeshError as exc:  # the whole pages cached before it still count
            return PullOutcome(asked, self.transport, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a transport bug must not fail the request: compute instead
            raise TransportError(f"pull from {self.address} failed: {exc}") from exc
        return PullOutcome(asked, self.transport, inserted)

    def push(
        self,
        service: PageService,
        hashes: Sequence[PageHash],
        ticket: bytes,
        *,
        deadline_s: float | None = None,
    ) -> PushOutcome:
        self.client.push_from(service, list(hashes), ticket, deadline_s=deadline_s)
        self._tally.moved("push", self.transport)
        return PushOutcome(self.transport, len(hashes), len(hashes))

    def close(self) -> None:
        self.client.close()


class DistPeer:
    """A peer reached over a torch.distributed link, falling back to gRPC (logged, with
    its reason) for the transfer at hand when the link fails; the next use opens a fresh
    link."""

    transport = "dist"

    def __init__(self, address: str, links: DistLinks, fallback: GrpcPeer, tally: _Tally) -> None:
        self.address = address
        self._links = links
        self._fallback = fallback
        self._tally = tally

    def pull_into(
        self, receiver: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> PullOutcome:
        asked = tuple(hashes)
        try:
            result = self._links.link(self.address).pull(LINK_SERVER_RANK, asked, receiver)
        except TransportError as exc:
            reason = self._fell_back("pull", len(asked), exc)
            outcome = self._fallback.pull_into(receiver, asked, deadline_s=deadline_s)
            return dataclasses.replace(outcome, fallback_reason=reason)
        self._tally.moved("pull", self.transport)
        return PullOutcome(asked, self.transport, len(result.inserted))

    def push(
        self,
        service: PageService,
        hashes: Sequence[PageHash],
        ticket: bytes,
        *,
        deadline_s: float | None = None,
    ) -> PushOutcome:
        """The fallback presents the same one-use ticket, so it is refused when the link
        had already delivered the push's preamble."""
        todo = list(hashes)
        try:
            sent = self._links.link(self.address).push(LINK_SERVER_RANK, todo, ticket)
        except TransportError as exc:
            reason = self._fell_back("push", len(todo), exc)
            outcome = self._fallback.push(service, todo, ticket, deadline_s=deadline_s)
            return dataclasses.replace(outcome, fallback_reason=reason)
        self._tally.moved("push", self.transport)
        if sent.refused:
            raise PermissionDenied(
                f"the worker at {self.address} refused {sent.refused} of {len(sent.sent)} "
                "pushed pages (no live grant, or pages its request does not prove)"
            )
        return PushOutcome(self.transport, len(sent.sent), sent.stored or 0)

    def close(self) -> None:
        """Close the gRPC fallback; the link is `DistLinks`' to hang up."""
        self._fallback.close()

    def _fell_back(self, what: str, pages: int, exc: TransportError) -> str:
        reason = f"{type(exc).__name__}: {exc}"
        self._links.drop(self.address)
        self._tally.fell_back(what)
        log.warning(
            "dist %s of %d pages with %s failed, falling back to grpc: %s",
            what,
            pages,
            self.address,
            reason,
        )
        return reason


PeerFactory = Callable[["Peers", str], Peer]


def _grpc_peer(peers: Peers, address: str) -> Peer:
    return GrpcPeer(address, peers.config, peers.tally)


def _dist_peer(peers: Peers, address: str) -> Peer:
    if peers.links is None:
        raise ConfigError("transport='dist' needs the worker's torch.distributed links")
    return DistPeer(address, peers.links, GrpcPeer(address, peers.config, peers.tally), peers.tally)


TRANSPORTS: dict[str, PeerFactory] = {"grpc": _grpc_peer, "dist": _dist_peer}
"""Registry: `TransferConfig.transport` name -> how a peer at an address is reached."""


class Peers:
    """The peers of one worker by address, each reached over `config.transport`.

    Peers are made on first use and kept (their connections are reused) until
    `close`. `links` is needed for transport="dist"; `worker` (this worker's id)
    labels the transfer metrics. Raises `ConfigError` for an unknown transport.
    """

    def __init__(
        self, config: TransferConfig, *, links: DistLinks | None = None, worker: str = ""
    ) -> None:
        self.factory = transport_factory(config.transport)
        self.config = config
        self.links = links
        self.tally = _Tally(worker)
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> Peer:
        """The peer at `address` (made on first use)."""
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = self.factory(self, address)
            return peer

    def counts(self) -> TransferCounts:
        return self.tally.snapshot()

    def reset_counts(self) -> None:
        self.tally.reset()

    def close(self) -> None:
        """Close every peer's connections and hang up every link this worker opened."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        if self.links is not None:
            self.links.hang_up_all()


def check_transport(name: str, profile: str) -> None:
    """Refuse a transport a worker cannot use, before anything starts: an unknown name, or
    torch.distributed (no TLS, no token) under the production profile (`ConfigError`)."""
    transport_factory(name)
    if name == "dist" and profile == "production":
        raise ConfigError(
            "transport='dist' moves pages over torch.distributed without TLS or tokens; the "
            "production profile needs transport='grpc'"
        )


def transport_factory(name: str) -> PeerFactory:
    """The `TRANSPORTS` entry for `name`; `ConfigError` naming the choices otherwise."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ConfigError(f"unknown transport {name!r}; choose one of {sorted(TRANSPORTS)}") from None


__all__ = [
    "TRANSPORTS",
    "DistPeer",
    "GrpcPeer",
    "Peer",
    "Peers",
    "PullOutcome",
    "PushOutcome",
    "TransferCounts",
    "check_transport",
    "transport_factory",
]
