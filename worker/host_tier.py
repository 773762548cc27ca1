"""The host tier: pages the device pool evicted, kept in host memory until they are hit again.

One tensor ``[num_pages, *page_shape]`` in host memory (pinned when the
device is a GPU, so copies both ways are DMA; a plain second CPU pool on CPU
machines) and ``hash -> entry`` in LRU order. Invariants:

- a hash is held at most once (the tiers are exclusive: a promoted page leaves
  this tier, a spilled one leaves the device's cached set);
- every entry owns one slot; a slot is free, owned by exactly one entry, or
  reserved by an entry `detach`ed for a promotion until it is `release`d;
- `tenant_pages` counts the entries per tenant, and each tenant's entries are
  also queued in LRU order on their own, so fair eviction takes a tenant's
  oldest without reordering anyone's (`kvmesh.worker.tenant_share`).

The tier stores and gives back bytes; it emits no events and takes no locks
(`TieredCache` does both). Not thread-safe.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvmesh.errors import ConfigError, InvalidInput, InvariantViolation
from kvmesh.types import PageHash
from kvmesh.worker.page_pool import PageMeta
from kvmesh.worker.tenant_share import (
    EvictionPolicy,
    LruEviction,
    QueuedCandidates,
    TenantQueues,
)


@dataclass(frozen=True, slots=True)
class HostEntry:
    meta: PageMeta
    slot: int


@dataclass(frozen=True, slots=True)
class HostPut:
    """What `HostTier.put` did: pages newly held, entries evicted for room (with their
    bytes, oldest first), and pages passed that did not fit at all (with their bytes)."""

    kept: list[PageMeta]
    evicted: list[tuple[PageMeta, Tensor]]
    overflow: list[tuple[PageMeta, Tensor]]


class HostTier:
    """A fixed number of host-memory page slots with LRU (or fair-share) eviction.

    Costs: `get`, `touch`, `take` O(1); `put` O(pages evicted) (fair: x log tenants).
    """

    __slots__ = (
        "_entries",
        "_free",
        "_queues",
        "_reserved",
        "data",
        "num_pages",
        "policy",
        "tenant_pages",
    )

    def __init__(
        self,
        num_pages: int,
        page_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        pin_memory: bool = False,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if num_pages < 1:
            raise ConfigError(f"a host tier needs at least 1 page, got {num_pages}")
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("pinned host memory needs CUDA; pin_memory=False on CPU machines")
        self.num_pages = num_pages
        self.data = torch.empty((num_pages, *page_shape), dtype=dtype, pin_memory=pin_memory)
        self.policy: EvictionPolicy = policy or LruEviction()
        self._entries: OrderedDict[PageHash, HostEntry] = OrderedDict()
        self._queues: TenantQueues[PageHash] = TenantQueues()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._reserved: set[int] = set()  # slots of detached entries, until released
        self.tenant_pages: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._entries

    def entries(self) -> Iterator[HostEntry]:
        """Entries oldest first (the next to be evicted first)."""
        return iter(self._entries.values())

    def get(self, page_hash: PageHash) -> HostEntry | None:
        return self._entries.get(page_hash)

    def touch(self, page_hash: PageHash) -> None:
        """Make an entry the most recently used."""
        self._entries.move_to_end(page_hash)
        self._queues.push(page_hash, self._entries[page_hash].meta.tenant)

    def put(self, metas: Sequence[PageMeta], pages: Tensor) -> HostPut:
        """Keep `pages` (``[len(metas), *page_shape]``, any device) under `metas`.

        Evicts what must go first (its bytes copied out for the tier below); of
        more pages than the tier can take (its slots, less those `detach`ed) only
        the last stay (the rest come back as overflow). Hashes already held are
        refreshed, not copied again. Each page is copied straight into its slot
        (device to pinned memory: a DMA on a GPU).
        """
        if pages.shape[0] != len(metas) or tuple(pages.shape[1:]) != tuple(self.data.shape[1:]):
            raise InvalidInput(
                f"host tier takes pages of shape {list(self.data.shape[1:])}, got "
                f"{list(pages.shape)} for {len(metas)} pages"
            )
        keep = [i for i, m in enumerate(metas) if m.page_hash not in self._entries]
        for m in metas:
            if m.page_hash in self._entries:
                self.touch(m.page_hash)
        room = len(self._free) + len(self._entries)
        overflow = keep[: max(0, len(keep) - room)]
        keep = keep[len(overflow) :]
        evicted: list[tuple[PageMeta, Tensor]] = []
        short = len(keep) - len(self._free)
        if short > 0:
            victims = self.policy.choose(
                QueuedCandidates(self._entries.__iter__, self._queues),
                self.tenant_pages,
                self.num_pages,
                short,
                metas[keep[0]].tenant,
            )
            if len(victims) < short:
                raise InvariantViolation(
                    f"host tier found {len(victims)} of {short} victims among "
                    f"{len(self._entries)} entries and {len(self._free)} free slots"
                )
            for h in victims:
                entry = self._release(h)
                evicted.append((entry.meta, self.data[entry.slot].clone()))
        spilled = [(metas[i], pages[i].to("cpu", copy=True)) for i in overflow]
        kept: list[PageMeta] = []
        data = self.data
        for i in keep:
            slot = self._free.pop()
            data[slot].copy_(pages[i])  # blocking: the slot is read as soon as it is held
            meta = metas[i]
            self._entries[meta.page_hash] = HostEntry(meta, slot)
            self._queues.push(meta.page_hash, meta.tenant)
            self.tenant_pages[meta.tenant] += 1
            kept.append(meta)
        return HostPut(kept, evicted, spilled)

    def detach(self, page_hashes: Sequence[PageHash]) -> list[HostEntry]:
        """Take entries out of the tier (all must be held) but keep their slots reserved,
        so the caller can copy from `page` while others spill in; then `release` them."""
        missing = [h.hex()[:16] for h in page_hashes if h not in self._entries]
        if missing:
            raise InvalidInput(f"host tier does not hold {missing}")
        entries = [self._forget(h) for h in page_hashes]
        self._reserved.update(e.slot for e in entries)
        return entries

    def page(self, entry: HostEntry) -> Tensor:
        """A view of a held or detached entry's bytes in host memory."""
        return self.data[entry.slot]

    def release(self, entries: Iterable[HostEntry]) -> None:
        """Free the slots of `detach`ed entries."""
        for e in entries:
            self._reserved.discard(e.slot)
            self._free.append(e.slot)

    def discard(self, page_hashes: Sequence[PageHash]) -> list[PageMeta]:
        """Forget entries (those held); returns their metadata."""
        return [self._release(h).meta for h in page_hashes if h in self._entries]

    def clear(self) -> list[PageMeta]:
        return self.discard(list(self._entries))

    def _release(self, page_hash: PageHash) -> HostEntry:
        entry = self._forget(page_hash)
        self._free.append(entry.slot)
        return entry

    def _forget(self, page_hash: PageHash) -> HostEntry:
        entry = self._entries.pop(page_hash)
        tenant = entry.meta.tenant
        self._queues.remove(page_hash, tenant)
        self.tenant_pages[tenant] -= 1
        if not self.tenant_pages[tenant]:
            del self.tenant_pages[tenant]
        return entry

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` unless slots, entries and tenant counts agree."""
        owned = [e.slot for e in self._entries.values()]
        if len(set(owned)) != len(owned) or set(owned) & (set(self._free) | self._reserved):
            raise InvariantViolation(
                f"host tier slots are shared: owned {owned}, free {self._free}, "
                f"reserved {sorted(self._reserved)}"
            )
        if len(owned) + len(self._free) + len(self._reserved) != self.num_pages:
            raise InvariantViolation(
                f"host tier has {len(owned)} owned + {len(self._free)} free + "
                f"{len(self._reserved)} reserved slots of {self.num_pages}"
            )
        counts = Counter(e.meta.tenant for e in self._entries.values())
        if counts != self.tenant_pages:
            raise InvariantViolation(
                f"host tier tenant counts {dict(self.tenant_pages)} != {counts}"
            )
        by_tenant: dict[str | None, list[PageHash]] = {}
        for h, e in self._entries.items():
            by_tenant.setdefault(e.meta.tenant, []).append(h)
        queued = self._queues.as_lists()
        if queued != by_tenant:
            raise InvariantViolation(
                "host tier tenant queues are not its entries per tenant in LRU order"
            )
        for h, e in self._entries.items():
            if e.meta.page_hash != h:
                raise InvariantViolation(
                    f"host entry {h.hex()[:16]} carries {e.meta.page_hash.hex()[:16]}"
                )
