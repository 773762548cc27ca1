"""Page transfer over torch.distributed: batched send/recv of page tensors.

Workers of one process group move pages as raw tensors with point-to-point
send/recv: NCCL when the KV store is on CUDA, gloo on CPU, the same code.
A `DistGroup` is its own process-group object over a prefixed TCP store,
not torch's process-wide default group, so a process can be in many at once.
In a cluster the groups are *links* of two (`kvmesh.rendezvous.LinkBook`):
a worker that pulls from or pushes to a peer asks the coordinator, which
hosts one store for all links (`host_link_store`), hands out the address,
the ranks (puller 0, peer 1) and a fresh key prefix, and asks the peer to
join and serve the link; a broken link is dropped and the next use opens a
new one, while the transfer at hand falls back to gRPC
(`fetch_with_fallback`). One transfer of ``n`` pages between two ranks::

    preamble  int64[16]      magic, version, kind, count, dtype code, ndim,
                             shape[6], meta bytes, largest batch, layout, 0
    meta      uint8[...]     msgpack [[hash, parent, tokens, lora, tier] per page,
                             [missing hashes], [pages per batch]]
    for each batch of k pages (at most `batch_bytes`):
      checksums int64[k]     xxh3-64 of each page's bytes (from `PageService.export`)
      payload                Layout.BATCH: uint8[k * page bytes], one contiguous tensor
                             Layout.PAGES: k tensors of one page each

`Layout.BATCH` (small pages): a batch is a run of consecutive page ids sent
in place from the KV tensor, or scattered pages gathered into a reused
buffer with one `index_select` (`plan_batches`); the receiver takes it into
a buffer and checks and inserts each page with `PageService.insert`.
`Layout.PAGES` (pages of at least 1 MiB, where one message per page costs
nothing): each page goes from the sender's KV tensor straight into a page
the receiver reserved in its pool, is checked there with
`PageService.check` and cached only if it passed, so no byte is copied
outside the socket. Copies bound the speed on loopback, so each pass over
the bytes counts (see `kvmesh bench transfer`).

Every size the receiver posts follows from the meta, so it posts the next
batches (two buffers, or `depth` batches of reserved pages) before it
checks the current one, and the sender checksums batch ``i + 1`` while
batch ``i`` is on the wire. Either way a page enters the pool only after
the same checks as the gRPC path (dtype, shape, size, checksum and, with
token ids, the hash chain); a page that fails is dropped and reported, the
others are inserted.

Pull and push share that framing. A pull sends a REQUEST (the hashes, in
the meta) to the peer's serving loop (`serve_forever`) on `SERVE_TAG`; the
answer comes back on `REPLY_TAG`. A push sends the pages straight to the
peer's serving loop, which acknowledges (ACK on `REPLY_TAG`: pages it now
holds, pages it refused) once they are checked and cached, so the pusher
returns only when the receiver can serve from them. A client serialises its own calls per peer, so a tag
never carries two transfers between the same two ranks at once (gloo matches
messages by source and tag, in order; NCCL has no tags, so on NCCL a pair of
ranks must not pull from each other at the same moment).

Failures: every wait has a timeout. Any error of the group (rendezvous
timeout, peer gone, send/recv error or timeout, a garbled preamble) raises
`TransportError` and marks the group broken (gloo closes the connection on a
timeout, so a broken group is never reused); callers then fall back to gRPC
(`fetch_with_fallback`). Pages a failed pull had already checked and inserted
stay (they are valid); the rest are not inserted, and pages reserved for
them go back to the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    ConfigError,
    InvalidInput,
    KVMeshError,
    PermissionDenied,
    TransportError,
)
from kvmesh.rendezvous import DistRendezvous, LinkBook, assign_ranks
from kvmesh.types import PageHash, PageId, WorkerId
from kvmesh.worker.kv_store import DTYPES, PageBlob
from kvmesh.worker.page_service import (
    MAX_HASH_BYTES,
    NO_PROOFS,
    IncomingPage,
    PageInfo,
    PageReceiver,
    PageService,
    ProofBook,
    Reservation,
    check_hash,
)

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
"""Registry: the KV store's device type -> the torch.distributed backend that moves its tensors."""

DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "float8_e4m3fn": 5,
    "float8_e5m2": 6,
    "int8": 7,
    "uint8": 8,
}
"""Wire codes of the KV dtypes (`kvmesh.worker.kv_store.DTYPES` names); never renumber."""

_DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}

MAGIC = 0x6B766D657368  # "kvmesh"
VERSION = 3
PREAMBLE_WORDS = 16
MAX_NDIM = 6
SERVE_TAG = 1
"""Tag of messages to a rank's serving loop: requests, pushed pages, hang-ups."""
REPLY_TAG = 2
"""Tag of the pages that answer a pull."""

MAX_META_BYTES = 64 * 1024 * 1024
MAX_PAGES_PER_TRANSFER = 1 << 20
DEFAULT_BATCH_BYTES = 64 * 1024 * 1024
MIN_IN_PLACE_BYTES = 1024 * 1024
"""A run of consecutive pages at least this big is sent in place instead of gathered."""
PAGE_MESSAGE_BYTES = 1024 * 1024
"""Pages at least this big travel one message each, received in place (`Layout.PAGES`)."""
DEFAULT_DEPTH = 4
"""Batches in flight per `Layout.PAGES` transfer (sent ahead, received ahead)."""
DEFAULT_MAX_BATCH_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 30.0


class Kind:
    """What a transfer's preamble announces."""

    PAGES = 1
    REQUEST = 2
    BYE = 3
    ACK = 4
    """After a push: how many of the pushed pages the receiver now holds (`count`) and
    how many it refused (`batch_pages`)."""


class Layout:
    """How a PAGES transfer's payload travels, batch by batch (after its checksums)."""

    BATCH = 0
    """One contiguous tensor per batch: a run in place or pages gathered; received into a
    buffer, then checked and inserted through `PageService.insert`."""
    PAGES = 1
    """One tensor per page, straight from the sender's KV tensor into pages the receiver
    reserved in its pool, checked there (`PageService.check`) and cached: no copy on either
    side. Used for pages of at least `page_message_bytes`."""


# --------------------------------------------------------------------------- rendezvous


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_link_store(host: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Any, LinkBook]:
    """Start a TCP store on a free port for links to meet at, and the `LinkBook` naming it.

    The coordinator runs one for the whole cluster; keep the returned store
    object alive as long as links may open. torch's store listens on every
    interface; `host` is the address it is advertised at.
    """
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
        raise TransportError(f"cannot host the link store on {host}: {_first_line(exc)}") from exc
    return store, LinkBook(host, int(store.port))


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
        except (RuntimeError, ValueError, OSError) as exc:
            raise TransportError(
                f"torch.distributed rendezvous at {master_addr}:{master_port} failed for rank "
                f"{rank}/{world_size} ({backend}) within {timeout_s:g}s: {_first_line(exc)}"
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
        self.mark_broken(f"{what}: {_first_line(exc)}")
        return TransportError(f"torch.distributed {what}: {_first_line(exc)}")

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
                log.warning("torch.distributed group teardown: %s", _first_line(exc))

    def __enter__(self) -> DistGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# --------------------------------------------------------------------------- wire format


@dataclass(frozen=True, slots=True)
class Preamble:
    """The fixed-size head of every transfer (one int64[16] tensor)."""

    kind: int
    count: int = 0
    dtype_code: int = 0
    shape: tuple[int, ...] = ()
    meta_nbytes: int = 0
    batch_pages: int = 0
    layout: int = 0

    def encode(self) -> Tensor:
        if len(self.shape) > MAX_NDIM:
            raise InvalidInput(f"page shape has {len(self.shape)} dims, at most {MAX_NDIM}")
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        words = [MAGIC, VERSION, self.kind, self.count, self.dtype_code, len(self.shape)]
        words += [*shape, self.meta_nbytes, self.batch_pages, self.layout, 0]
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def decode(cls, t: Tensor, *, max_batch_bytes: int) -> Preamble:
        """Parse and bound a received preamble; `TransportError` on anything off.

        A bad preamble means the stream is out of step or garbled: nothing
        after it can be trusted, so it is a transport failure, not a page one.
        """
        w = [int(x) for x in t.cpu().tolist()]
        if len(w) != PREAMBLE_WORDS or w[0] != MAGIC or w[1] != VERSION:
            raise TransportError(
                f"not a kvmesh v{VERSION} transfer preamble (magic/version {w[:2]}); "
                "the peer runs another version or the stream is out of step"
            )
        kind, count, code, ndim = w[2], w[3], w[4], w[5]
        shape = tuple(w[6 : 6 + ndim]) if 0 <= ndim <= MAX_NDIM else ()
        meta_nbytes, batch_pages, layout = w[12], w[13], w[14]
        pre = cls(kind, count, code, shape, meta_nbytes, batch_pages, layout)
        problems: list[str] = []
        if kind not in (Kind.PAGES, Kind.REQUEST, Kind.BYE, Kind.ACK):
            problems.append(f"unknown kind {kind}")
        if layout not in (Layout.BATCH, Layout.PAGES):
            problems.append(f"unknown payload layout {layout}")
        if not 0 <= count <= MAX_PAGES_PER_TRANSFER:
            problems.append(f"count {count} outside 0..{MAX_PAGES_PER_TRANSFER}")
        if not 0 <= meta_nbytes <= MAX_META_BYTES:
            problems.append(f"meta size {meta_nbytes} outside 0..{MAX_META_BYTES}")
        if kind == Kind.PAGES and count:
            if code not in _DTYPE_NAMES:
                problems.append(f"unknown dtype code {code}")
            if not 0 < ndim <= MAX_NDIM or any(d <= 0 for d in shape):
                problems.append(f"bad page shape (ndim {ndim}, {list(shape)})")
            elif batch_pages <= 0 or (
                code in _DTYPE_NAMES and batch_pages * pre.page_nbytes > max_batch_bytes
            ):
                problems.append(
                    f"batch of {batch_pages} pages exceeds this receiver's {max_batch_bytes} bytes"
                )
        if problems:
            raise TransportError("refused transfer preamble: " + "; ".join(problems))
        return pre

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype_code]

    @property
    def page_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype_name].itemsize


@dataclass(frozen=True, slots=True)
class WirePage:
    """What the meta says about one page (everything but its bytes and checksum)."""

    page_hash: PageHash
    parent_hash: PageHash | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    tier: str


def encode_page_meta(
    pages: Sequence[WirePage],
    missing: Sequence[PageHash],
    batch_counts: Sequence[int],
    ticket: bytes = b"",
) -> bytes:
    """The meta of a PAGES transfer; a push carries the receiver's grant `ticket`."""
    rows = [
        [
            p.page_hash,
            p.parent_hash,
            np.asarray(p.token_ids, dtype="<u4").tobytes(),
            p.lora_id,
            p.tier,
        ]
        for p in pages
    ]
    meta = [rows, list(missing), list(batch_counts), bytes(ticket)]
    return bytes(msgpack.packb(meta, use_bin_type=True))


def decode_page_meta(
    raw: bytes, count: int, max_batch_pages: int
) -> tuple[list[WirePage], list[PageHash], list[int], bytes]:
    """Pages, missing hashes, pages per batch and push ticket from a PAGES meta;
    `InvalidInput` if malformed."""
    try:
        rows, missing, counts, ticket = msgpack.unpackb(raw, raw=False, use_list=True)
        if not isinstance(ticket, bytes) or len(ticket) > 64:
            raise TypeError("push ticket")
        pages = []
        for page_hash, parent, tokens, lora, tier in rows:
            if lora is not None and not isinstance(lora, int):
                raise TypeError(f"lora id {lora!r}")
            if not isinstance(tier, str) or not isinstance(tokens, bytes) or len(tokens) % 4:
                raise TypeError("tier or token ids")
            pages.append(
                WirePage(
                    check_hash(page_hash),
                    None if parent is None else check_hash(parent, "parent hash"),
                    tuple(np.frombuffer(tokens, dtype="<u4").tolist()),
                    lora,
                    tier,
                )
            )
        gone = [check_hash(h) for h in missing]
        if not all(isinstance(c, int) and 0 < c <= max_batch_pages for c in counts):
            raise ValueError(f"batch sizes must be 1..{max_batch_pages} pages")
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise InvalidInput(f"malformed page meta in a transfer: {exc}") from exc
    if len(pages) != count or sum(counts) != count:
        raise InvalidInput(
            f"transfer meta lists {len(pages)} pages in batches of {sum(counts)}, "
            f"its preamble {count}"
        )
    return pages, gone, counts, ticket


def plan_batches(
    page_ids: Sequence[int], batch_pages: int, min_run_pages: int
) -> list[tuple[int, int, bool]]:
    """Split pages (in send order) into batches: (first position, count, in place).

    A run of at least `min_run_pages` consecutive page ids goes in place (a
    slice of the KV tensor, no copy), cut every `batch_pages`; shorter runs
    are packed together into gathered batches of up to `batch_pages`. Order
    is kept. O(len(page_ids)).
    """
    if batch_pages <= 0 or min_run_pages <= 0:
        raise InvalidInput(
            f"batch_pages and min_run_pages must be positive, got {batch_pages}, {min_run_pages}"
        )
    out: list[tuple[int, int, bool]] = []
    gather_first, gather_count = 0, 0

    def flush() -> None:
        nonlocal gather_count
        if gather_count:
            out.append((gather_first, gather_count, False))
            gather_count = 0

    n, start = len(page_ids), 0
    while start < n:
        end = start + 1
        while end < n and page_ids[end] == page_ids[end - 1] + 1:
            end += 1
        if end - start >= min_run_pages:
            flush()
            for first in range(start, end, batch_pages):
                out.append((first, min(batch_pages, end - first), True))
        else:
            for pos in range(start, end):
                if gather_count == 0:
                    gather_first = pos
                gather_count += 1
                if gather_count == batch_pages:
                    flush()
        start = end
    flush()
    return out


def encode_request(hashes: Sequence[PageHash]) -> bytes:
    return bytes(msgpack.packb(list(hashes), use_bin_type=True))


def decode_request(raw: bytes, count: int) -> list[PageHash]:
    try:
        hashes = [check_hash(h) for h in msgpack.unpackb(raw, raw=False)]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise InvalidInput(f"malformed page request: {exc}") from exc
    if len(hashes) != count:
        raise InvalidInput(f"request lists {len(hashes)} hashes, its preamble {count}")
    return hashes


def _u64_to_i64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64).view(np.int64)


# --------------------------------------------------------------------------- transfers


@dataclass(frozen=True, slots=True)
class SendResult:
    """What a sender moved: pages sent in order, and the hashes it did not hold."""

    sent: tuple[PageHash, ...]
    missing: tuple[PageHash, ...]
    nbytes: int
    stored: int | None = None
    """A push's acknowledgement: pages of `sent` the receiver holds now (None: not a push)."""
    refused: int = 0
    """A push's acknowledgement: pages of `sent` the receiver refused (failed a check)."""


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """What a receiver made of a transfer.

    `inserted`: new pages now cached; `present`: received but already held
    (skipped, never overwritten); `missing`: the sender did not hold them;
    `rejected`: failed a check (hash, reason), nothing of them entered the pool.
    """

    inserted: tuple[PageHash, ...] = ()
    present: tuple[PageHash, ...] = ()
    missing: tuple[PageHash, ...] = ()
    rejected: tuple[tuple[PageHash, str], ...] = ()
    nbytes: int = 0

    @property
    def cached(self) -> tuple[PageHash, ...]:
        """Received pages the receiver now holds (new or already there)."""
        return self.inserted + self.present


class _Buffers:
    """Two reusable byte buffers: the batch being received/sent and the next one.

    Reusing them keeps a transfer off fresh memory (first-touch page faults
    cost as much as the copy itself).
    """

    __slots__ = ("_bufs", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: list[Tensor] = [torch.empty(0, dtype=torch.uint8, device=device)] * 2

    def get(self, slot: int, nbytes: int) -> Tensor:
        buf = self._bufs[slot]
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._bufs[slot] = buf
        return buf[:nbytes]


class DistPageTransport:
    """Pull, push and serve pages over a `DistGroup`, checked by a `PageService`.

    `batch_bytes` bounds one payload tensor (the sender picks it, the
    receiver refuses batches over `max_batch_bytes`); two of each are kept
    per direction for overlap. Runs of consecutive pages of at least
    `min_in_place_bytes` are sent straight from the KV tensor (a huge value
    gathers every batch); pages of at least `page_message_bytes` go one
    message each into reserved pages (`Layout.PAGES`; a huge value turns it
    off), with `depth` batches in flight. `timeout_s` bounds every wait of a
    transfer.
    """

    def __init__(
        self,
        group: DistGroup,
        service: PageService,
        *,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        min_in_place_bytes: int = MIN_IN_PLACE_BYTES,
        page_message_bytes: int = PAGE_MESSAGE_BYTES,
        depth: int = DEFAULT_DEPTH,
        timeout_s: float | None = None,
    ) -> None:
        store = service.store
        if store.device.type != group.device.type:
            raise ConfigError(
                f"KV store is on {store.device} but the process group ({group.backend}) moves "
                f"{group.device} tensors; join the group with device={store.device.type!r}"
            )
        if depth < 2:
            raise ConfigError(f"depth must be at least 2 batches in flight, got {depth}")
        if batch_bytes <= 0 or max_batch_bytes < batch_bytes:
            raise ConfigError(
                f"need 0 < batch_bytes <= max_batch_bytes, got {batch_bytes}, {max_batch_bytes}"
            )
        self.group = group
        self.service = service
        self.batch_bytes = batch_bytes
        self.max_batch_bytes = max_batch_bytes
        self.min_in_place_bytes = min_in_place_bytes
        self.page_message_bytes = page_message_bytes
        self.depth = depth
        self.timeout_s = group.timeout_s if timeout_s is None else timeout_s
        self._peer_locks: dict[int, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._send_bufs = _Buffers(store.device)
        self._recv_bufs = _Buffers(store.device)
        self._send_guard = threading.Lock()
        self._recv_guard = threading.Lock()

    @classmethod
    def from_config(
        cls, group: DistGroup, service: PageService, config: TransferConfig
    ) -> DistPageTransport:
        """A transport with `TransferConfig`'s ``dist_*`` settings."""
        return cls(
            group,
            service,
            batch_bytes=config.dist_batch_bytes,
            max_batch_bytes=max(DEFAULT_MAX_BATCH_BYTES, config.dist_batch_bytes),
            depth=config.dist_depth,
            timeout_s=config.dist_timeout_s,
        )

    # -- public calls ------------------------------------------------------

    def pull(self, src: int, hashes: Sequence[PageHash], proofs: ProofBook) -> ReceiveResult:
        """Fetch `hashes` from rank `src`'s serving loop and insert them here (checked and
        proven against `proofs`, the book of the request being served).

        Raises `TransportError` when the group fails; pages checked and
        inserted before the failure stay.
        """
        if len(hashes) > MAX_PAGES_PER_TRANSFER:
            raise InvalidInput(
                f"a pull asks for at most {MAX_PAGES_PER_TRANSFER} pages, got {len(hashes)}; "
                "split it"
            )
        request = encode_request([check_hash(h) for h in hashes])
        with self._peer_lock(src):
            self._send_small(src, SERVE_TAG, Preamble(Kind.REQUEST, len(hashes)), request)
            return self._receive_pages(src, REPLY_TAG, None, self.service.receiving(proofs))

    def push(self, dst: int, hashes: Sequence[PageHash], ticket: bytes) -> SendResult:
        """Send the pages for `hashes` (those held here) to rank `dst`'s serving loop, under
        the push grant `ticket` the receiver handed out for them.

        Returns once the receiver has checked and cached them and said so (its
        ack fills `stored` / `refused`), so the receiver can serve from them
        at once. Raises `TransportError` when the group fails.
        """
        with self._peer_lock(dst):
            sent = self._send_pages(dst, SERVE_TAG, [check_hash(h) for h in hashes], ticket)
            ack, _ = self._recv_preamble(dst, REPLY_TAG, self.timeout_s)
            if ack.kind != Kind.ACK:
                raise self._protocol_error(
                    f"expected rank {dst} to acknowledge a push, got kind {ack.kind}"
                )
            return dataclasses.replace(sent, stored=ack.count, refused=ack.batch_pages)

    def hang_up(self, dst: int) -> None:
        """Tell rank `dst`'s serving loop to return."""
        with self._peer_lock(dst):
            self._send_small(dst, SERVE_TAG, Preamble(Kind.BYE), b"")

    def receive_push(self, src: int) -> ReceiveResult:
        """Receive one push from rank `src` (outside a serving loop)."""
        pre, _ = self._recv_preamble(src, SERVE_TAG, self.timeout_s)
        if pre.kind != Kind.PAGES:
            raise self._protocol_error(
                f"expected pushed pages from rank {src}, got kind {pre.kind}"
            )
        return self._take_push(src, pre)

    def _take_push(self, src: int, pre: Preamble) -> ReceiveResult:
        """Receive a push and acknowledge it (pages held now, pages refused)."""
        result = self._receive_pages(src, SERVE_TAG, pre, None)
        ack = Preamble(Kind.ACK, len(result.cached), batch_pages=len(result.rejected))
        self._send_small(src, REPLY_TAG, ack, b"")
        return result

    def serve_forever(
        self,
        src: int | None = None,
        *,
        idle_timeout_s: float = 3600.0,
        on_push: Callable[[int, ReceiveResult], None] | None = None,
    ) -> int:
        """Answer pulls and take pushes from `src` (None: any rank, gloo only) until a hang-up.

        Returns the number of requests and pushes handled. Raises
        `TransportError` when the group fails or nothing arrives for
        `idle_timeout_s` (gloo cannot cancel a posted receive, so an idle
        timeout also breaks the group). A bad request is logged and skipped.
        """
        handled = 0
        while True:
            pre, peer = self._recv_preamble(src, SERVE_TAG, idle_timeout_s)
            if pre.kind == Kind.BYE:
                return handled
            if pre.kind == Kind.REQUEST:
                raw = self._recv_meta(peer, SERVE_TAG, pre.meta_nbytes)
                try:
                    hashes = decode_request(raw, pre.count)
                except InvalidInput as exc:
                    log.warning("rank %d sent a bad page request: %s", peer, exc)
                    hashes = []
                self._send_pages(peer, REPLY_TAG, hashes)
            elif pre.kind == Kind.PAGES:
                result = self._take_push(peer, pre)
                if on_push is not None:
                    on_push(peer, result)
            else:
                raise self._protocol_error(f"rank {peer} sent kind {pre.kind} to a serving loop")
            handled += 1

    # -- sending -----------------------------------------------------------

    def _send_small(self, dst: int, tag: int, pre: Preamble, meta: bytes) -> None:
        pre = dataclasses.replace(pre, meta_nbytes=len(meta))
        self.group.send(self._dev(pre.encode()), dst, tag, self.timeout_s)
        if meta:
            payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
            self.group.send(self._dev(payload), dst, tag, self.timeout_s)

    def _send_pages(
        self, dst: int, tag: int, hashes: Sequence[PageHash], ticket: bytes = b""
    ) -> SendResult:
        service, store = self.service, self.service.store
        with service.pinned(hashes) as ids:
            held: list[tuple[PageHash, PageId]] = []
            wire: list[WirePage] = []
            gone: list[PageHash] = []
            for h, pid in zip(hashes, ids, strict=True):
                info = self._info(pid, h)
                if pid is None or info is None:
                    gone.append(h)
                    continue
                held.append((h, pid))
                wire.append(
                    WirePage(
                        info.page_hash, info.parent_hash, info.token_ids, info.lora_id, info.tier
                    )
                )
            missing = tuple(gone)
            page_ids: list[PageId] = [pid for _, pid in held]
            batch_pages = max(1, self.batch_bytes // store.page_nbytes)
            layout = Layout.PAGES if store.page_nbytes >= self.page_message_bytes else Layout.BATCH
            if layout == Layout.PAGES:  # every page goes in place: plain batches in order
                plan = plan_batches(page_ids, batch_pages, 1 << 62)
            else:
                in_place = max(1, -(-self.min_in_place_bytes // store.page_nbytes))
                plan = plan_batches(page_ids, batch_pages, in_place)
            counts = [count for _, count, _ in plan]
            pre = Preamble(
                Kind.PAGES,
                len(held),
                DTYPE_CODES[store.dtype_name],
                store.page_shape,
                batch_pages=max(counts, default=0),
                layout=layout,
            )
            self._send_small(dst, tag, pre, encode_page_meta(wire, missing, counts, ticket))
            with self._send_guard:
                if layout == Layout.PAGES:
                    nbytes = self._send_page_messages(dst, tag, plan, page_ids)
                else:
                    nbytes = self._send_batches(dst, tag, plan, page_ids)
            # The pins end only when the peer has every byte: sends are waited on above.
        return SendResult(tuple(h for h, _ in held), missing, nbytes)

    def _info(self, page_id: PageId | None, page_hash: PageHash) -> PageInfo | None:
        """What the meta says of a pinned page; None if its hash was evicted meanwhile."""
        if page_id is None:
            return None
        try:
            info = self.service.page_info(page_id)
        except InvalidInput:
            return None
        return info if info.page_hash == page_hash else None

    def _send_batches(
        self, dst: int, tag: int, plan: list[tuple[int, int, bool]], page_ids: list[PageId]
    ) -> int:
        group = self.group
        pending: list[list[Any]] = [[], []]
        nbytes = 0
        with self._sending_to(dst):
            for n, (first, count, in_place) in enumerate(plan):
                slot = n % 2
                self._wait_sends(pending[slot], dst)  # this buffer's previous batch must be out
                sums, buf = self._stage_batch(slot, page_ids[first : first + count], in_place)
                pending[slot] = [group.isend(sums, dst, tag), group.isend(buf, dst, tag)]
                nbytes += buf.numel()
            for works in pending:
                self._wait_sends(works, dst)
        return nbytes

    def _send_page_messages(
        self, dst: int, tag: int, plan: list[tuple[int, int, bool]], page_ids: list[PageId]
    ) -> int:
        """`Layout.PAGES`: per batch, its checksums then each page from the KV tensor."""
        group, rows = self.group, self._page_rows()
        pending: deque[list[Any]] = deque()
        nbytes = 0
        with self._sending_to(dst):
            for first, count, _ in plan:
                while len(pending) >= self.depth:  # at most `depth` batches queued
                    self._wait_sends(pending.popleft(), dst)
                ids = page_ids[first : first + count]
                works = [group.isend(self._checksums(ids), dst, tag)]
                works += [group.isend(rows[pid], dst, tag) for pid in ids]
                pending.append(works)
                nbytes += count * self.service.store.page_nbytes
            for works in pending:
                self._wait_sends(works, dst)
        return nbytes

    def _wait_sends(self, works: Iterable[Any], dst: int) -> None:
        """Wait for page-batch sends to `dst`, in order; `TransportError` on timeout."""
        for work in works:
            self.group.wait(work, f"send of a page batch to rank {dst}", self.timeout_s)

    @contextlib.contextmanager
    def _sending_to(self, dst: int) -> Iterator[None]:
        """Around page-batch sends: a gloo `RuntimeError` breaks the group (`TransportError`)."""
        try:
            yield
        except TransportError:
            raise
        except RuntimeError as exc:
            raise self.group.fail(f"page batch to rank {dst} failed", exc) from exc

    def _checksums(self, page_ids: Sequence[PageId]) -> Tensor:
        """int64 checksums of pinned pages, from `PageService.export` (as the gRPC path sends)."""
        export = self.service.export
        return self._dev(torch.from_numpy(_u64_to_i64([export(pid).checksum for pid in page_ids])))

    def _page_rows(self) -> Tensor:
        """The KV tensor as bytes, one row per page (a view)."""
        store = self.service.store
        return store.kv.view(store.num_pages, -1).view(torch.uint8)

    def _stage_batch(
        self, slot: int, page_ids: Sequence[PageId], in_place: bool
    ) -> tuple[Tensor, Tensor]:
        """The checksums (int64[n]) and bytes of pinned pages, ready to send.

        In place: a slice of the KV tensor (the ids are consecutive). Else one
        `index_select` into the reused send buffer `slot`. The checksums come
        from `PageService.export`, the same blobs the gRPC path sends.
        """
        store = self.service.store
        n = len(page_ids)
        if in_place:
            buf = store.kv[page_ids[0] : page_ids[0] + n].reshape(-1).view(torch.uint8)
        else:
            buf = self._send_bufs.get(slot, n * store.page_nbytes)
            rows = store.kv.view(store.num_pages, -1)
            index = torch.as_tensor(page_ids, dtype=torch.long, device=store.kv.device)
            torch.index_select(rows, 0, index, out=buf.view(store.dtype).view(n, -1))
        return self._checksums(page_ids), buf

    # -- receiving ---------------------------------------------------------

    def _recv_preamble(self, src: int | None, tag: int, timeout_s: float) -> tuple[Preamble, int]:
        """The next preamble on `tag` and the rank that sent it."""
        t = torch.empty(PREAMBLE_WORDS, dtype=torch.int64, device=self.group.device)
        sender = self.group.recv(t, src, tag, timeout_s)
        try:
            return Preamble.decode(t, max_batch_bytes=self.max_batch_bytes), sender
        except TransportError as exc:
            self.group.mark_broken(str(exc))
            raise

    def _recv_meta(self, src: int, tag: int, nbytes: int) -> bytes:
        if nbytes == 0:
            return b""
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        self.group.recv(t, src, tag, self.timeout_s)
        return t.cpu().numpy().tobytes()

    def _receive_pages(
        self, src: int, tag: int, pre: Preamble | None, receiver: PageReceiver | None
    ) -> ReceiveResult:
        """Receive one PAGES transfer into `receiver` (None: a push, received against the
        grant its ticket names; without one every page is received and refused)."""
        if pre is None:
            pre, _ = self._recv_preamble(src, tag, self.timeout_s)
        if pre.kind != Kind.PAGES:
            raise self._protocol_error(f"expected pages from rank {src}, got kind {pre.kind}")
        raw = self._recv_meta(src, tag, pre.meta_nbytes)
        try:
            pages, missing, counts, ticket = decode_page_meta(raw, pre.count, pre.batch_pages)
        except InvalidInput as exc:
            # The payload that follows cannot be matched to hashes: the stream is lost.
            raise self._protocol_error(str(exc)) from exc
        if receiver is None:
            try:
                receiver = self.service.receiving_push(ticket, f"dist:{self.group.name}:{src}")
            except PermissionDenied as exc:
                # The bytes still follow: take them into spare rows and refuse every page.
                log.warning("push from rank %d refused: %s", src, exc)
                receiver = self.service.receiving(NO_PROOFS)
        with self._recv_guard:
            return self._receive_batches(src, tag, pre, pages, tuple(missing), counts, receiver)

    def _receive_batches(
        self,
        src: int,
        tag: int,
        pre: Preamble,
        pages: list[WirePage],
        missing: tuple[PageHash, ...],
        counts: list[int],
        receiver: PageReceiver,
    ) -> ReceiveResult:
        group = self.group
        firsts = np.cumsum([0, *counts]).tolist()
        batches = list(zip(firsts, counts, strict=False))
        outcome = _Outcome()
        posted: dict[int, _Posted] = {}
        rows = self._page_rows() if pre.layout == Layout.PAGES else None

        # Batches posted ahead: two buffers when batches land in buffers, `depth` when they
        # land in reserved pages (a page already held, or a duplicate, lands in a spare row).
        ahead = 2 if rows is None else self.depth

        def post(n: int) -> None:
            first, count = batches[n]
            sums = torch.empty(count, dtype=torch.int64, device=group.device)
            if rows is None:
                buf = self._recv_bufs.get(n % 2, count * pre.page_nbytes)
                posted[n] = _Posted([], sums, [buf], [])
            else:
                slots = receiver.reserve([p.page_hash for p in pages[first : first + count]])
                spares = sum(slot is None for slot in slots)
                spare = torch.empty(
                    (spares, pre.page_nbytes), dtype=torch.uint8, device=group.device
                )
                targets, k = [], 0
                for slot in slots:
                    if slot is None:
                        targets.append(spare[k])
                        k += 1
                    else:
                        targets.append(rows[slot.page_id])
                posted[n] = _Posted([], sums, targets, slots)
            # Registered before posting: an error below must release the reserved pages.
            posted[n].works.append(group.irecv(sums, src, tag))
            posted[n].works += [group.irecv(t, src, tag) for t in posted[n].targets]

        transport_failed = False
        next_post = 0
        try:
            for n, (first, count) in enumerate(batches):
                while next_post < min(n + ahead, len(batches)):
                    post(next_post)  # later batches land while this one is checked
                    next_post += 1
                batch = posted[n]
                try:
                    for work in batch.works:
                        group.wait(work, f"page batch from rank {src}", self.timeout_s)
                except TransportError as exc:
                    transport_failed = True
                    done = len(outcome.inserted) + len(outcome.present)
                    raise TransportError(
                        f"{exc}; {done} of {pre.count} pages had been received, checked and "
                        "cached (they are valid), the rest were not inserted"
                    ) from exc
                batch.works = []
                if rows is None:
                    self._insert_batch(
                        pre,
                        pages[first : first + count],
                        batch.sums,
                        batch.targets[0],
                        outcome,
                        receiver,
                    )
                else:
                    self._commit_batch(
                        pre, pages[first : first + count], batch, outcome, receiver
                    )
                del posted[n]
        finally:
            self._release(posted, transport_failed)
        return ReceiveResult(
            tuple(outcome.inserted),
            tuple(outcome.present),
            missing,
            tuple(outcome.rejected),
            pre.count * pre.page_nbytes,
        )

    def _commit_batch(
        self,
        pre: Preamble,
        batch: Sequence[WirePage],
        posted: _Posted,
        outcome: _Outcome,
        receiver: PageReceiver,
    ) -> None:
        """Check each received page where it landed; cache the good ones, release the rest.

        The checks are `PageService.check` (the same as `insert` and the gRPC
        path run); a reserved page is cached only after its bytes passed.
        """
        checks = posted.sums.cpu().numpy().view(np.uint64).tolist()
        dtype, shape = pre.dtype_name, pre.shape
        status: list[str] = [""] * len(batch)
        errors: dict[int, str] = {}
        good: list[tuple[int, Reservation, IncomingPage]] = []
        bad: list[Reservation] = []
        for i, page in enumerate(batch):
            blob = PageBlob(posted.targets[i].cpu().numpy().data, dtype, shape, checks[i])
            slot = posted.slots[i]
            try:
                incoming = IncomingPage(
                    page.page_hash, page.parent_hash, page.token_ids, blob, page.lora_id
                )
                if slot is None:
                    new = receiver.insert_many([incoming])[0]
                    status[i] = "inserted" if new else "present"
                    continue
                receiver.check(incoming)
            except KVMeshError as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
                if slot is not None:
                    bad.append(slot)
                continue
            good.append((i, slot, incoming))
        cached = receiver.commit([(slot, incoming) for _, slot, incoming in good], bad)
        for (i, _, _), new in zip(good, cached, strict=True):
            status[i] = "inserted" if new else "present"  # present: cached meanwhile
        posted.slots = []
        for i, page in enumerate(batch):
            if i in errors:
                outcome.rejected.append((page.page_hash, errors[i]))
            elif status[i] == "inserted":
                outcome.inserted.append(page.page_hash)
            else:
                outcome.present.append(page.page_hash)
        if errors:  # one line per batch, not per page
            log.warning(
                "rejected %d received page(s) of a batch; first: %s",
                len(errors),
                next(iter(errors.values())),
            )

    def _release(self, posted: dict[int, _Posted], transport_failed: bool) -> None:
        """Give back pages reserved for batches that never got committed (after a failure).

        Safe once their receives completed or the group failed (gloo closed the
        connection, so nothing lands in them any more). A receive still posted
        after another error could yet write: those pages stay held (logged).
        """
        held: list[Reservation] = []
        failed = transport_failed or self.group.broken is not None
        for batch in posted.values():
            mine = [slot for slot in batch.slots if slot is not None]
            if batch.works and not failed:
                self.group.mark_broken("a page receive was abandoned after an error")
                log.error(
                    "keeping %d reserved pages held: a receive into them is still posted", len(mine)
                )
                continue
            held += mine
        if held:
            self.service.release(held)

    def _insert_batch(
        self,
        pre: Preamble,
        pages: Sequence[WirePage],
        sums: Tensor,
        buf: Tensor,
        outcome: _Outcome,
        receiver: PageReceiver,
    ) -> None:
        """Check and insert the pages of a received batch; a bad page is rejected alone.

        One `PageService.insert_many` for the batch (one pass under the lock);
        only if it refuses (all or nothing) are the pages retried one by one,
        so that the good ones still go in.
        """
        host = buf.cpu().numpy().reshape(len(pages), pre.page_nbytes)
        checks = sums.cpu().numpy().view(np.uint64).tolist()
        dtype, shape = pre.dtype_name, pre.shape
        incoming = [
            IncomingPage(
                p.page_hash,
                p.parent_hash,
                p.token_ids,
                PageBlob(host[i].data, dtype, shape, checks[i]),
                p.lora_id,
            )
            for i, p in enumerate(pages)
        ]
        try:
            news = receiver.insert_many(incoming)
        except KVMeshError:
            news = None
        if news is not None:
            for page, new in zip(incoming, news, strict=True):
                (outcome.inserted if new else outcome.present).append(page.page_hash)
            return
        before = len(outcome.rejected)
        for page in incoming:
            try:
                new = receiver.insert_many([page])[0]
            except KVMeshError as exc:
                outcome.rejected.append((page.page_hash, f"{type(exc).__name__}: {exc}"))
                continue
            (outcome.inserted if new else outcome.present).append(page.page_hash)
        log.warning(
            "rejected %d received page(s) of a batch; first: %s",
            len(outcome.rejected) - before,
            outcome.rejected[before][1] if len(outcome.rejected) > before else "-",
        )

    # -- helpers -----------------------------------------------------------

    def _dev(self, t: Tensor) -> Tensor:
        return t if t.device == self.group.device else t.to(self.group.device)

    def _peer_lock(self, peer: int) -> threading.Lock:
        with self._locks_guard:
            lock = self._peer_locks.get(peer)
            if lock is None:
                lock = self._peer_locks[peer] = threading.Lock()
            return lock

    def _protocol_error(self, what: str) -> TransportError:
        self.group.mark_broken(f"protocol error: {what}")
        return TransportError(f"torch.distributed transfer out of step: {what}")


@dataclass(slots=True)
class _Posted:
    """A batch whose receives are posted: the works, its checksums, where its bytes land."""

    works: list[Any]
    sums: Tensor
    targets: list[Tensor]
    slots: list[Reservation | None]


@dataclass(slots=True)
class _Outcome:
    inserted: list[PageHash] = field(default_factory=list)
    present: list[PageHash] = field(default_factory=list)
    rejected: list[tuple[PageHash, str]] = field(default_factory=list)


# --------------------------------------------------------------------------- fallback


class GrpcPuller(Protocol):
    """What the fallback needs of a gRPC client (`SyncPeerClient` to the peer has it)."""

    def pull_into(
        self, service: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> int: ...


DistSource = DistPageTransport | Callable[[], DistPageTransport] | None
"""A ready transport, a factory that joins the group on first use, or none configured."""


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """How a pull went: the transport that delivered, pages newly cached, why dist was skipped.

    `fallback_reason` is None when the transport asked for delivered; `dist`
    holds the per-page detail when torch.distributed delivered.
    """

    transport: str
    inserted: int
    fallback_reason: str | None = None
    dist: ReceiveResult | None = None


@dataclass(frozen=True, slots=True)
class _FetchArgs:
    service: PageService
    hashes: tuple[PageHash, ...]
    proofs: ProofBook
    dist: DistSource
    peer_rank: int | None
    grpc: GrpcPuller | None
    deadline_s: float | None


def _fetch_dist(a: _FetchArgs) -> FetchOutcome:
    if a.dist is None:
        raise TransportError("no torch.distributed group is configured for this worker")
    if a.peer_rank is None:
        raise TransportError("the peer has no rank in this worker's torch.distributed group")
    transport = a.dist if isinstance(a.dist, DistPageTransport) else a.dist()
    if transport.service is not a.service:
        raise InvalidInput("the dist transport serves another PageService than the one to fill")
    result = transport.pull(a.peer_rank, a.hashes, a.proofs)
    return FetchOutcome("dist", len(result.inserted), None, result)


def _fetch_grpc(a: _FetchArgs) -> FetchOutcome:
    if a.grpc is None:
        raise TransportError("no gRPC client for the peer")
    into = a.service.receiving(a.proofs)
    return FetchOutcome("grpc", a.grpc.pull_into(into, a.hashes, deadline_s=a.deadline_s))


FETCHERS: dict[str, Callable[[_FetchArgs], FetchOutcome]] = {
    "dist": _fetch_dist,
    "grpc": _fetch_grpc,
}
"""Registry of pull transports by `TransferConfig.transport` name."""

FALLBACK: dict[str, str] = {"dist": "grpc"}
"""Where a failed transport falls back to (gRPC is the one every worker serves)."""


def fetch_with_fallback(
    service: PageService,
    hashes: Sequence[PageHash],
    proofs: ProofBook,
    *,
    transport: str = "dist",
    dist: DistSource = None,
    peer_rank: int | None = None,
    grpc: GrpcPuller | None = None,
    deadline_s: float | None = None,
) -> FetchOutcome:
    """Pull `hashes` from a peer into `service` over `transport`, falling back to gRPC;
    every page is proven against `proofs` (the book of the request being served).

    With ``transport="dist"``, any `TransportError` of torch.distributed (no
    group, the factory's rendezvous failing, the peer gone mid-transfer) is
    logged with its reason and the pull is redone over `grpc` (pages the
    failed pull had already inserted are skipped there). Raises the gRPC
    error when the fallback fails too, `ConfigError` for an unknown transport.
    """
    try:
        fetch = FETCHERS[transport]
    except KeyError:
        raise ConfigError(
            f"unknown transport {transport!r}; choose one of {sorted(FETCHERS)}"
        ) from None
    args = _FetchArgs(service, tuple(hashes), proofs, dist, peer_rank, grpc, deadline_s)
    try:
        return fetch(args)
    except TransportError as exc:
        backup = FALLBACK.get(transport)
        if backup is None:
            raise
        reason = f"{type(exc).__name__}: {exc}"
        if grpc is None:
            raise TransportError(
                f"{transport} pull failed ({reason}) and no gRPC peer is given"
            ) from exc
        log.warning(
            "%s pull of %d pages from rank %s failed, falling back to %s: %s",
            transport,
            len(args.hashes),
            peer_rank,
            backup,
            reason,
        )
        outcome = FETCHERS[backup](args)
        return FetchOutcome(outcome.transport, outcome.inserted, reason, outcome.dist)


__all__ = [
    "BACKENDS",
    "DTYPE_CODES",
    "MAX_HASH_BYTES",
    "DistGroup",
    "DistPageTransport",
    "DistRendezvous",
    "FetchOutcome",
    "GrpcPuller",
    "Preamble",
    "ReceiveResult",
    "SendResult",
    "WirePage",
    "assign_ranks",
    "fetch_with_fallback",
    "free_port",
    "host_link_store",
    "plan_batches",
]
