"""Where torch.distributed groups of workers meet: addresses, ranks, store key prefixes.

Pure (no Ray; torch only inside `host_link_store`): the coordinator builds
these and hosts the links' store, and the workers join with them
(`kvmesh.worker.dist_group.DistGroup.join`).

Two shapes of group:

- A static group of many workers (`DistRendezvous.for_workers`): ranks in
  sorted id order, rank 0 hosts the rendezvous store. Good for a fixed set
  of processes started together (a benchmark, a test).
- A *link* (`LinkBook`): a group of two, one per ordered pair of workers
  (client rank 0 pulls from and pushes to server rank 1), opened on first use
  through the coordinator, which hosts one store for all links and keys each
  link's rendezvous under its own prefix. Workers come and go; a link only
  involves the two workers it joins, so a dead or restarted worker breaks
  only its own links, and the next use opens a fresh one (a new epoch).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from kvmesh.errors import InvalidInput, TransportError, UnknownWorker
from kvmesh.types import WorkerId

if TYPE_CHECKING:
    from torch.distributed import TCPStore

LINK_CLIENT_RANK = 0
"""A link's rank that pulls and pushes (the worker that asked for the link)."""
LINK_SERVER_RANK = 1
"""A link's rank that serves pulls and takes pushes."""


def assign_ranks(worker_ids: Iterable[WorkerId]) -> dict[WorkerId, int]:
    """Ranks 0..n-1 for the workers in sorted id order (the same set always gets the same ranks).

    Rank 0 hosts the rendezvous store. Raises `InvalidInput` on an empty set
    or a duplicate id.
    """
    ids = list(worker_ids)
    if not ids:
        raise InvalidInput("assign_ranks needs at least one worker id")
    dupes = sorted(w for w, n in Counter(ids).items() if n > 1)
    if dupes:
        raise InvalidInput(f"worker ids must be unique, got duplicates {dupes}")
    return {w: rank for rank, w in enumerate(sorted(ids))}


@dataclass(frozen=True, slots=True)
class DistRendezvous:
    """Where a process group meets and who is which rank: what the coordinator hands out.

    The rendezvous store listens on ``master_addr:master_port``: rank 0 hosts
    it when `store_on_rank0`, else it is already up elsewhere (the
    coordinator's). `prefix` keys this group's rendezvous within a shared store.
    """

    master_addr: str
    master_port: int
    world_size: int
    ranks: Mapping[WorkerId, int] = field(default_factory=dict)
    prefix: str = ""
    store_on_rank0: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise InvalidInput(f"master_port must be in 1..65535, got {self.master_port}")
        if self.world_size < 1:
            raise InvalidInput(f"world_size must be at least 1, got {self.world_size}")
        if self.ranks and sorted(self.ranks.values()) != list(range(self.world_size)):
            raise InvalidInput(
                f"ranks must be exactly 0..{self.world_size - 1}, one per worker, "
                f"got {dict(self.ranks)}"
            )

    @classmethod
    def for_workers(
        cls, worker_ids: Iterable[WorkerId], master_addr: str, master_port: int
    ) -> DistRendezvous:
        """A static group of these workers with ranks from `assign_ranks`; rank 0 hosts the store."""
        ranks = assign_ranks(worker_ids)
        return cls(master_addr, master_port, len(ranks), ranks)

    def rank_of(self, worker_id: WorkerId) -> int:
        try:
            return self.ranks[worker_id]
        except KeyError:
            raise UnknownWorker(
                f"worker {worker_id!r} has no rank in this process group "
                f"(members: {sorted(self.ranks)})"
            ) from None

    def worker_of(self, rank: int) -> WorkerId:
        for worker, r in self.ranks.items():
            if r == rank:
                return worker
        raise UnknownWorker(f"no worker has rank {rank} in this process group")


@dataclass(frozen=True, slots=True)
class LinkEnd:
    """One worker of a link: its id and the incarnation it had when the link was opened."""

    worker_id: WorkerId
    incarnation: str


class LinkBook:
    """Hands out link rendezvous on one shared store; each (client, server) pair counts epochs.

    The prefix names both workers, their incarnations and the epoch, so a
    link opened again (after a failure, or a restart of either side) never
    meets leftovers of an older one in the store. Thread-safe.
    """

    def __init__(self, master_addr: str, master_port: int) -> None:
        self.master_addr = master_addr
        self.master_port = master_port
        self._epochs: dict[tuple[WorkerId, WorkerId], int] = {}
        self._lock = threading.Lock()

    def open(self, client: LinkEnd, server: LinkEnd) -> DistRendezvous:
        """A fresh rendezvous for `client` (rank 0) to reach `server` (rank 1)."""
        if client.worker_id == server.worker_id:
            raise InvalidInput(f"worker {client.worker_id!r} cannot open a link to itself")
        key = (client.worker_id, server.worker_id)
        with self._lock:
            epoch = self._epochs.get(key, 0) + 1
            self._epochs[key] = epoch
        prefix = (
            f"kvmesh/link/{client.worker_id}/{client.incarnation}/"
            f"{server.worker_id}/{server.incarnation}/{epoch}"
        )
        return DistRendezvous(
            self.master_addr,
            self.master_port,
            2,
            {client.worker_id: LINK_CLIENT_RANK, server.worker_id: LINK_SERVER_RANK},
            prefix=prefix,
            store_on_rank0=False,
        )

    def epochs(self) -> dict[tuple[WorkerId, WorkerId], int]:
        """Links opened so far per (client, server) pair."""
        with self._lock:
            return dict(self._epochs)


LINK_STORE_TIMEOUT_S = 30.0
"""How long a wait on the links' store may take (the workers' groups time out alike)."""


def host_link_store(
    host: str, timeout_s: float = LINK_STORE_TIMEOUT_S
) -> tuple[TCPStore, LinkBook]:
    """Start a TCP store on a free port for links to meet at, and the `LinkBook` naming it.

    The coordinator runs one for the whole cluster; keep the returned store
    object alive as long as links may open. torch's store listens on every
    interface; `host` is the address it is advertised at. torch is imported
    here, on first use, so that the rest of this module stays light.
    """
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            host,
            0,
            None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TransportError(f"cannot host the link store on {host}: {first[:300]}") from exc
    return store, LinkBook(host, int(store.port))


__all__ = [
    "LINK_CLIENT_RANK",
    "LINK_SERVER_RANK",
    "LINK_STORE_TIMEOUT_S",
    "DistRendezvous",
    "LinkBook",
    "LinkEnd",
    "assign_ranks",
    "host_link_store",
]
