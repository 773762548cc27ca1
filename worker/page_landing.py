"""Where fetched pages land: straight in reserved pool pages, checked, handed over in order.

`PageLander` is the `ChunkSink` of one FetchPages stream: each page's header
is checked first (the hash asked for, dtype, shape and size, and with a pool,
the hash chain against the receiver's proofs), so a refused page reserves,
evicts and writes nothing; then its bytes land where they will stay (a
reserved page of a CPU KV store; host memory for a device store, copied in
once checked; a buffer of their own without a pool), hashed (xxh3,
streaming) while still in cache, and the checksum is compared at the page's
end. `InOrder` hands the pages of all streams to the caller strictly in
request order and gives back the reservations of pages it never hands over.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvmesh.errors import ChecksumMismatch, InvalidInput, PageFormatError, TransportError
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import DTYPES
from kvmesh.worker.page_codec import first_chunk_header, incoming_page
from kvmesh.worker.page_service import IncomingPage, PageReceiver, Reservation, check_hash


def verify_header(page: IncomingPage, expected: PageHash, address: str) -> None:
    """Check what a page's header says before any byte of it is taken: the hash asked for,
    and a size that is its dtype and shape (the bytes' checksum is checked as they land)."""
    if page.page_hash != expected:
        raise InvalidInput(
            f"peer {address} sent page {page.page_hash.hex()[:16]} where "
            f"{expected.hex()[:16]} was asked for; the peer is faulty"
        )
    blob = page.blob
    itemsize = DTYPES[blob.dtype].itemsize
    if math.prod(blob.shape) * itemsize != blob.nbytes or not blob.shape:
        raise PageFormatError(
            f"peer {address} sent page {expected.hex()[:16]} with {blob.nbytes} bytes, "
            f"which is not {blob.dtype} {list(blob.shape)}"
        )


@dataclass(frozen=True, slots=True)
class Landed:
    """A page checked and copied into a reserved pool page by its stream; to be committed."""

    reservation: Reservation
    page: IncomingPage


Item = IncomingPage | Landed
"""What a fetch hands over: a page landed in the pool, or a checked page of its own."""


class InOrder:
    """Hands pages to `deliver` in request order as concurrent streams finish them.

    Thread-safe; `deliver` runs under the lock, so one call at a time, in order.
    A page whose predecessors are still on the way waits here. Once closed (an
    error, or the end of the fetch) nothing more is delivered, and the reserved
    pool pages of waiting pages are given back.
    """

    __slots__ = ("_lock", "closed", "deliver", "missing", "next", "pages", "ready", "service")

    def __init__(self, deliver: Callable[[int, Item], None], service: PageReceiver | None) -> None:
        self.deliver = deliver
        self.service = service
        self._lock = threading.Lock()
        self.ready: dict[int, Item | None] = {}
        self.next = 0
        self.missing: list[tuple[int, PageHash]] = []  # (request index, hash)
        self.pages = 0
        self.closed = False

    def put(self, index: int, item: Item | None, page_hash: PageHash) -> None:
        with self._lock:
            if self.closed:
                self._drop([item])
                return
            if item is None:
                self.missing.append((index, page_hash))
            self.ready[index] = item
            while self.next in self.ready:
                got = self.ready.pop(self.next)
                if got is not None:
                    try:
                        self.deliver(self.next, got)
                    except BaseException:
                        self.closed = True
                        self._drop([got, *self.ready.values()])
                        self.ready.clear()
                        raise
                    self.pages += 1
                self.next += 1

    def todo(self, n: int) -> list[int]:
        """The indices below `n` that no stream has handed in yet."""
        with self._lock:
            return [i for i in range(self.next, n) if i not in self.ready]

    def missing_in_order(self) -> tuple[PageHash, ...]:
        """The hashes the peer lacks, as the caller asked for them."""
        with self._lock:
            return tuple(h for _, h in sorted(self.missing, key=lambda m: m[0]))

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._drop(list(self.ready.values()))
            self.ready.clear()

    def _drop(self, items: Sequence[Item | None]) -> None:
        held = [it.reservation for it in items if isinstance(it, Landed)]
        if held and self.service is not None:
            self.service.release(held)


class PageLander:
    """Receives one stream's pages where they will stay (a `grpc_wire.ChunkSink`).

    With a `service`, a page the pool cannot reserve (held already, being
    received by another transfer, no room) lands in a buffer of its own and
    is handed over as an `IncomingPage` (for `PageService.insert_many`).
    """

    __slots__ = (
        "_dst",
        "_filled",
        "_hasher",
        "_page",
        "_res",
        "_upload",
        "address",
        "hashes",
        "indices",
        "next",
        "order",
        "service",
    )

    def __init__(
        self,
        service: PageReceiver | None,
        indices: list[int],
        hashes: list[PageHash],
        order: InOrder,
        address: str,
    ) -> None:
        self.service = service
        self.indices = indices
        self.hashes = hashes
        self.order = order
        self.address = address
        self.next = 0  # position in `indices` of the page on the way
        self._page: IncomingPage | None = None
        self._res: Reservation | None = None
        self._dst = memoryview(b"")
        self._filled = 0
        self._upload = False
        self._hasher = xxhash.xxh3_64()

    def target(self, meta: pb.PageChunk, nbytes: int) -> memoryview:
        if self._page is None:
            if not self._begin(meta):
                if nbytes:
                    raise InvalidInput(f"peer {self.address} sent data with a missing page")
                return memoryview(bytearray())
        elif meta.page_index != self.next or meta.HasField("header") or meta.missing:
            raise InvalidInput(
                f"page {self.next} from peer {self.address} is incomplete ({self._filled} of "
                f"{len(self._dst)} bytes) but a chunk for page {meta.page_index} arrived"
            )
        if meta.offset != self._filled or self._filled + nbytes > len(self._dst):
            raise InvalidInput(
                f"page {self.next} from peer {self.address}: chunk at offset {meta.offset} with "
                f"{nbytes} bytes does not continue the {self._filled} of {len(self._dst)} received"
            )
        return self._dst[self._filled : self._filled + nbytes]

    def _begin(self, meta: pb.PageChunk) -> bool:
        """Check a page's first chunk and pick where its bytes go; False for a missing page."""
        if meta.page_index != self.next or self.next >= len(self.indices):
            raise InvalidInput(
                f"peer {self.address} sent page {meta.page_index} where page {self.next} of "
                f"{len(self.indices)} was expected; the peer is faulty"
            )
        index = self.indices[self.next]
        expected = self.hashes[index]
        if meta.missing:
            if check_hash(meta.header.page_hash) != expected:
                raise InvalidInput(
                    f"peer {self.address} reported {meta.header.page_hash.hex()[:16]} missing "
                    f"where {expected.hex()[:16]} was asked for; the peer is faulty"
                )
            self.next += 1
            self.order.put(index, None, expected)
            return False
        service = self.service
        header = first_chunk_header(meta, service.store.page_nbytes if service else None)
        nbytes = header.nbytes
        # Without a pool the size is the peer's word: its stand-in is not kept.
        probe = incoming_page(header, _placeholder(nbytes) if service else bytes(nbytes))
        verify_header(probe, expected, self.address)
        res, dst = None, None
        if service is not None:
            service.check(probe, with_checksum=False)  # format and hash chain, no bytes yet
            res = service.reserve([expected])[0]
            dst = service.store.page_buffer(res.page.page_id) if res is not None else None
        self._upload = res is not None and dst is None  # a device store: copied in at the end
        if dst is None:
            dst = np.empty(nbytes, dtype=np.uint8).data
        self._res = res
        self._page = dataclasses.replace(probe, blob=dataclasses.replace(probe.blob, data=dst))
        self._dst = dst
        self._filled = 0
        self._hasher.reset()
        return True

    def landed(self, _meta: pb.PageChunk, data: memoryview) -> None:
        page = self._page
        if page is None:
            return
        self._hasher.update(data)
        self._filled += len(data)
        if self._filled < len(self._dst):
            return
        res, self._page, self._res = self._res, None, None
        index = self.indices[self.next]
        self.next += 1
        actual = self._hasher.intdigest()
        if actual != page.blob.checksum:
            if res is not None and self.service is not None:
                self.service.release([res])
            raise ChecksumMismatch(
                f"page {page.page_hash.hex()[:16]} from peer {self.address} hashes to "
                f"{actual:#018x}, header says {page.blob.checksum:#018x}: corrupted in transit; "
                "fetch it again"
            )
        if res is None or self.service is None:
            self.order.put(index, page, page.page_hash)
            return
        if self._upload:
            try:
                self.service.store.import_page(res.page.page_id, page.blob, verified=True)
            except BaseException:
                self.service.release([res])
                raise
        self.order.put(index, Landed(res, page), page.page_hash)

    def finish(self) -> None:
        """After the call's OK status: every page asked for must have come, whole."""
        if self._page is not None or self.next != len(self.indices):
            raise TransportError(
                f"peer {self.address} ended FetchPages after {self.next} of "
                f"{len(self.indices)} pages; the peer is faulty"
            )

    def abort(self) -> None:
        """Give back the reserved page of a page left incomplete (idempotent)."""
        res, self._res, self._page = self._res, None, None
        if res is not None and self.service is not None:
            self.service.release([res])


_PLACEHOLDERS: dict[int, bytes] = {}


def _placeholder(nbytes: int) -> bytes:
    """Stand-in bytes of a page's size for checks that look at the size only (never read:
    zero pages the kernel maps on demand)."""
    got = _PLACEHOLDERS.get(nbytes)
    if got is None:
        got = _PLACEHOLDERS[nbytes] = bytes(nbytes)
    return got
