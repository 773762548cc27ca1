"""A worker's torch.distributed links: one process group of two per peer, opened on demand.

The first transfer to a peer asks the coordinator (``dist_link``), which
hands out the rendezvous (its store, the ranks: this end `LINK_CLIENT_RANK`,
the peer `LINK_SERVER_RANK`, a fresh prefix) and has the peer join through
its `dist_accept`, which serves the link from a thread (`accept`) until
hang-up, idle timeout or failure. A link that broke is dropped; the next use
opens a fresh one. Links are only the torch.distributed side of a `Peer`
(`kvmesh.worker.peers`), which falls back to gRPC when one fails.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, InvalidInput, KVMeshError, TransportError
from kvmesh.metrics import DIST_LINKS, counter_value
from kvmesh.rendezvous import LINK_CLIENT_RANK, LINK_SERVER_RANK, DistRendezvous
from kvmesh.types import WorkerId
from kvmesh.worker.dist_group import DistGroup
from kvmesh.worker.dist_transport import DistPageTransport
from kvmesh.worker.events_reporter import remote_cause
from kvmesh.worker.page_service import PageService

log = logging.getLogger(__name__)

OpenRendezvous = Callable[[str], DistRendezvous]
"""Asks the coordinator for a link to the worker at an address; raises when it cannot."""


class DistLinks:
    """The links of one worker, both ends: those it opened (by peer address) and those
    peers opened to it (served in threads). Thread-safe; one open per peer at a time.

    `open_rendezvous` None: no coordinator, so no link can be opened (only served).
    `host` is the address this worker's gloo listens on.
    """

    def __init__(
        self,
        worker_id: WorkerId,
        pages: PageService,
        config: TransferConfig,
        *,
        open_rendezvous: OpenRendezvous | None,
        host: str,
    ) -> None:
        self.worker_id = worker_id
        self._pages = pages
        self._config = config
        self._open = open_rendezvous
        self._host = host
        self._guard = threading.Lock()
        self._links: dict[str, DistPageTransport] = {}  # peer address -> this end (client)
        self._locks: dict[str, threading.Lock] = {}
        self._served: dict[str, DistGroup] = {}  # rendezvous prefix -> group this end serves
        self._base = (self._count("client"), self._count("server"))

    def link(self, address: str) -> DistPageTransport:
        """The link to the worker at `address`, opened through the coordinator if there is
        none usable. Raises `TransportError` when it cannot be opened (no coordinator, the
        peer unknown or refusing, the rendezvous timing out)."""
        with self._guard:
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            link = self._links.get(address)
            if link is not None and link.group.usable:
                return link
            self.drop(address)
            if self._open is None:
                raise TransportError("no coordinator to open a torch.distributed link through")
            try:
                rendezvous = self._open(address)
            except Exception as exc:
                cause = remote_cause(exc)
                raise TransportError(
                    f"the coordinator could not open a link to {address}: "
                    f"{type(cause).__name__}: {cause}"
                ) from exc
            link = self._join(rendezvous)
            with self._guard:
                self._links[address] = link
            DIST_LINKS.labels(self.worker_id, "client").inc()
            return link

    def current(self, address: str) -> DistPageTransport | None:
        """The link to `address` now, usable or not (None: none open)."""
        with self._guard:
            return self._links.get(address)

    def drop(self, address: str) -> None:
        """Forget the link to `address` (closed; the next use opens a fresh one)."""
        with self._guard:
            link = self._links.pop(address, None)
        if link is not None:
            link.group.close()

    def accept(self, rendezvous: DistRendezvous) -> None:
        """Join a link a peer opened and serve it from a daemon thread; returns at once.

        Raises `ConfigError` when this worker moves pages over gRPC only, `UnknownWorker` /
        `InvalidInput` for a rendezvous that does not make it the serving rank.
        """
        if self._config.transport != "dist":
            raise ConfigError(
                f"worker {self.worker_id!r} moves pages over gRPC only; start it with "
                "TransferConfig.transport='dist' to take torch.distributed links"
            )
        if rendezvous.rank_of(self.worker_id) != LINK_SERVER_RANK:
            raise InvalidInput(f"worker {self.worker_id!r} is not the serving rank of this link")
        threading.Thread(
            target=self._serve,
            args=(rendezvous,),
            name=f"kvmesh-link-{self.worker_id}",
            daemon=True,
        ).start()

    def hang_up_all(self) -> None:
        """Tell every peer this worker opened a link to that it ends (best effort), close them."""
        with self._guard:
            addresses = list(self._links)
        for address in addresses:
            link = self.current(address)
            if link is not None and link.group.usable:
                try:
                    link.hang_up(LINK_SERVER_RANK)
                except KVMeshError as exc:
                    log.info("hang-up on the link to %s failed: %s", address, exc)
            self.drop(address)

    @property
    def opened(self) -> int:
        """Links this worker opened (client end) since it started or `reset_counts`."""
        return self._count("client") - self._base[0]

    @property
    def served(self) -> int:
        """Links peers opened to this worker since it started or `reset_counts`."""
        return self._count("server") - self._base[1]

    def reset_counts(self) -> None:
        self._base = (self._count("client"), self._count("server"))

    def _count(self, end: str) -> int:
        return counter_value("kvmesh_dist_links", worker=self.worker_id, end=end)

    def _join(self, rendezvous: DistRendezvous) -> DistPageTransport:
        """Join a link's group (within the connect timeout) and wrap it in a transport whose
        transfers wait up to `dist_timeout_s`. Raises `TransportError`."""
        cfg = self._config
        group = DistGroup.join(
            rendezvous,
            self.worker_id,
            device=self._pages.store.device,
            timeout_s=cfg.dist_connect_timeout_s,
            host=self._host,
        )
        group.timeout_s = cfg.dist_timeout_s
        return DistPageTransport.from_config(group, self._pages, cfg)

    def _serve(self, rendezvous: DistRendezvous) -> None:
        """Join `rendezvous` as its serving rank; answer pulls and take pushes until hang-up
        or failure."""
        client = rendezvous.worker_of(LINK_CLIENT_RANK)
        try:
            transport = self._join(rendezvous)
        except TransportError as exc:
            log.warning("link from %s was not joined: %s", client, exc)
            return
        group = transport.group
        with self._guard:
            self._served[rendezvous.prefix] = group
        DIST_LINKS.labels(self.worker_id, "server").inc()
        try:
            transport.serve_forever(LINK_CLIENT_RANK, idle_timeout_s=self._config.dist_idle_timeout_s)
        except KVMeshError as exc:
            log.info("link from %s ended: %s", client, exc)
        finally:
            with self._guard:
                self._served.pop(rendezvous.prefix, None)
            group.close()


__all__ = ["DistLinks", "OpenRendezvous"]
