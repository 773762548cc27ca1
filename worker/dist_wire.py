"""The torch.distributed page wire: preamble, meta and batch plan of one transfer.

One transfer of ``n`` pages between two ranks::

    preamble  int64[16]      magic, version, kind, count, dtype code, ndim,
                             shape[6], meta bytes, largest batch, layout, 0
    meta      uint8[...]     msgpack [[hash, parent, tokens, lora, tier] per page,
                             [missing hashes], [pages per batch], push ticket]
    for each batch of k pages (at most `batch_bytes`):
      checksums int64[k]     xxh3-64 of each page's bytes (from `PageService.export`)
      payload                Layout.BATCH: uint8[k * page bytes], one contiguous tensor
                             Layout.PAGES: k tensors of one page each

Every size the receiver posts follows from the preamble and the meta, both
bounded here before anything is posted: a garbled preamble is a transport
failure (the stream is out of step), a malformed meta an `InvalidInput`.
Only msgpack and raw tensor bytes cross the wire, never pickle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
from torch import Tensor

from kvmesh.errors import InvalidInput, TransportError
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import DTYPES
from kvmesh.worker.page_service import check_hash

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


def u64_to_i64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64).view(np.int64)


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


__all__ = [
    "DTYPE_CODES",
    "MAX_PAGES_PER_TRANSFER",
    "PREAMBLE_WORDS",
    "REPLY_TAG",
    "SERVE_TAG",
    "Kind",
    "Layout",
    "Preamble",
    "ReceiveResult",
    "SendResult",
    "WirePage",
    "decode_page_meta",
    "decode_request",
    "encode_page_meta",
    "encode_request",
    "plan_batches",
    "u64_to_i64",
]
