"""torch.distributed process groups of two: links between workers, timeouts on every wait.

A `DistGroup` is its own process-group object over a prefixed TCP store,
not torch's process-wide default group, so a process can be in many at once.
In a cluster the groups are *links* of two (`kvmesh.rendezvous.LinkBook`):
a worker that pulls from or pushes to a peer asks the coordinator, which
hosts one store for all links (`kvmesh.rendezvous.host_link_store`), hands out the address,
the ranks (puller 0, peer 1) and a fresh key prefix, and asks the peer to
join and serve the link (`kvmesh.worker.links`).

Failures: every wait has a timeout. Any error of the group (rendezvous
timeout, peer gone, send/recv error or timeout) raises `TransportError` and
marks the group broken (gloo closes the connection on a timeout, so a
broken group is never reused); the link is then dropped and the next use
opens a fresh one.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kvmesh.errors import ConfigError, InvalidInput, TransportError
from kvmesh.rendezvous import DistRendezvous
from kvmesh.types import WorkerId

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
"""Registry: the KV store's device type -> the torch.distributed backend that moves its tensors."""

DEFAULT_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- rendezvous


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- process group


def _gloo_group(store: Any, rank: int, size: int, timeout: timedelta, host: str | None) -> Any:
    gloo = dist.ProcessGroupGloo
    if not host:
        return gloo(store, rank, size, timeout)
    options = getattr(gloo, "_Options")()  # noqa: B009 - private in the stubs, public in use
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=host)]  # listen on this address only
    return gloo(store, rank, size, options)


def _nccl_group(store: Any, rank: int, size: int, timeout: timedelta, host: str | None) -> Any:
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise ConfigError("this torch build has no NCCL; install a CUDA build of torch")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, size, options)


GROUP_FACTORIES: dict[str, Callable[[Any, int, int, timedelta, str | None], Any]] = {
    "gloo": _gloo_group,
    "nccl": _nccl_group,
}
"""Registry: backend name -> a process-group object over a store (no default group needed).

Called with (store, rank, size, timeout, host): gloo listens for its peers on
`host` (None: the address the machine's hostname resolves to); NCCL's
bootstrap picks its own interface (``NCCL_SOCKET_IFNAME``)."""


JOINED_KEY = "kvmesh-joined/"


def _all_joined(store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """Return once every rank's group object exists (each says so in the store).

    A backend may finish its side of the connection before the peer has
    finished its own (gloo's full mesh): a rank that closed its group at
    once would then fail the peer's join. Waiting for every rank's mark
    makes `DistGroup.init` return only when the whole group is up.
    """
    store.set(f"{JOINED_KEY}{rank}", b"1")
    store.wait([f"{JOINED_KEY}{r}" for r in range(world_size)], timeout)


class DistGroup:
    """One torch.distributed process group of this process, with timeouts on every send and recv.

    The group is its own process-group object over a (prefixed) TCP store,
    not torch's process-wide default group, so one process can belong to
    many groups at once (a worker has one link per peer) and a failed group
    leaves nothing behind. After any failure it is `broken` (the reason is
    kept) and every later call raises `TransportError` at once.
    """

    __slots__ = (
        "_abandoned",
        "_closed",
        "_pg",
        "_store",
        "backend",
        "broken",
        "device",
        "name",
        "rank",
        "timeout_s",
        "world_size",
    )

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        pg: Any = None,
        store: Any = None,
        name: str = "",
    ) -> None:
        self.name = name  # the rendezvous prefix: names the link's two workers
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self._closed = False
        self._pg = pg
        self._store = store  # the group keeps its store (and a hosted store's server) alive
        # Works of failed operations: their tensors must outlive the backend's use of them.
        self._abandoned: list[Any] = []

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        device: str | torch.device = "cpu",
        prefix: str = "",
        host_store: bool | None = None,
        host: str | None = None,
    ) -> DistGroup:
        """Join the group meeting at the TCP store ``master_addr:master_port`` under `prefix`.

        `host_store` None: rank 0 hosts the store; False: it is up already
        (the coordinator's). `host`: the local address gloo listens on for
        its peers (None: the hostname's). `backend` None picks from `BACKENDS` by the device
        type ("nccl" for cuda, "gloo" for cpu). Raises `TransportError` when
        the rendezvous does not complete within about `timeout_s` (a rank
        missing, the address unreachable), `ConfigError` for impossible arguments.
        """
        dev = torch.device(device)
        if backend is None:
            try:
                backend = BACKENDS[dev.type]
            except KeyError:
                raise ConfigError(
                    f"no torch.distributed backend for device {dev}; choose one of {sorted(BACKENDS)}"
                ) from None
        factory = GROUP_FACTORIES.get(backend)
        if factory is None:
            raise ConfigError(
                f"unknown backend {backend!r}; choose one of {sorted(GROUP_FACTORIES)}"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in 0..{world_size - 1}, got {rank}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if not dist.is_available():
            raise TransportError("torch.distributed is not available in this torch build")
        timeout = timedelta(seconds=timeout_s)
        hosting = rank == 0 if host_store is None else host_store
        try:
            store = dist.TCPStore(
                master_addr,
                master_port,
                world_size if hosting else None,
                is_master=hosting,
                timeout=timeout,
                wait_for_workers=False,
            )
            scoped = dist.PrefixStore(prefix, store) if prefix else store
            pg = factory(scoped, rank, world_size, timeout, host)
            _all_joined(scoped, rank, world_size, timeout)
        except (RuntimeError, ValueError, OSError) as exc:
            raise TransportError(
                f"torch.distributed rendezvous at {master_addr}:{master_port} failed for rank "
                f"{rank}/{world_size} ({backend}) within {timeout_s:g}s: {first_line(exc)}"
            ) from exc
        return cls(rank, world_size, backend, dev, timeout_s, pg, store, prefix)

    @classmethod
    def join(
        cls,
        rendezvous: DistRendezvous,
        worker_id: WorkerId,
        *,
        device: str | torch.device = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: str | None = None,
    ) -> DistGroup:
        """`init` with this worker's rank and the store/prefix from a coordinator's rendezvous."""
        return cls.init(
            rendezvous.rank_of(worker_id),
            rendezvous.world_size,
            rendezvous.master_addr,
            rendezvous.master_port,
            timeout_s=timeout_s,
            device=device,
            prefix=rendezvous.prefix,
            host_store=None if rendezvous.store_on_rank0 else False,
            host=host,
        )

    # -- point to point ----------------------------------------------------

    def _check_usable(self, peer: int) -> None:
        if self._closed:
            raise TransportError("the torch.distributed group is closed")
        if self.broken is not None:
            raise TransportError(f"the torch.distributed group is broken: {self.broken}")
        if self._pg is None:
            raise TransportError("the torch.distributed group was never joined")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise InvalidInput(
                f"peer rank must be another rank in 0..{self.world_size - 1}, got {peer} "
                f"(this is rank {self.rank})"
            )

    def isend(self, tensor: Tensor, dst: int, tag: int) -> Any:
        """Start sending `tensor` to `dst`; `wait` on the returned work."""
        self._check_usable(dst)
        try:
            return self._pg.send([tensor], dst, tag)
        except RuntimeError as exc:
            raise self.fail(f"send to rank {dst} failed", exc) from exc

    def irecv(self, tensor: Tensor, src: int | None, tag: int) -> Any:
        """Start receiving into `tensor` from `src` (None: any rank, gloo only)."""
        if src is None:
            if self.backend == "nccl":
                raise ConfigError("receiving from any rank needs gloo; NCCL needs a source rank")
            self._check_usable((self.rank + 1) % max(self.world_size, 2))
        else:
            self._check_usable(src)
        try:
            if src is None:
                return self._pg.recv_anysource([tensor], tag)
            return self._pg.recv([tensor], src, tag)
        except RuntimeError as exc:
            raise self.fail(f"recv from rank {src} failed", exc) from exc

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for one work; a timeout or error breaks the group and raises `TransportError`."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(timeout=timedelta(seconds=limit))
        except RuntimeError as exc:
            self._abandoned.append(work)
            raise self.fail(f"{what} failed (limit {limit:g}s)", exc) from exc

    def send(self, tensor: Tensor, dst: int, tag: int, timeout_s: float | None = None) -> None:
        self.wait(self.isend(tensor, dst, tag), f"send to rank {dst}", timeout_s)

    def recv(
        self, tensor: Tensor, src: int | None, tag: int, timeout_s: float | None = None
    ) -> int:
        """Receive into `tensor`; returns the sending rank."""
        work = self.irecv(tensor, src, tag)
        self.wait(work, f"recv from rank {'any' if src is None else src}", timeout_s)
        return int(work._source_rank()) if src is None else src

    def fail(self, what: str, exc: BaseException) -> TransportError:
        """Mark the group broken by `exc` and return the `TransportError` to raise."""
        self.mark_broken(f"{what}: {first_line(exc)}")
        return TransportError(f"torch.distributed {what}: {first_line(exc)}")

    def mark_broken(self, reason: str) -> None:
        """No later call may use the group (the first reason is kept)."""
        if self.broken is None:
            self.broken = reason

    @property
    def usable(self) -> bool:
        """Joined, not closed, not broken."""
        return self._pg is not None and not self._closed and self.broken is None

    def close(self) -> None:
        """Leave the group (idempotent). Safe on a broken group.

        Operations still posted are not cancelled (gloo cannot); their
        tensors are kept until this object goes.
        """
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError as exc:  # a broken group may fail to tear down cleanly
                log.warning("torch.distributed group teardown: %s", first_line(exc))

    def __enter__(self) -> DistGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "GROUP_FACTORIES",
    "DistGroup",
    "first_line",
    "free_port",
]
