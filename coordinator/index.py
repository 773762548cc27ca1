"""The global index: which worker holds which KV page, in which tier.

Pure (no Ray, no gRPC). Every page hash any worker holds has a bit mask of
holders, four bits per worker slot (one per tier)::

    mask = ... | tier bits of slot 1 | tier bits of slot 0
                 [other disk cpu gpu]  [other disk cpu gpu]
                  bit 7 ........ 4      bit 3 ........ 0

and a parent hash (the chain). Because page hashes are chained, a request's
hashes are themselves the chain: `match` walks them once, keeping the set of
workers that held every page so far (an AND of masks), and records each
worker's length when it drops out. The cost grows with the prompt's pages,
not with the cluster's pages or workers.

The pages live in a columnar `PageStore` (`coordinator.index_store`):
compact 8-byte keys with exact digest checks, interned holder masks, parent
rows, and a roaring bitmap of rows per worker slot, so dropping a worker
(death, drain, a new incarnation, a snapshot, `AllPagesCleared`) costs
O(its pages). Memory grows with distinct pages (about 40-80 bytes each,
digest width included) and distinct holder sets, not with requests.
Consecutive stored events of one worker and tier are applied as one run.

Event batches are applied per worker in sequence order:

- the first batch of an incarnation not seen before replaces everything the
  index held for the worker's old incarnation (old incarnations are then
  ignored forever, so a late batch from before a restart changes nothing).
  Incarnation ids have no order, so a batch of an unseen incarnation whose
  timestamp is older than the newest batch accepted from the current one is
  taken for a late batch of an earlier life and ignored (non-finite
  timestamps are treated as unknown, so a batch stamped +inf cannot lock
  out later incarnations); behind a registry
  (the coordinator service) the registered incarnation decides instead;
- a batch whose seq is at most the last one applied is a duplicate: ignored;
- a batch past a gap is held back (at most `reorder_window` of them) and the
  worker is marked stale: it is not routed to by cache affinity. If the
  missing batch arrives, the held ones are applied in order and the stale
  mark goes away; otherwise a snapshot batch (``snapshot=True``) replaces the
  worker's entries and clears it. A snapshot's seq is the seq of the last
  batch whose effects it includes; snapshots older than what was applied are
  ignored.
- the sequence numbers of an incarnation start at 0, so a first batch with a
  higher seq (e.g. after a coordinator restart) is a gap too.

A bad batch (wrong types, unknown worker when registration is required) is
rejected with `EventDecodeError` / `UnknownWorker` before anything changes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgpack
import numpy as np
import numpy.typing as npt

from kvmesh.coordinator.index_store import PageStore, PromptKeys
from kvmesh.coordinator.tiers import TierPages
from kvmesh.errors import EventDecodeError, InvalidInput, InvariantViolation, UnknownWorker
from kvmesh.events import (
    AllPagesCleared,
    ApplyResult,
    EventBatch,
    KVEvent,
    PagesRemoved,
    PagesStored,
    decode_batch,
)
from kvmesh.types import PageHash, WorkerId

TIER_NAMES: tuple[str, ...] = ("gpu", "cpu", "disk", "other")
"""Tier of each of a worker's four bits; media the index does not know map to "other"."""

_BITS = 4
_WORKER_BITS = 0b1111
_MEDIUM_ALIASES: dict[str, int] = {
    "gpu": 0,
    "cuda": 0,
    "device": 0,
    "cpu": 1,
    "host": 1,
    "disk": 2,
    "storage": 2,  # vLLM's MEDIUM_STORAGE
    "localdisk": 2,
    "ssd": 2,
}
_TIERS_OF_BITS: tuple[tuple[str, ...], ...] = tuple(
    tuple(name for i, name in enumerate(TIER_NAMES) if bits >> i & 1) for bits in range(16)
)
_GPU_ONLY = _TIERS_OF_BITS[1]
SNAPSHOT_FORMAT = "kvmesh-index"
SNAPSHOT_VERSION = 1


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest held prefix per worker, for one request's hashes.

    `pages` lists only workers holding at least the first page; `tiers` names
    the tiers in which that worker holds some page of its matched prefix.
    """

    pages: dict[WorkerId, int]
    tiers: dict[WorkerId, tuple[str, ...]]
    num_hashes: int
    device_only: bool = field(default=False, compare=False)
    """True when every matched page is on the device tier alone (what `GlobalIndex.match`
    knows from its walk): `GlobalIndex.tier_pages` then has nothing to count."""

    def longest(self) -> tuple[WorkerId | None, int]:
        """The worker with the longest prefix (smallest id on ties) and its length."""
        best: WorkerId | None = None
        best_n = 0
        for wid, n in self.pages.items():
            if n > best_n or (n == best_n and best is not None and wid < best):
                best, best_n = wid, n
        return best, best_n


Overlaps = tuple[dict[WorkerId, int], dict[WorkerId, TierPages]]
"""`GlobalIndex.overlaps`: each worker's held prefix, and the tiers of those held off the device."""


@dataclass(frozen=True, slots=True)
class PrefixTable:
    """`GlobalIndex.overlaps_many` as arrays: each worker's held prefix of each prompt of a
    batch, a row per prompt and a column per worker slot (`workers`; None: a free slot,
    whose column is 0).

    A prompt with a page held off the device has its `overlaps` in `tiered` (its row
    still holds its prefixes), so its tiers are counted as one prompt's are.
    """

    workers: tuple[WorkerId | None, ...]
    lengths: npt.NDArray[np.int64]
    tiered: dict[int, Overlaps]

    def overlaps(self, i: int) -> Overlaps:
        """Prompt `i`'s `GlobalIndex.overlaps`."""
        exact = self.tiered.get(i)
        if exact is not None:
            return exact
        row = self.lengths[i]
        held = np.flatnonzero(row)
        workers = cast(tuple[WorkerId, ...], self.workers)  # a free slot's column is 0
        return dict(zip([workers[j] for j in held.tolist()], row[held].tolist(), strict=True)), {}


@dataclass(frozen=True, slots=True)
class WorkerIndexState:
    """A read-only view of what the index knows about one worker."""

    worker_id: WorkerId
    incarnation: str | None
    last_seq: int
    stale: bool
    num_pages: int
    pending_batches: int


class IndexObserver(Protocol):
    """Sees what the index applies, in the order it applies it (e.g. per-tenant page counts).

    `events_applied` gets each batch's events once they are applied (held-back batches when
    their gap fills, never ignored ones); `worker_dropped` comes whenever the index drops
    everything of a worker (a snapshot, a new incarnation, removal) before anything new.
    A `restore` is not seen: observers start over with the workers' next snapshots.
    """

    def events_applied(self, worker_id: WorkerId, events: Sequence[KVEvent]) -> None: ...

    def worker_dropped(self, worker_id: WorkerId) -> None: ...


class _Worker:
    """Mutable per-worker state (internal)."""

    __slots__ = (
        "incarnation",
        "last_seq",
        "last_ts",
        "needs_snapshot",
        "pending",
        "registered",
        "retired",
        "shift",
        "stale",
        "worker_id",
    )

    def __init__(self, worker_id: WorkerId, shift: int, registered: bool) -> None:
        self.worker_id = worker_id
        self.shift = shift
        self.incarnation: str | None = None
        self.last_seq = -1
        self.last_ts = 0.0  # newest batch timestamp accepted from this incarnation
        self.stale = False
        # True once held-back batches were dropped: only a snapshot can help now.
        self.needs_snapshot = False
        self.pending: dict[int, EventBatch] = {}
        self.retired: deque[str] = deque(maxlen=16)
        self.registered = registered


def tier_of(medium: str | None, default: int) -> int:
    """Bit index (0-3) of a KV event's medium; None means the index's default tier."""
    if medium is None:
        return default
    return _MEDIUM_ALIASES.get(medium.lower(), 3)


def _finite(ts: float) -> float:
    """A batch timestamp usable for ordering; non-finite ones (inf, nan) count as unknown (0)."""
    return ts if math.isfinite(ts) else 0.0


def _check_hash(value: object, where: str) -> None:
    if type(value) is not bytes or not 0 < len(value) <= 64:
        raise EventDecodeError(f"{where}: a page hash must be 1-64 bytes, got {value!r:.40}")


def _check_hashes(values: Sequence[object], where: str) -> None:
    """`_check_hash` on each value, in C-level passes while all are good."""
    if values and not (
        set(map(type, values)) == {bytes}
        and min(map(len, values)) > 0  # type: ignore[arg-type]
        and max(map(len, values)) <= 64  # type: ignore[arg-type]
    ):
        for h in values:
            _check_hash(h, where)


def validate_batch(batch: object) -> EventBatch:
    """Check every field's type of an in-process batch; raise `EventDecodeError`."""
    if not isinstance(batch, EventBatch):
        raise EventDecodeError(f"expected an EventBatch, got {type(batch).__name__}")
    if not isinstance(batch.worker_id, str) or not batch.worker_id:
        raise EventDecodeError("batch worker_id must be a non-empty string")
    if not isinstance(batch.incarnation, str):
        raise EventDecodeError("batch incarnation must be a string")
    if type(batch.seq) is not int or batch.seq < 0:
        raise EventDecodeError(f"batch seq must be a non-negative int, got {batch.seq!r}")
    if not isinstance(batch.snapshot, bool):
        raise EventDecodeError("batch snapshot flag must be a bool")
    if not isinstance(batch.events, tuple | list):
        raise EventDecodeError("batch events must be a tuple")
    for i, ev in enumerate(batch.events):
        where = f"event {i}"
        if isinstance(ev, PagesStored):
            if not isinstance(ev.page_hashes, tuple | list):
                raise EventDecodeError(f"{where}: page_hashes must be a tuple")
            _check_hashes(ev.page_hashes, where)
            if ev.parent_hash is not None:
                _check_hash(ev.parent_hash, where + " parent")
            if ev.medium is not None and not isinstance(ev.medium, str):
                raise EventDecodeError(f"{where}: medium must be a string or None")
        elif isinstance(ev, PagesRemoved):
            if not isinstance(ev.page_hashes, tuple | list):
                raise EventDecodeError(f"{where}: page_hashes must be a tuple")
            _check_hashes(ev.page_hashes, where)
            if ev.medium is not None and not isinstance(ev.medium, str):
                raise EventDecodeError(f"{where}: medium must be a string or None")
        elif not isinstance(ev, AllPagesCleared):
            raise EventDecodeError(f"{where}: unknown event type {type(ev).__name__}")
    return batch


class GlobalIndex:
    """Page hash -> holders {(worker, tier)}, with parent links; see the module docstring.

    Not thread-safe: the coordinator service holds a lock around it.
    `require_registration`: batches from workers never passed to
    `register_worker` raise `UnknownWorker`. `default_tier` is the tier of
    events whose medium is None (vLLM's GPU-only engines send None); a
    removal with medium None removes the page from every tier.
    """

    def __init__(
        self,
        *,
        require_registration: bool = False,
        default_tier: str = "gpu",
        reorder_window: int = 64,
    ) -> None:
        if default_tier not in TIER_NAMES:
            raise InvalidInput(f"default_tier must be one of {TIER_NAMES}, got {default_tier!r}")
        if reorder_window < 0:
            raise InvalidInput(f"reorder_window must be >= 0, got {reorder_window}")
        self.require_registration = require_registration
        self.default_tier = default_tier
        self._default_bit = TIER_NAMES.index(default_tier)
        self.reorder_window = reorder_window
        self._store = PageStore()
        self._workers: dict[WorkerId, _Worker] = {}
        self._by_slot: list[WorkerId | None] = []
        self._free_slots: list[int] = []
        self._ones = 0  # bit 0 of every live worker's nibble
        # workers of a set of nibble-low bits, for `match`; cleared whenever a slot changes hands
        self._wids_of: dict[int, tuple[WorkerId, ...]] = {}
        self._observers: list[IndexObserver] = []

    def add_observer(self, observer: IndexObserver) -> None:
        """Tell `observer` of every batch applied and every worker dropped from now on."""
        self._observers.append(observer)

    # ------------------------------------------------------------------ workers

    def _new_worker(self, worker_id: WorkerId, registered: bool) -> _Worker:
        if self._free_slots:
            slot = min(self._free_slots)
            self._free_slots.remove(slot)
            self._by_slot[slot] = worker_id
        else:
            slot = len(self._by_slot)
            self._by_slot.append(worker_id)
        w = _Worker(worker_id, slot * _BITS, registered)
        self._store.ensure_slot(slot)
        self._workers[worker_id] = w
        self._ones |= 1 << w.shift
        self._wids_of.clear()
        return w

    def register_worker(self, worker_id: WorkerId, incarnation: str | None = None) -> None:
        """Make `worker_id` known; a different `incarnation` drops its old entries."""
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInput(f"worker_id must be a non-empty string, got {worker_id!r}")
        w = self._workers.get(worker_id)
        if w is None:
            w = self._new_worker(worker_id, True)
        w.registered = True
        if incarnation is not None and incarnation != w.incarnation:
            self._start_incarnation(w, incarnation)

    def remove_worker(self, worker_id: WorkerId) -> int:
        """Drop a worker and all its entries at once (O(its pages)); returns pages dropped."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return 0
        n = self._drop_all(w)
        slot = w.shift // _BITS
        self._by_slot[slot] = None
        self._free_slots.append(slot)
        self._ones &= ~(1 << w.shift)
        self._wids_of.clear()
        return n

    def workers(self) -> list[WorkerId]:
        return sorted(self._workers)

    def worker_state(self, worker_id: WorkerId) -> WorkerIndexState:
        w = self._get(worker_id)
        return WorkerIndexState(
            w.worker_id,
            w.incarnation,
            w.last_seq,
            w.stale,
            self._store.slot_count(w.shift // _BITS),
            len(w.pending),
        )

    def is_stale(self, worker_id: WorkerId) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.stale

    def stale_workers(self) -> set[WorkerId]:
        return {wid for wid, w in self._workers.items() if w.stale}

    def mark_stale(self, worker_id: WorkerId) -> None:
        """Stop trusting a worker's entries until it sends a snapshot."""
        w = self._get(worker_id)
        w.stale = True
        w.needs_snapshot = True

    def worker_pages(self, worker_id: WorkerId) -> frozenset[PageHash]:
        return frozenset(self._store.slot_pages(self._get(worker_id).shift // _BITS))

    def _get(self, worker_id: WorkerId) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            raise UnknownWorker(f"worker {worker_id!r} is not in the index; register it first")
        return w

    # ------------------------------------------------------------------ events

    def apply_encoded(self, data: bytes) -> ApplyResult:
        """Decode (`kvmesh.events.decode_batch`) and apply one batch."""
        return self._apply(decode_batch(data))

    def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch in the worker's sequence order (see the module docstring)."""
        return self._apply(validate_batch(batch))

    def apply_decoded(self, batch: EventBatch) -> ApplyResult:
        """`apply` for a batch `kvmesh.events.decode_batch` returned: it checked every field
        already, so this skips `validate_batch` (a tenth of applying a 512-page batch)."""
        return self._apply(batch)

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        """`apply_decoded` on each batch in turn, with the same results and the same index after.

        Consecutive batches that continue an up-to-date worker's sequence (same
        incarnation, next seqs, no snapshot) go to the store as one run: the
        numpy calls of a run cost the same for 512 pages as for 2,048, so a
        report carrying several batches pays them once (4 batches of 512 pages:
        ~1.4x the pages per CPU second of one at a time).
        """
        results: list[ApplyResult] = []
        i = 0
        while i < len(batches):
            run = self._in_order_run(batches, i)
            if run > 1:
                self._apply_run(batches[i : i + run])
                results.extend([ApplyResult.APPLIED] * run)
                i += run
            else:
                results.append(self._apply(batches[i]))
                i += 1
        return results

    def _in_order_run(self, batches: Sequence[EventBatch], start: int) -> int:
        """How many batches from `start` continue their worker's sequence with nothing held back."""
        first = batches[start]
        w = self._workers.get(first.worker_id)
        if w is None or w.stale or w.needs_snapshot or w.pending or w.incarnation is None:
            return 0
        seq, n = w.last_seq, 0
        for b in batches[start:]:
            if (
                b.worker_id != w.worker_id
                or b.incarnation != w.incarnation
                or b.snapshot
                or b.seq != seq + 1
            ):
                break
            seq += 1
            n += 1
        return n

    def _apply_run(self, run: Sequence[EventBatch]) -> None:
        """Apply `_in_order_run`'s batches as one: their events in order, the last seq, the newest ts."""
        w = self._workers[run[0].worker_id]
        self._apply_events(w, [ev for b in run for ev in b.events])
        w.last_seq = run[-1].seq
        w.last_ts = max(w.last_ts, *(_finite(b.ts) for b in run))

    def _apply(self, batch: EventBatch) -> ApplyResult:
        wid = batch.worker_id
        w = self._workers.get(wid)
        if w is None:
            if self.require_registration:
                raise UnknownWorker(
                    f"events from unregistered worker {wid!r}: register it before reporting"
                )
            w = self._new_worker(wid, False)
        replaced = False
        if batch.incarnation != w.incarnation:
            if batch.incarnation in w.retired or _finite(batch.ts) < w.last_ts:
                return ApplyResult.IGNORED
            self._start_incarnation(w, batch.incarnation)
            replaced = True
        seq = batch.seq
        if batch.snapshot:
            if seq < w.last_seq:
                return ApplyResult.IGNORED
            if _finite(batch.ts) > w.last_ts:
                w.last_ts = batch.ts
            self._drop_all(w)
            self._apply_events(w, batch.events)
            w.last_seq = seq
            w.needs_snapshot = False
            for s in [s for s in w.pending if s <= seq]:
                del w.pending[s]
            self._drain_pending(w)
            return ApplyResult.STALE if w.stale else ApplyResult.REPLACED
        if seq <= w.last_seq or seq in w.pending:
            return ApplyResult.IGNORED
        if _finite(batch.ts) > w.last_ts:
            w.last_ts = batch.ts
        if w.needs_snapshot:
            return ApplyResult.STALE
        if seq != w.last_seq + 1:
            w.stale = True
            if len(w.pending) >= self.reorder_window:
                w.pending.clear()
                w.needs_snapshot = True
            else:
                w.pending[seq] = batch
            return ApplyResult.STALE
        self._apply_events(w, batch.events)
        w.last_seq = seq
        self._drain_pending(w)
        if w.stale:
            return ApplyResult.STALE
        return ApplyResult.REPLACED if replaced else ApplyResult.APPLIED

    def _drain_pending(self, w: _Worker) -> None:
        pending = w.pending
        while pending:
            nxt = pending.pop(w.last_seq + 1, None)
            if nxt is None:
                break
            self._apply_events(w, nxt.events)
            w.last_seq = nxt.seq
        w.stale = bool(pending) or w.needs_snapshot

    def _start_incarnation(self, w: _Worker, incarnation: str) -> None:
        if w.incarnation is not None:
            w.retired.append(w.incarnation)
        self._drop_all(w)
        w.incarnation = incarnation
        w.last_seq = -1
        w.last_ts = 0.0
        w.stale = False
        w.needs_snapshot = False
        w.pending.clear()

    def _apply_events(self, w: _Worker, events: Iterable[KVEvent]) -> None:
        """Apply in order; consecutive events of one kind and tier go to the store as one run.

        Merging is exact: stores of one tier commute with each other as far as
        holders go (parents are rewritten in event order), and so do removals
        of the same tier bits.
        """
        store = self._store
        slot = w.shift // _BITS
        stored: list[tuple[tuple[PageHash, ...], PageHash | None]] = []
        removed: list[PageHash] = []
        bits = 0  # the tier bit of `stored`, or the bits `removed` clears
        for ev in events:
            if isinstance(ev, PagesStored):
                bit = 1 << (w.shift + tier_of(ev.medium, self._default_bit))
                if removed or (stored and bit != bits):
                    self._flush(slot, stored, removed, bits)
                stored.append((ev.page_hashes, ev.parent_hash))
                bits = bit
            elif isinstance(ev, PagesRemoved):
                if ev.medium is None:
                    clear = _WORKER_BITS << w.shift
                else:
                    clear = 1 << (w.shift + tier_of(ev.medium, self._default_bit))
                if stored or (removed and clear != bits):
                    self._flush(slot, stored, removed, bits)
                removed.extend(ev.page_hashes)
                bits = clear
            else:
                self._flush(slot, stored, removed, bits)
                store.drop_slot(slot)
        self._flush(slot, stored, removed, bits)
        for observer in self._observers:
            observer.events_applied(w.worker_id, tuple(events))

    def _flush(
        self,
        slot: int,
        stored: list[tuple[tuple[PageHash, ...], PageHash | None]],
        removed: list[PageHash],
        bits: int,
    ) -> None:
        """Hand a pending run to the store and empty it."""
        if stored:
            self._store.store(stored, slot, bits)
            stored.clear()
        if removed:
            self._store.remove(removed, slot, bits)
            removed.clear()

    def _drop_all(self, w: _Worker) -> int:
        for observer in self._observers:
            observer.worker_dropped(w.worker_id)
        return self._store.drop_slot(w.shift // _BITS)

    # ------------------------------------------------------------------ lookups

    def match(self, hashes: Sequence[PageHash], keys: PromptKeys | None = None) -> MatchResult:
        """Each worker's longest held prefix of `hashes`; one pass, stops at the first page no
        one holds. `keys`: `PromptKeys.of([hashes])`, made once for several indexes (shards)."""
        if keys is None:
            keys = PromptKeys.of((hashes,))
        pages: dict[WorkerId, int] = {}
        if self._walked_into(keys, pages):
            return self._result(pages, 0, len(hashes))
        return self._walk(hashes)

    def match_many(
        self, prompts: Sequence[Sequence[PageHash]], keys: PromptKeys | None = None
    ) -> list[MatchResult]:
        """`match` of each prompt, walked together in one compiled call (`PageStore.walk`):
        a batch of routes pays the call once. `keys`: `PromptKeys.of(prompts)`."""
        return [
            self._walk(p) if pages is None else self._result(pages, 0, len(p))
            for pages, p in zip(self._walked_many(prompts, keys), prompts, strict=True)
        ]

    def overlaps(
        self, hashes: Sequence[PageHash], keys: PromptKeys | None = None
    ) -> tuple[dict[WorkerId, int], dict[WorkerId, TierPages]]:
        """`match(hashes).pages` and their `tier_pages`: what a route's view needs, without
        the `MatchResult` and its tiers dict in the common case (every page on the device),
        a share of each shard's fixed cost per route."""
        if keys is None:
            keys = PromptKeys.of((hashes,))
        pages: dict[WorkerId, int] = {}
        tiers: dict[WorkerId, TierPages] = {}
        self.overlaps_into(hashes, keys, pages, tiers)
        return pages, tiers

    def overlaps_into(
        self,
        hashes: Sequence[PageHash],
        keys: PromptKeys,
        pages: dict[WorkerId, int],
        tiers: dict[WorkerId, TierPages],
    ) -> None:
        """`overlaps`, added to `pages` and `tiers`: a router in the same process merging
        shards (disjoint workers) hands each shard its dicts, so that a route builds one
        dict of overlaps, not one per shard and then their union (docs/scale.md)."""
        if not self._walked_into(keys, pages):
            found, tiered = self._overlaps(hashes)
            pages.update(found)
            tiers.update(tiered)

    def overlaps_many(
        self, prompts: Sequence[Sequence[PageHash]], keys: PromptKeys | None = None
    ) -> list[tuple[dict[WorkerId, int], dict[WorkerId, TierPages]]]:
        """`overlaps` of each prompt, walked together (as `match_many`)."""
        return [
            self._overlaps(p) if pages is None else (pages, {})
            for pages, p in zip(self._walked_many(prompts, keys), prompts, strict=True)
        ]

    def prefix_table(
        self, prompts: Sequence[Sequence[PageHash]], keys: PromptKeys | None = None
    ) -> PrefixTable:
        """`overlaps_many` as a `PrefixTable`: every worker's prefix of every prompt of the
        batch from one compiled call, laid out with two numpy calls and no Python step per
        prompt (but for the prompts with pages off the device, or of another width, counted
        as `overlaps` counts them). What a sharded router asks each shard for a batch of
        routes."""
        lengths = np.zeros((len(prompts), len(self._by_slot)), np.int64)
        tiered: dict[int, Overlaps] = {}
        if keys is None:
            keys = PromptKeys.of(prompts)
        walker = self._store.walker
        k = self._store.walk(keys)
        general: Iterable[int] = range(len(prompts))
        if k is not None:
            lengths[walker.prompt[:k], walker.slot[:k]] = walker.length[:k]
            general = np.flatnonzero(walker.flagged[: len(prompts)]).tolist()
        for i in general:
            pages, tiers = found = self._overlaps(prompts[i])
            for wid, n in pages.items():
                lengths[i, self._workers[wid].shift // _BITS] = n
            if tiers:
                tiered[i] = found
        return PrefixTable(tuple(self._by_slot), lengths, tiered)

    def _walked_into(self, keys: PromptKeys, pages: dict[WorkerId, int]) -> bool:
        """Adds the compiled walk's answer for `keys`' one prompt (each worker's held prefix)
        to `pages`; False, adding nothing, where the general path answers (digests of
        another width, a page held off the device, whose tiers it counts)."""
        store = self._store
        k = store.walk(keys)
        if k is None:
            return False
        walker = store.walker
        if walker.flagged[0]:
            return False
        slots, lengths = walker.out[1:, :k].tolist()
        pages.update(zip(map(self._live_slots().__getitem__, slots), lengths, strict=True))
        return True

    def _walked_many(
        self, prompts: Sequence[Sequence[PageHash]], keys: PromptKeys | None
    ) -> list[dict[WorkerId, int] | None]:
        """`_walked` of each prompt, from one compiled call for them all."""
        if keys is None:
            keys = PromptKeys.of(prompts)
        store = self._store
        k = store.walk(keys)
        if k is None:
            return [None] * len(prompts)
        walker = store.walker
        slots, lengths = walker.out[1:, :k].tolist()
        names = list(map(self._live_slots().__getitem__, slots))
        counts = np.bincount(walker.prompt[:k], minlength=len(prompts)).tolist()
        flagged = walker.flagged[: len(prompts)].tolist()
        out: list[dict[WorkerId, int] | None] = []
        at = 0
        for n, off in zip(counts, flagged, strict=True):
            pages = dict(zip(names[at : at + n], lengths[at : at + n], strict=True))
            out.append(None if off else pages)
            at += n
        return out

    def _live_slots(self) -> list[WorkerId]:
        """Worker ids by slot, for slots a walk found in some holder mask: only live slots'
        bits are in masks (`check_invariants`), so none of them is None."""
        return cast(list[WorkerId], self._by_slot)

    def _overlaps(
        self, hashes: Sequence[PageHash]
    ) -> tuple[dict[WorkerId, int], dict[WorkerId, TierPages]]:
        """`overlaps` by the general path (`PageStore.holder_ids`, then `_prefixes`), tiers
        counted: where the compiled walk does not serve or flagged a page off the device."""
        pages, tiers = self._prefixes(self._store.holder_ids(hashes))
        if not tiers & self._ones * 0b1110:
            return pages, {}
        return pages, self.tier_pages(hashes, self._result(pages, tiers, len(hashes)))

    def _walk(self, hashes: Sequence[PageHash]) -> MatchResult:
        """`match` by the general path (`PageStore.holder_ids`, then `_prefixes`), with each
        worker's tiers: where the compiled walk does not serve or flagged a page off the
        device."""
        pages, tiers = self._prefixes(self._store.holder_ids(hashes))
        return self._result(pages, tiers, len(hashes))

    def _result(self, pages: dict[WorkerId, int], tiers: int, num_hashes: int) -> MatchResult:
        """The `MatchResult` of `_prefixes`' answer."""
        if not tiers & self._ones * 0b1110:  # every page on the device only: the common case
            return MatchResult(pages, dict.fromkeys(pages, _GPU_ONLY), num_hashes, True)
        tier_names: dict[WorkerId, tuple[str, ...]] = {}
        for wid in pages:
            pos = self._workers[wid].shift
            tier_names[wid] = _TIERS_OF_BITS[tiers >> pos & _WORKER_BITS]
        return MatchResult(pages, tier_names, num_hashes)

    def _prefixes(self, holder_ids: Sequence[int]) -> tuple[dict[WorkerId, int], int]:
        """Each worker's held prefix length for these holder-mask ids, and the tier bits of
        every page in some worker's prefix (each at its worker's nibble)."""
        masks = self._store.masks
        alive = self._ones
        tiers = 0
        dropped: list[tuple[int, int]] = []
        n = 0
        last = -1
        still = alive
        for mid in holder_ids:
            if not mid:
                break
            if mid == last:  # same holders as the page before: nobody drops out
                n += 1
                continue
            last = mid
            m = masks[mid]
            x = m | m >> 2  # fold each worker's four tier bits onto its lowest bit
            still = (x | x >> 1) & alive
            if still != alive:
                if n:
                    dropped.append((alive & ~still, n))
                alive = still
                if not still:
                    break
            tiers |= m & (still * _WORKER_BITS)
            n += 1
        if alive and n:
            dropped.append((alive, n))
        pages: dict[WorkerId, int] = {}
        wids_of = self._wids_of
        for bits, length in dropped:
            wids = wids_of.get(bits)
            if wids is None:
                wids = self._workers_of(bits)
            pages.update(dict.fromkeys(wids, length))
        return pages, tiers

    def _workers_of(self, bits: int) -> tuple[WorkerId, ...]:
        """The workers whose nibble's low bit `bits` sets, in slot order (cached)."""
        out: list[WorkerId] = []
        by_slot = self._by_slot
        rest = bits
        while rest:
            low = rest & -rest
            wid = by_slot[(low.bit_length() - 1) >> 2]
            if wid is not None:
                out.append(wid)
            rest ^= low
        if len(self._wids_of) >= 4096:  # bounded: distinct holder sets of live prefixes
            self._wids_of.clear()
        wids = self._wids_of[bits] = tuple(out)
        return wids

    def tier_pages(
        self, hashes: Sequence[PageHash], matched: MatchResult
    ) -> dict[WorkerId, TierPages]:
        """Per worker of `matched` (a `match` of `hashes`) with pages off the device tier: how
        many of its matched pages sit in each tier (`coordinator.tiers`).

        Workers whose matched prefix is all on the device are left out, so a cluster without
        lower tiers pays nothing beyond `match`; otherwise one pass over the longest such
        prefix, a Python step per run of pages with the same holders per tiered worker.
        """
        if matched.device_only:  # the walk saw no page off the device: the common case
            return {}
        names = matched.tiers
        if list(names.values()).count(_GPU_ONLY) == len(names):  # one C pass
            return {}
        tiered = [
            (wid, n)
            for wid, n in matched.pages.items()
            if matched.tiers.get(wid, ("gpu",)) != ("gpu",) and wid in self._workers
        ]
        if not tiered:
            return {}
        longest = max(n for _, n in tiered)
        shifts = [(wid, n, self._workers[wid].shift) for wid, n in tiered]
        counts = {wid: [0, 0, 0, 0] for wid, _ in tiered}
        masks = self._store.masks
        runs: list[tuple[int, int]] = []  # (mask id, pages) in prompt order
        for mid in self._store.holder_ids(hashes[:longest]):
            if runs and runs[-1][0] == mid:
                runs[-1] = (mid, runs[-1][1] + 1)
            else:
                runs.append((mid, 1))
        start = 0
        for mid, length in runs:
            m = masks[mid]
            for wid, n, shift in shifts:
                if start >= n:
                    continue
                bits = m >> shift & _WORKER_BITS
                if bits:  # the cheapest tier holding it: a page mid-move is usable where it is
                    counts[wid][(bits & -bits).bit_length() - 1] += min(length, n - start)
            start += length
        return {wid: TierPages(*c) for wid, c in counts.items()}

    def holders(self, page_hash: PageHash) -> dict[WorkerId, tuple[str, ...]]:
        """Who holds one page, and in which tiers."""
        m = self._store.mask(page_hash)
        out: dict[WorkerId, tuple[str, ...]] = {}
        for wid, w in self._workers.items():
            bits = m >> w.shift & _WORKER_BITS
            if bits:
                out[wid] = _TIERS_OF_BITS[bits]
        return out

    def parent(self, page_hash: PageHash) -> PageHash | None:
        """The page before `page_hash` in its chain; raises `KeyError` if nobody holds it."""
        return self._store.parent(page_hash)

    def chain(self, page_hash: PageHash) -> list[PageHash]:
        """The held chain ending at `page_hash`, first page first, as far back as it is indexed."""
        out: list[PageHash] = []
        h: PageHash | None = page_hash
        seen: set[PageHash] = set()
        while h is not None and h in self._store and h not in seen:
            seen.add(h)
            out.append(h)
            h = self._store.parent(h)
        out.reverse()
        return out

    def __len__(self) -> int:
        """Distinct pages indexed."""
        return len(self._store)

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._store

    def all_pages(self) -> set[PageHash]:
        return set(self._store.pages())

    def num_entries(self) -> int:
        """(worker, page) pairs indexed."""
        return self._store.num_entries()

    def extra_bytes(self) -> int:
        """Memory the index holds outside Python's allocator (its roaring bitmaps), for benchmarks."""
        return self._store.extra_bytes()

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> bytes:
        """The whole index as msgpack (deterministic order; no pickle). Held-back batches are not kept."""
        order = sorted(self._workers)
        pos = {wid: i for i, wid in enumerate(order)}
        workers = [
            [
                wid,
                w.incarnation,
                w.last_seq,
                w.last_ts,
                w.stale,
                w.needs_snapshot or bool(w.pending),
                w.registered,
                list(w.retired),
            ]
            for wid, w in ((wid, self._workers[wid]) for wid in order)
        ]
        pages: list[list[Any]] = []
        held_of: dict[int, list[int]] = {}  # pages share holder masks: spell each out once
        for h, parent, m in self._store.items():
            held = held_of.get(m)
            if held is None:
                held = []
                for wid in order:
                    bits = m >> self._workers[wid].shift & _WORKER_BITS
                    if bits:
                        held.extend((pos[wid], bits))
                held_of[m] = held
            pages.append([h, parent, held])
        return msgpack.packb(
            {
                "format": SNAPSHOT_FORMAT,
                "version": SNAPSHOT_VERSION,
                "default_tier": self.default_tier,
                "workers": workers,
                "pages": pages,
            },
            use_bin_type=True,
        )

    def restore(self, data: bytes) -> None:
        """Replace the whole index with a `snapshot()`; on any error raise `InvalidInput`, change nothing."""
        fresh = GlobalIndex(
            require_registration=self.require_registration,
            default_tier=self.default_tier,
            reorder_window=self.reorder_window,
        )
        try:
            fresh._load(data)
        except InvalidInput:
            raise
        except Exception as exc:  # msgpack and type errors of a malformed snapshot
            raise InvalidInput(f"not a kvmesh index snapshot: {exc}") from exc
        fresh.check_invariants()
        self._store = fresh._store
        self._workers = fresh._workers
        self._by_slot = fresh._by_slot
        self._free_slots = fresh._free_slots
        self._ones = fresh._ones
        self._wids_of.clear()

    def _load(self, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInput(f"an index snapshot must be bytes, got {type(data).__name__}")
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        if not isinstance(raw, dict) or raw.get("format") != SNAPSHOT_FORMAT:
            raise InvalidInput("not a kvmesh index snapshot (missing format tag)")
        if raw.get("version") != SNAPSHOT_VERSION:
            raise InvalidInput(
                f"index snapshot version {raw.get('version')!r} is not {SNAPSHOT_VERSION}"
            )
        ws: list[_Worker] = []
        for item in raw["workers"]:
            wid, inc, last, last_ts, stale, needs, registered, retired = item
            if not isinstance(wid, str) or not wid or wid in self._workers:
                raise InvalidInput(f"index snapshot: bad or repeated worker id {wid!r}")
            if inc is not None and not isinstance(inc, str):
                raise InvalidInput(f"index snapshot: bad incarnation for {wid!r}")
            if type(last) is not int or last < -1:
                raise InvalidInput(f"index snapshot: bad last seq for {wid!r}")
            if not isinstance(last_ts, float | int) or isinstance(last_ts, bool):
                raise InvalidInput(f"index snapshot: bad last timestamp for {wid!r}")
            if not all(isinstance(x, bool) for x in (stale, needs, registered)):
                raise InvalidInput(f"index snapshot: bad flags for {wid!r}")
            if not isinstance(retired, list) or not all(isinstance(r, str) for r in retired):
                raise InvalidInput(f"index snapshot: bad retired incarnations for {wid!r}")
            w = self._new_worker(WorkerId(wid), registered)
            w.incarnation, w.last_seq, w.stale, w.needs_snapshot = inc, last, stale, needs
            w.last_ts = float(last_ts)
            w.retired.extend(retired)
            ws.append(w)
        hashes: list[PageHash] = []
        parents: list[PageHash | None] = []
        masks: list[int] = []
        for item in raw["pages"]:
            h, parent, held = item
            _check_hash(h, "index snapshot page")
            if parent is not None:
                _check_hash(parent, "index snapshot parent")
            if not isinstance(held, list) or not held or len(held) % 2:
                raise InvalidInput("index snapshot: a page must list (worker, tier bits) pairs")
            mask = 0
            for i in range(0, len(held), 2):
                k, bits = held[i], held[i + 1]
                if type(k) is not int or not 0 <= k < len(ws):
                    raise InvalidInput(f"index snapshot: page names unknown worker {k!r}")
                if type(bits) is not int or not 0 < bits <= _WORKER_BITS:
                    raise InvalidInput(f"index snapshot: bad tier bits {bits!r}")
                mask |= bits << ws[k].shift
            hashes.append(PageHash(h))
            parents.append(None if parent is None else PageHash(parent))
            masks.append(mask)
        if len(set(hashes)) != len(hashes):
            raise InvalidInput("index snapshot: a page is listed twice")
        self._store.load(hashes, parents, masks, [w.shift // _BITS for w in ws])

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` with the bad state if the index is inconsistent. O(entries)."""
        ones = 0
        for wid, w in self._workers.items():
            slot = w.shift // _BITS
            if self._by_slot[slot] != wid:
                raise InvariantViolation(f"slot {slot} names {self._by_slot[slot]!r}, not {wid!r}")
            ones |= 1 << w.shift
        if ones != self._ones:
            raise InvariantViolation(f"live-slot mask {self._ones:#x} != {ones:#x}")
        self._store.check_invariants([w.shift // _BITS for w in self._workers.values()])
        for wid, w in self._workers.items():
            if w.pending and not w.stale:
                raise InvariantViolation(
                    f"{wid!r} holds back {len(w.pending)} batches but is not stale"
                )

    def iter_workers(self) -> Iterator[WorkerIndexState]:
        for wid in sorted(self._workers):
            yield self.worker_state(wid)
