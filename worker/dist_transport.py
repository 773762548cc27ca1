"""Pull, push and serve pages over a torch.distributed link (`DistGroup`).

The framing is `kvmesh.worker.dist_wire`'s. `Layout.BATCH` (small pages): a
batch is a run of consecutive page ids sent in place from the KV tensor, or
scattered pages gathered into a reused buffer with one `index_select`
(`plan_batches`); the receiver takes it into a buffer and inserts the pages
through its `PageReceiver`. `Layout.PAGES` (pages of at least 1 MiB): each
page goes from the sender's KV tensor straight into a page the receiver
reserved in its pool, is checked there and cached only if it passed, so no
byte is copied outside the socket. Copies bound the speed on loopback, so
each pass over the bytes counts (see `kvmesh bench transfer`).

The receiver posts the next batches (two buffers, or `depth` batches of
reserved pages) before it checks the current one, and the sender checksums
batch ``i + 1`` while batch ``i`` is on the wire. Every page enters the pool
through a `PageReceiver`, so it passes the same checks as over gRPC (dtype,
shape, size, checksum, the receiver's proof of its hash); a page that fails
is dropped and reported, the others are inserted.

A pull sends a REQUEST to the peer's serving loop (`serve_forever`) on
`SERVE_TAG`; the pages come back on `REPLY_TAG`. A push sends the pages
straight to the serving loop, which acknowledges (ACK: pages it now holds,
pages it refused) once they are cached, so the pusher returns only when the
receiver can serve from them. Calls are serialised per peer, so a tag never
carries two transfers between the same two ranks at once (gloo matches
messages by source and tag, in order; NCCL has no tags, so on NCCL a pair of
ranks must not pull from each other at the same moment).

Failures raise `TransportError` and break the group (`DistGroup`); pages a
failed pull had already checked and inserted stay (they are valid), pages
reserved for the rest go back to the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, InvalidInput, PermissionDenied, TransportError
from kvmesh.types import PageHash, PageId
from kvmesh.worker.dist_group import DistGroup
from kvmesh.worker.dist_receive import BatchReceiver, ReusedBuffers
from kvmesh.worker.dist_wire import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_DEPTH,
    DEFAULT_MAX_BATCH_BYTES,
    DTYPE_CODES,
    MAX_PAGES_PER_TRANSFER,
    MIN_IN_PLACE_BYTES,
    PAGE_MESSAGE_BYTES,
    PREAMBLE_WORDS,
    REPLY_TAG,
    SERVE_TAG,
    Kind,
    Layout,
    Preamble,
    ReceiveResult,
    SendResult,
    WirePage,
    decode_page_meta,
    decode_request,
    encode_page_meta,
    encode_request,
    plan_batches,
    u64_to_i64,
)
from kvmesh.worker.page_service import (
    NO_PROOFS,
    PageInfo,
    PageReceiver,
    PageService,
    check_hash,
)

log = logging.getLogger(__name__)


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
        self._send_bufs = ReusedBuffers(store.device)
        self._send_guard = threading.Lock()
        self._recv_guard = threading.Lock()
        self._receiver = BatchReceiver(
            group, depth=depth, timeout_s=self.timeout_s, page_rows=self._page_rows
        )

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

    def pull(self, src: int, hashes: Sequence[PageHash], receiver: PageReceiver) -> ReceiveResult:
        """Fetch `hashes` from rank `src`'s serving loop into `receiver` (a view of this
        transport's `PageService` bound to the book of the request being served).

        Raises `TransportError` when the group fails; pages checked and
        inserted before the failure stay.
        """
        if receiver.service is not self.service:
            raise InvalidInput("the receiver fills another PageService than this transport's")
        if len(hashes) > MAX_PAGES_PER_TRANSFER:
            raise InvalidInput(
                f"a pull asks for at most {MAX_PAGES_PER_TRANSFER} pages, got {len(hashes)}; "
                "split it"
            )
        request = encode_request([check_hash(h) for h in hashes])
        with self._peer_lock(src):
            self._send_small(src, SERVE_TAG, Preamble(Kind.REQUEST, len(hashes)), request)
            return self._receive_pages(src, REPLY_TAG, None, receiver)

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
        return self._dev(torch.from_numpy(u64_to_i64([export(pid).checksum for pid in page_ids])))

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
            return self._receiver.receive(src, tag, pre, pages, tuple(missing), counts, receiver)

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
