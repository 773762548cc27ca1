"""A worker's cache tiers: device pool -> host memory -> local disk, one stream of events.

::

    device PagePool + KVStore ("gpu")  ── evicted hash ──►  HostTier ("cpu")  ── evicted ──►  DiskTier ("disk")
              ▲                                                │                               │
              └──────────── promote (a hit in a lower tier) ◄──┴───────────────────────────────┘

The API the worker, the simulator and the benchmarks use:

- ``TieredCache(pool, store, host_pages=..., disk_dir=..., disk_bytes=...,
  eviction="lru" | "fair", weights=..., lock=...)`` attaches itself to the pool
  (`for_worker` builds it from a worker's config): every
  hash the pool evicts (its last copy) is copied into the host tier before the
  page can be overwritten, or onto disk when there is no host tier; what the
  host tier evicts goes to disk; what the disk evicts is gone.
- `promote(hashes, max_pages)`: the pages after the device's own prefix of
  `hashes` that a lower tier holds (up to the first miss) are copied into
  device pages and cached there, so the cache manager's lookup hits them. A
  `KVCacheManager` built with ``tiers=`` calls it on every lookup; the worker's
  page service calls it before it serves a pull, so peers read host and disk too.
- `prefetch(hashes, max_pages)`, called without the lock right before such a
  lookup, reads the disk pages the promotion will need, so the promotion under
  the lock only copies.
- Events: every change of every tier goes into the pool's one stream
  (`take_events`), its `medium` naming the tier ("gpu", "cpu", "disk", the
  index's tier names). A move is a `PagesStored` in the new tier and a
  `PagesRemoved` from the old one, stored first, so the index never sees the
  page nowhere. `snapshot_events` lists all tiers (parents first); a
  restarted worker's adopted disk pages are in it.
- Tenants: each tier counts pages per tenant and evicts with the same policy
  (`kvmesh.worker.tenant_share`); ``kvmesh_tier_pages{tier, tenant}`` shows them.

Tiers are mostly exclusive (a promoted page leaves its tier; a spilled hash
leaves the device's cached set), but a hash recomputed on the device while a
lower tier still holds it stays in both until one of them evicts it; events
say exactly which tiers hold what.

Costs: a spill copies the evicted pages once, straight into their pinned
host slots, inside the allocation that evicts them; with `lock`, disk writes
(temp file, fsync, rename) run on a `DiskWriter` thread and disk reads in
`prefetch`, both outside the lock, so a request never waits for the disk over
pages it does not need; a promotion copies only the pages the request hits.
Not thread-safe apart from those two: the worker's pool lock covers every
call, as for the pool itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor

from kvmesh.config import ClusterConfig, PoolConfig
from kvmesh.errors import ConfigError, DiskPageCorrupt, InvariantViolation
from kvmesh.events import PagesRemoved, PagesStored
from kvmesh.metrics import (
    DISK_PAGES_DROPPED,
    TIER_EVICTIONS,
    TIER_PAGES,
    TIER_PROMOTIONS,
    TIER_SPILLS,
)
from kvmesh.tenants import TenantWeights
from kvmesh.types import PageHash, PageId
from kvmesh.worker.cache_manager import KVCacheManager
from kvmesh.worker.disk_tier import DiskTier
from kvmesh.worker.free_queue import KVPage
from kvmesh.worker.host_tier import HostEntry, HostTier
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_pool import PageMeta, PagePool, wire_tenant
from kvmesh.worker.page_service import PageService
from kvmesh.worker.tenant_share import EvictionPolicy, make_eviction

log = logging.getLogger(__name__)

DEVICE = "gpu"
HOST = "cpu"
DISK = "disk"
TIER_ORDER = (DEVICE, HOST, DISK)
MAX_STAGED_PAGES = 4096
"""Disk pages `prefetch` may hold in memory for promotions to come."""
"""Tier names as KV events' `medium` (the coordinator index's names), fastest first."""


def page_blob(page: Tensor, dtype_name: str) -> PageBlob:
    """One page tensor's raw bytes (any device, any dtype, bf16 too) as a checked blob."""
    raw = page.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return PageBlob.from_bytes(raw, dtype_name, tuple(page.shape))


class TieredCache:
    """The device pool with a host tier and a disk tier below it; see the module docstring."""

    def __init__(
        self,
        pool: PagePool,
        store: KVStore,
        *,
        host_pages: int = 0,
        disk_dir: str | Path | None = None,
        disk_bytes: int = 0,
        disk_fsync: bool = True,
        disk_adopt: bool = True,
        eviction: str = "lru",
        weights: TenantWeights | None = None,
        pin_memory: bool | None = None,
        worker: str = "worker",
        lock: AbstractContextManager[object] | None = None,
        max_queued_writes: int = 1024,
    ) -> None:
        if store.num_pages != pool.num_pages:
            raise ConfigError(
                f"KV store has {store.num_pages} pages, the pool {pool.num_pages}: build both "
                "from one PoolConfig"
            )
        if host_pages < 0 or disk_bytes < 0:
            raise ConfigError(
                f"host_pages and disk_bytes must be >= 0, got {host_pages} and {disk_bytes}"
            )
        if disk_dir and not disk_bytes:
            raise ConfigError(f"disk_dir={str(disk_dir)!r} needs a disk_bytes budget > 0")
        if pool.num_cached_hashes() and pool.medium != DEVICE:
            raise ConfigError(
                f"attach tiers to a pool before it caches anything (its events name "
                f"{pool.medium!r}; with tiers the device tier is {DEVICE!r})"
            )
        if pool.spill_listener is not None:
            raise ConfigError("this pool already has tiers attached")
        pool.medium = DEVICE
        self.pool = pool
        self.store = store
        self.worker = worker
        self.policy: EvictionPolicy = make_eviction(eviction, weights)
        if eviction != "lru":
            pool.eviction = self.policy
        pin = store.device.type == "cuda" if pin_memory is None else pin_memory
        self.host: HostTier | None = (
            HostTier(host_pages, store.page_shape, store.dtype, pin_memory=pin, policy=self.policy)
            if host_pages
            else None
        )
        self.disk: DiskTier | None = (
            DiskTier(
                disk_dir,
                disk_bytes,
                dtype=store.dtype_name,
                page_shape=store.page_shape,
                fsync=disk_fsync,
                policy=self.policy,
                adopt=disk_adopt,
                worker=worker,
            )
            if disk_dir
            else None
        )
        self._published: dict[str, set[str]] = {tier: set() for tier in TIER_ORDER}
        # with the owner's lock, disk writes and reads leave the request path: a DiskWriter
        # writes evictions, `prefetch` reads a request's disk pages before it takes the lock
        self._lock = lock
        self._staged: dict[PageHash, tuple[PageMeta, PageBlob] | DiskPageCorrupt] = {}
        self.writer: DiskWriter | None = (
            DiskWriter(self, self.disk, lock, max_queued_writes)
            if self.disk is not None and lock is not None
            else None
        )
        pool.spill_listener = self._spill
        pool.snapshot_hook = self.snapshot_events
        self.publish()

    @classmethod
    def from_config(
        cls,
        pool: PagePool,
        store: KVStore,
        cfg: PoolConfig,
        weights: TenantWeights | None = None,
        worker: str = "worker",
        lock: AbstractContextManager[object] | None = None,
    ) -> TieredCache:
        """Tiers as `cfg` asks (`weights`: the cluster's, ``CoordinatorConfig.tenant_weights``;
        `lock`: the owner's, to write disk pages in the background)."""
        return cls(
            pool,
            store,
            host_pages=cfg.host_pages,
            disk_dir=cfg.disk_dir or None,
            disk_bytes=cfg.disk_bytes,
            disk_fsync=cfg.disk_fsync,
            disk_adopt=cfg.disk_adopt,
            eviction=cfg.eviction,
            weights=weights,
            worker=worker,
            lock=lock,
        )

    @classmethod
    def for_worker(
        cls,
        config: ClusterConfig,
        manager: KVCacheManager,
        store: KVStore,
        service: PageService | None = None,
        worker: str = "worker",
    ) -> TieredCache | None:
        """The tiers `config` asks for, attached to a worker's cache manager (lookups promote)
        and page service (pulls promote; its lock covers background disk writes), or None
        when it asks for none.

        The disk tier lives in ``disk_dir/<worker>``: workers of one machine given the
        same folder never adopt or delete each other's pages, and a worker restarted
        under its name adopts its own.
        """
        cfg = config.pool
        if not (cfg.host_pages or cfg.disk_dir or cfg.eviction != "lru"):
            return None
        if cfg.disk_dir:
            cfg = dataclasses.replace(cfg, disk_dir=str(Path(cfg.disk_dir) / _folder_name(worker)))
        weights = TenantWeights.parse(config.coordinator.tenant_weights)
        lock = service.lock if service is not None else None
        tiers = cls.from_config(manager.pool, store, cfg, weights, worker, lock)
        manager.attach_tiers(tiers)
        if service is not None:
            service.tiers = tiers
        return tiers

    # ---------------------------------------------------------------- lookups

    def tier_of(self, page_hash: PageHash) -> str | None:
        """The fastest tier holding `page_hash`, or None."""
        if self.pool.get_cached_page(page_hash) is not None:
            return DEVICE
        if self.host is not None and page_hash in self.host:
            return HOST
        if self.disk is not None and page_hash in self.disk:
            return DISK
        return None

    def hashes_by_tier(self) -> dict[str, set[PageHash]]:
        """Every tier's cached hashes (what replaying the events per medium gives)."""
        return {
            DEVICE: self.pool.cached_hashes(),
            HOST: set() if self.host is None else {e.meta.page_hash for e in self.host.entries()},
            DISK: set() if self.disk is None else {e.meta.page_hash for e in self.disk.entries()},
        }

    def tenant_pages(self) -> dict[str, Mapping[str, int]]:
        """Pages per tenant in each tier."""
        return {
            DEVICE: dict(self.pool.tenant_pages),
            HOST: {} if self.host is None else dict(self.host.tenant_pages),
            DISK: {} if self.disk is None else dict(self.disk.tenant_pages),
        }

    # ---------------------------------------------------------------- spilling

    def _spill(self, evicted: list[tuple[PageId, PageMeta]]) -> None:
        """The pool evicted these hashes' last pages: keep their bytes a tier lower."""
        self._count_evictions(DEVICE, [meta for _, meta in evicted])
        if self.host is None and self.disk is None:
            self.publish()
            return
        ids = [pid for pid, _ in evicted]
        metas = [meta for _, meta in evicted]
        data = self.store.read_pages(ids)
        if self.host is not None:
            put = self.host.put(metas, data)
            self._stored(put.kept, HOST)
            self._count_evictions(HOST, [m for m, _ in put.evicted + put.overflow])
            self._to_disk(put.evicted + put.overflow)
            self._removed([m for m, _ in put.evicted], HOST)
        else:
            self._to_disk(list(zip(metas, data, strict=True)))
        self.publish()

    def _to_disk(self, pages: Iterable[tuple[PageMeta, Tensor]]) -> None:
        disk = self.disk
        if disk is None:
            return
        if self.writer is not None:
            self.writer.submit(pages)
            return
        dtype = self.store.dtype_name
        for meta, page in pages:
            if meta.page_hash in disk:
                disk.put(meta, page_blob(page, dtype))  # refreshes its place in the LRU
                continue
            self._on_disk(meta, disk.put(meta, page_blob(page, dtype)))

    def _on_disk(self, meta: PageMeta, dropped: list[PageMeta]) -> None:
        """`meta` entered the disk tier, `dropped` left it for room: say so."""
        self._stored([meta], DISK)
        self._count_evictions(DISK, dropped)
        self._removed(dropped, DISK)

    def _count_evictions(self, tier: str, metas: Iterable[PageMeta]) -> None:
        for tenant, n in Counter(m.tenant for m in metas).items():
            TIER_EVICTIONS.labels(self.worker, tier, tenant).inc(n)

    def admit_written(self, meta: PageMeta, size: int) -> None:
        """A background write of `meta` finished (`DiskWriter`; the owner's lock is held)."""
        disk = self.disk
        if disk is None:
            return
        if meta.page_hash in disk:
            disk.admit(meta, size)  # refreshed; the file was replaced by the same bytes
            return
        self._on_disk(meta, disk.admit(meta, size))
        self.publish()

    def flush(self) -> None:
        """Wait until every queued disk write is on disk and admitted (call without the lock)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Finish the queued disk writes and stop the writer thread."""
        if self.writer is not None:
            self.writer.close()

    def _stored(self, metas: Sequence[PageMeta], tier: str) -> None:
        size = self.pool.page_size
        for m in metas:
            self.pool.record(
                PagesStored(
                    (m.page_hash,), m.parent_hash, (), size, m.lora_id, tier, wire_tenant(m.tenant)
                )
            )
        if metas:
            TIER_SPILLS.labels(self.worker, tier).inc(len(metas))

    def _removed(self, metas: Sequence[PageMeta], tier: str) -> None:
        """One `PagesRemoved` per tenant (an event names one tenant)."""
        by_tenant: dict[str, list[PageHash]] = {}
        for m in metas:
            by_tenant.setdefault(m.tenant, []).append(m.page_hash)
        for tenant, hashes in by_tenant.items():
            self.pool.record(PagesRemoved(tuple(hashes), tier, wire_tenant(tenant)))

    # ---------------------------------------------------------------- promoting

    def promote(self, page_hashes: Sequence[PageHash], max_pages: int) -> int:
        """Bring the lower tiers' pages that extend the device's prefix into the device pool.

        Walks `page_hashes` after the device pool's own prefix (at most `max_pages`
        in all) up to the first hash no tier holds, and only as many pages as the
        pool has free. The pages arrive cached and free (ref count 0), most recently
        used, so the caller's lookup hits them. A corrupted disk page ends the run
        there (it is dropped, counted and recomputed by the caller). Returns the
        number of pages promoted.
        """
        host, disk, pool = self.host, self.disk, self.pool
        if host is None and disk is None:
            return 0
        limit = min(max_pages, len(page_hashes))
        prefix = pool.match_prefix(page_hashes, limit)
        run: list[PageHash] = []
        for i in range(len(prefix), limit):
            h = page_hashes[i]
            if (host is None or h not in host) and (disk is None or h not in disk):
                break
            run.append(h)
        if not run:
            return 0
        pool.touch(prefix)  # a small pool must not evict the prefix to make room
        pages: list[KVPage] = []
        taken: list[tuple[PageMeta, HostEntry | PageBlob, str]] = []
        try:
            taken = self._take_run(run[: pool.get_num_free_pages()])
            if taken:
                pages = pool.get_new_pages(len(taken), taken[0][0].tenant)
                self._write(pages, taken)
                for page, (meta, _, _) in zip(pages, taken, strict=True):
                    pool.cache_page(
                        page, meta.page_hash, meta.parent_hash, (), meta.lora_id, meta.tenant
                    )
        finally:
            # stored on the device first (above), then gone from the tier below
            for tier in (HOST, DISK):
                moved = [m for m, _, src in taken if src == tier]
                if moved:
                    self._removed(moved, tier)
                    TIER_PROMOTIONS.labels(self.worker, tier).inc(len(moved))
            if host is not None:
                host.release(e for _, e, _ in taken if isinstance(e, HostEntry))
            pool.free_pages(reversed(prefix + pages))
            self.publish()
        return len(taken)

    def _take_run(self, run: list[PageHash]) -> list[tuple[PageMeta, HostEntry | PageBlob, str]]:
        """Take the run's pages out of their tiers, in order, up to a corrupted disk page
        (dropped and its removal recorded). Host pages stay in their (reserved) slots, so
        spills while the device makes room cannot overwrite them; disk pages are read."""
        taken: list[tuple[PageMeta, HostEntry | PageBlob, str]] = []
        host, disk = self.host, self.disk
        i = 0
        while i < len(run):
            end = i
            while host is not None and end < len(run) and run[end] in host:
                end += 1
            if end > i and host is not None:
                taken.extend((e.meta, e, HOST) for e in host.detach(run[i:end]))
                i = end
                continue
            h = run[i]
            i += 1
            if disk is None:
                break
            staged = self._staged.pop(h, None)
            entry = disk.get(h)
            got: tuple[PageMeta, PageBlob] | None
            try:
                if isinstance(staged, DiskPageCorrupt):
                    raise staged
                if staged is not None and entry is not None:
                    disk.discard([h])  # read by `prefetch`: only the file is left to delete
                    got = staged
                else:
                    got = disk.take(h)  # drops and counts a bad file itself
            except DiskPageCorrupt as exc:
                if isinstance(staged, DiskPageCorrupt):
                    disk.drop_bad(h, exc.reason)
                if entry is not None:
                    self._removed([entry.meta], DISK)
                break
            if got is None:
                break
            taken.append((got[0], got[1], DISK))
        return taken

    def prefetch(self, page_hashes: Sequence[PageHash], max_pages: int) -> int:
        """Read from disk, without the owner's lock, the pages a `promote` of the same
        hashes would read, so that the promotion (under the lock) only copies them and
        requests that need other pages never wait for this disk. Call it without the
        lock, right before the lookup; returns the pages read. Needs the lock the tiers
        were built with (else it does nothing and `promote` reads)."""
        disk, lock = self.disk, self._lock
        if disk is None or lock is None:
            return 0
        with lock:
            limit = min(max_pages, len(page_hashes))
            start = len(self.pool.match_prefix(page_hashes, limit))
            wanted: list[PageHash] = []
            for i in range(start, limit):
                h = page_hashes[i]
                if self.host is not None and h in self.host:
                    continue
                if h not in disk:
                    break
                wanted.append(h)
        read: dict[PageHash, tuple[PageMeta, PageBlob] | DiskPageCorrupt] = {}
        for h in wanted:
            try:
                read[h] = disk.read(h)
            except DiskPageCorrupt as exc:
                read[h] = exc  # dropped by the promotion, under the lock
                break
        with lock:
            if len(self._staged) + len(read) > MAX_STAGED_PAGES:
                self._staged.clear()  # left by lookups that never promoted
            self._staged.update(read)
        return len(read)

    def _write(
        self, pages: list[KVPage], taken: list[tuple[PageMeta, HostEntry | PageBlob, str]]
    ) -> None:
        """Copy each taken page into its device page (from pinned host memory: a DMA)."""
        for page, (_, data, _) in zip(pages, taken, strict=True):
            if isinstance(data, PageBlob):
                self.store.import_page(page.page_id, data, verified=True)
            elif self.host is not None:
                self.store.write_page(page.page_id, self.host.page(data))

    # ---------------------------------------------------------------- events

    def snapshot_events(self) -> list[PagesStored]:
        """Every tier's cached set as `PagesStored`, parents before children (one page each)."""
        size = self.pool.page_size
        out: list[PagesStored] = list(self.pool.device_snapshot_events())
        lower: list[tuple[PageMeta, str]] = []
        if self.host is not None:
            lower.extend((e.meta, HOST) for e in self.host.entries())
        if self.disk is not None:
            lower.extend((d.meta, DISK) for d in self.disk.entries())
        for m, tier in lower:
            out.append(
                PagesStored(
                    (m.page_hash,), m.parent_hash, (), size, m.lora_id, tier, wire_tenant(m.tenant)
                )
            )
        return _parents_first(out)

    def reset(self) -> None:
        """Forget every tier's pages (`PagesInUse` while requests hold device pages)."""
        self.pool.reset_prefix_cache()  # AllPagesCleared: the index forgets every tier
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        self.publish()

    def publish(self) -> None:
        """Set ``kvmesh_tier_pages{tier, tenant}`` from the tiers' counts (done at every
        eviction, promotion and reset; call it before reading the gauges otherwise)."""
        for tier, counts in self.tenant_pages().items():
            seen = self._published[tier]
            for tenant in seen - set(counts):
                TIER_PAGES.labels(self.worker, tier, tenant).set(0)
            for tenant, n in counts.items():
                TIER_PAGES.labels(self.worker, tier, tenant).set(n)
            self._published[tier] = set(counts)

    def check_invariants(self) -> None:
        """The pool's, each tier's, and the tiers' tenant counts (`InvariantViolation`)."""
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
            if len(self.host) > self.host.num_pages:
                raise InvariantViolation(
                    f"host tier holds {len(self.host)} > {self.host.num_pages}"
                )
        if self.disk is not None:
            self.disk.check_invariants(self.writer.in_flight() if self.writer else frozenset())


def _folder_name(worker: str) -> str:
    """A worker's name as one safe path component (a digest when it has other characters)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", worker):
        return worker
    return "w-" + hashlib.sha256(worker.encode()).hexdigest()[:32]


def _parents_first(events: list[PagesStored]) -> list[PagesStored]:
    """Order single-page events so that a page whose parent is listed comes after it."""
    known = {ev.page_hashes[0] for ev in events}
    by_parent: dict[PageHash | None, list[PagesStored]] = {}
    for ev in events:
        parent = ev.parent_hash if ev.parent_hash in known else None
        by_parent.setdefault(parent, []).append(ev)
    ordered: list[PagesStored] = []
    emitted: set[tuple[PageHash, str | None]] = set()
    stack = list(reversed(by_parent.get(None, [])))
    while stack:
        ev = stack.pop()
        key = (ev.page_hashes[0], ev.medium)
        if key in emitted:
            continue
        emitted.add(key)
        ordered.append(ev)
        stack.extend(reversed(by_parent.get(ev.page_hashes[0], [])))
    ordered.extend(ev for ev in events if (ev.page_hashes[0], ev.medium) not in emitted)
    return ordered


class DiskWriter:
    """Writes the host tier's evictions to the disk tier off the request path (one thread).

    `submit` never blocks: a page that finds `max_queued` pages waiting is dropped
    (it was evicted; the disk just never sees it) and counted as a disk eviction.
    The thread writes each file (temp, fsync, rename) without the owner's lock and
    then admits it under the lock, recording its `PagesStored`; until then a lookup
    misses it. A failed write (disk full, I/O error) drops the page, logged and
    counted (``kvmesh_disk_pages_dropped_total{reason="write_error"}``).
    """

    def __init__(
        self,
        tiers: TieredCache,
        disk: DiskTier,
        lock: AbstractContextManager[object],
        max_queued: int,
    ) -> None:
        self._tiers = tiers
        self._disk = disk
        self._lock = lock
        self._queue: queue.Queue[tuple[PageMeta, Tensor] | None] = queue.Queue(max(1, max_queued))
        self._pending: set[PageHash] = set()
        self._state = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"kvmesh-disk-writer-{tiers.worker}", daemon=True
        )
        self._thread.start()

    def submit(self, pages: Iterable[tuple[PageMeta, Tensor]]) -> None:
        for meta, page in pages:
            with self._state:
                self._pending.add(meta.page_hash)
            try:
                self._queue.put_nowait((meta, page))
            except queue.Full:
                with self._state:
                    self._pending.discard(meta.page_hash)
                TIER_EVICTIONS.labels(self._tiers.worker, DISK, meta.tenant).inc()

    def in_flight(self) -> frozenset[PageHash]:
        """Hashes queued or being written (their files may exist before they are admitted)."""
        with self._state:
            return frozenset(self._pending)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        dtype = self._tiers.store.dtype_name
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                meta, page = item
                try:
                    size = self._disk.write(meta, page_blob(page, dtype))
                except OSError as exc:
                    log.warning(
                        "disk tier write of %s failed, page dropped: %s",
                        meta.page_hash.hex()[:16],
                        exc,
                    )
                    DISK_PAGES_DROPPED.labels(self._tiers.worker, "write_error").inc()
                    continue
                with self._lock:
                    self._tiers.admit_written(meta, size)
            finally:
                if item is not None:
                    with self._state:
                        self._pending.discard(item[0].page_hash)
                self._queue.task_done()
