"""The receiving side of a torch.distributed transfer: batches posted ahead, checked where
they land, every page taken through a `PageReceiver`.

`Layout.BATCH`: a batch lands in one of two reused buffers and its pages are
inserted (one `insert_many`, page by page only if it refuses). `Layout.PAGES`:
each page lands in a pool page reserved for it (`PageReceiver.reserve`, only
for pages the receiver can prove), is checked there and cached only if it
passed; a page already held, or repeated, lands in a spare row and is
inserted. Up to `depth` batches are posted before the current one is checked.
A failure releases the reserved pages no receive can write any more; pages
already checked and cached stay (they are valid).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvmesh.errors import KVMeshError, TransportError
from kvmesh.types import PageHash
from kvmesh.worker.dist_group import DistGroup
from kvmesh.worker.dist_wire import Layout, Preamble, ReceiveResult, WirePage
from kvmesh.worker.kv_store import PageBlob
from kvmesh.worker.page_service import IncomingPage, PageReceiver, Reservation

log = logging.getLogger(__name__)


class ReusedBuffers:
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


class BatchReceiver:
    """Receives the batches of PAGES transfers on one group.

    `page_rows` gives the KV tensor as one byte row per page (where reserved
    pages land); `timeout_s` bounds every wait.
    """

    def __init__(
        self,
        group: DistGroup,
        *,
        depth: int,
        timeout_s: float,
        page_rows: Callable[[], Tensor],
    ) -> None:
        self.group = group
        self.depth = depth
        self.timeout_s = timeout_s
        self._page_rows = page_rows
        self._bufs = ReusedBuffers(group.device)

    def receive(
        self,
        src: int,
        tag: int,
        pre: Preamble,
        pages: list[WirePage],
        missing: tuple[PageHash, ...],
        counts: list[int],
        receiver: PageReceiver,
    ) -> ReceiveResult:
        """Receive the batches (`counts` pages each) of the transfer `pre` announced, whose
        meta listed `pages`, into `receiver`. Raises `TransportError` when the group fails.
        One transfer at a time (the buffers are reused): the caller serialises calls."""
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
                buf = self._bufs.get(n % 2, count * pre.page_nbytes)
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
                    self._commit_batch(pre, pages[first : first + count], batch, outcome, receiver)
                del posted[n]
        finally:
            self._release(posted, transport_failed, receiver)
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

        A reserved page is cached only after its bytes passed `PageReceiver.check`;
        pages that landed in spare rows (held already, or repeated) are inserted.
        """
        incoming = _incoming(
            pre, batch, [t.cpu().numpy().data for t in posted.targets], posted.sums
        )
        status: list[bool | str] = [False] * len(batch)
        spare = [i for i, slot in enumerate(posted.slots) if slot is None]
        for i, got in zip(spare, _insert_each(receiver, [incoming[i] for i in spare]), strict=True):
            status[i] = got
        good: list[tuple[int, Reservation]] = []
        bad: list[Reservation] = []
        for i, slot in enumerate(posted.slots):
            if slot is None:
                continue
            try:
                receiver.check(incoming[i])
            except KVMeshError as exc:
                status[i] = f"{type(exc).__name__}: {exc}"
                bad.append(slot)
                continue
            good.append((i, slot))
        cached = receiver.commit([(slot, incoming[i]) for i, slot in good], bad)
        posted.slots = []  # committed or released: nothing left for `_release`
        for (i, _), new in zip(good, cached, strict=True):
            status[i] = new  # False: cached by someone else meanwhile
        outcome.record(batch, status)

    def _release(
        self, posted: dict[int, _Posted], transport_failed: bool, receiver: PageReceiver
    ) -> None:
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
            receiver.release(held)

    def _insert_batch(
        self,
        pre: Preamble,
        pages: Sequence[WirePage],
        sums: Tensor,
        buf: Tensor,
        outcome: _Outcome,
        receiver: PageReceiver,
    ) -> None:
        """Check and insert the pages of a batch received into a buffer."""
        host = buf.cpu().numpy().reshape(len(pages), pre.page_nbytes)
        rows = [host[i].data for i in range(len(pages))]
        outcome.record(pages, _insert_each(receiver, _incoming(pre, pages, rows, sums)))


@dataclass(slots=True)
class _Posted:
    """A batch whose receives are posted: the works, its checksums, where its bytes land."""

    works: list[Any]
    sums: Tensor
    targets: list[Tensor]
    slots: list[Reservation | None]


@dataclass(slots=True)
class _Outcome:
    """Per page of one transfer: inserted, present (held already) or rejected (why)."""

    inserted: list[PageHash] = field(default_factory=list)
    present: list[PageHash] = field(default_factory=list)
    rejected: list[tuple[PageHash, str]] = field(default_factory=list)

    def record(self, pages: Sequence[WirePage], status: Sequence[bool | str]) -> None:
        """Note each page's status (True new, False present, a string: why it was refused);
        one log line per batch with refusals, never one per page."""
        refused = 0
        for page, got in zip(pages, status, strict=True):
            if isinstance(got, str):
                self.rejected.append((page.page_hash, got))
                refused += 1
            else:
                (self.inserted if got else self.present).append(page.page_hash)
        if refused:
            log.warning(
                "rejected %d received page(s) of a batch; first: %s",
                refused,
                self.rejected[-refused][1],
            )


def _incoming(
    pre: Preamble, pages: Sequence[WirePage], rows: Sequence[Any], sums: Tensor
) -> list[IncomingPage]:
    """The received pages as `PageReceiver` takes them: bytes where they landed, the
    sender's checksums and its word on parent, tokens and LoRA (proven by the receiver)."""
    checks = sums.cpu().numpy().view(np.uint64).tolist()
    dtype, shape = pre.dtype_name, pre.shape
    return [
        IncomingPage(
            p.page_hash,
            p.parent_hash,
            p.token_ids,
            PageBlob(rows[i], dtype, shape, checks[i]),
            p.lora_id,
        )
        for i, p in enumerate(pages)
    ]


def _insert_each(receiver: PageReceiver, pages: Sequence[IncomingPage]) -> list[bool | str]:
    """Insert `pages` through `receiver`: per page True new, False held already, or why it
    was refused. One `insert_many` (one pass under the lock); only if it refuses (all or
    nothing) are the pages retried one by one, so that the good ones still go in."""
    if not pages:
        return []
    try:
        return list(receiver.insert_many(pages))
    except KVMeshError:
        pass
    out: list[bool | str] = []
    for page in pages:
        try:
            out.append(receiver.insert_many([page])[0])
        except KVMeshError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


__all__ = ["BatchReceiver", "ReusedBuffers"]
