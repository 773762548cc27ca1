"""Who loses a page when a tier is full: plain LRU, or LRU within a tenant's fair share.

A tenant is what already isolates requests in the cache: the cache salt,
named by `kvmesh.tenants.tenant_of` (a digest; weights: `kvmesh.tenants.TenantWeights`,
the config's ``CoordinatorConfig.tenant_weights``, one setting for the
router's shares and the workers' eviction).

Each tier (device pool, host, disk) keeps how many pages each tenant holds,
its evictable pages oldest first, all together and per tenant (`TenantQueues`),
and asks an `EvictionPolicy` which of them to drop:

- `lru`: the oldest, whoever holds them (the baseline);
- `fair`: a tenant's share is ``capacity * weight / sum of weights`` over the
  tenants holding pages and the one asking for room. Victims are, first,
  candidates that hold no cached data (free device pages); then each tenant's
  oldest, one at a time from the tenant furthest above its share while any is
  above it (counting each victim as it is taken, so nobody is cut below its
  share); then the requesting tenant's own oldest; only then anyone's, the tenant
  least below its share first. So a tenant below its share loses a page to a
  tenant above it only when every page of that tenant is in use by running
  requests (held pages cannot be evicted).

Fair eviction takes each tenant's victims from the head of that tenant's own
queue and moves nobody else's page, so every tenant's pages leave in their LRU
order, as they would alone (docs/tiers.md says what reordering them cost).

Cost: `lru` O(n); `fair` O(n log T + T) for n victims among T tenants, whatever
the number of pages.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Generic, Protocol, TypeVar

from kvmesh.errors import ConfigError, InvariantViolation
from kvmesh.tenants import TenantWeights

K = TypeVar("K", bound=Hashable)
K_co = TypeVar("K_co", bound=Hashable, covariant=True)


class EvictionCandidates(Protocol[K_co]):
    """A tier's evictable entries, oldest first: all of them, or one tenant's."""

    def oldest(self) -> Iterator[K_co]:
        """Every candidate, the next to be evicted under plain LRU first."""
        ...

    def oldest_of(self, tenant: str | None) -> Iterator[K_co]:
        """One tenant's candidates, oldest first (None: those holding no cached data)."""
        ...


class TenantQueues(Generic[K]):
    """Each tenant's keys in LRU order, oldest first, beside a tier's order of all keys.

    `push` adds a key (or refreshes it) as the tenant's most recent; `remove`
    takes it out. O(1) each (an `OrderedDict` per tenant).
    """

    __slots__ = ("_queues",)

    def __init__(self) -> None:
        self._queues: dict[str | None, OrderedDict[K, None]] = {}

    def push(self, key: K, tenant: str | None) -> None:
        self.push_n(((key, tenant),))

    def push_n(self, items: Iterable[tuple[K, str | None]]) -> None:
        """`push` each ``(key, tenant)`` in order (one call for a request's pages)."""
        queues = self._queues
        for key, tenant in items:
            queue = queues.get(tenant)
            if queue is None:
                queue = queues[tenant] = OrderedDict()
            elif key in queue:
                queue.move_to_end(key)
                continue
            queue[key] = None

    def remove_n(self, items: Iterable[tuple[K, str | None]]) -> None:
        """`remove` each ``(key, tenant)``."""
        queues = self._queues
        for key, tenant in items:
            queue = queues.get(tenant)
            if queue is None or queue.pop(key, _MISSING) is _MISSING:
                raise InvariantViolation(f"{key!r} is not among tenant {tenant!r}'s eviction queue")
            if not queue:
                del queues[tenant]

    def remove(self, key: K, tenant: str | None) -> None:
        """Take `key` out of `tenant`'s queue; `InvariantViolation` if it is not there."""
        self.remove_n(((key, tenant),))

    def oldest_of(self, tenant: str | None) -> Iterator[K]:
        return iter(self._queues.get(tenant, ()))

    def clear(self) -> None:
        self._queues.clear()

    def as_lists(self) -> dict[str | None, list[K]]:
        """Every tenant's keys, oldest first (for invariant checks and tests)."""
        return {t: list(q) for t, q in self._queues.items()}


_MISSING = object()


class QueuedCandidates(Generic[K]):
    """Candidates as a tier keeps them: its order of all keys and its `TenantQueues`,
    less `skip` (a key that must not be its own victim)."""

    __slots__ = ("_all", "_queues", "_skip")

    def __init__(
        self,
        oldest: Callable[[], Iterator[K]],
        queues: TenantQueues[K],
        skip: K | None = None,
    ) -> None:
        self._all = oldest
        self._queues = queues
        self._skip = skip

    def oldest(self) -> Iterator[K]:
        skip = self._skip
        return (k for k in self._all() if k != skip) if skip is not None else self._all()

    def oldest_of(self, tenant: str | None) -> Iterator[K]:
        skip = self._skip
        keys = self._queues.oldest_of(tenant)
        return (k for k in keys if k != skip) if skip is not None else keys

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[K, str | None]]) -> QueuedCandidates[K]:
        """Candidates from ``(key, tenant)`` pairs, oldest first (small tiers, tests)."""
        listed = list(pairs)
        queues: TenantQueues[K] = TenantQueues()
        for key, tenant in listed:
            queues.push(key, tenant)
        return cls(lambda: (key for key, _ in listed), queues)


class EvictionPolicy(Protocol):
    """Chooses which `n` of a tier's eviction candidates to drop."""

    def choose(
        self,
        candidates: EvictionCandidates[K],
        counts: Mapping[str, int],
        capacity: int,
        n: int,
        requester: str | None = None,
    ) -> list[K]:
        """Up to `n` distinct keys among `candidates`, in the order they would be evicted.

        `counts`: pages each tenant holds in the tier (evictable or not); `requester`:
        the tenant the room is made for (None: unknown). Fewer than `n` only when there
        are fewer candidates. Changes nothing: the tier removes the keys it is given.
        """
        ...


class LruEviction:
    """The oldest candidates, whoever holds them."""

    name = "lru"

    def choose(
        self,
        candidates: EvictionCandidates[K],
        counts: Mapping[str, int],
        capacity: int,
        n: int,
        requester: str | None = None,
    ) -> list[K]:
        if n <= 0:
            return []
        return list(islice(candidates.oldest(), n))


class FairShareEviction:
    """Free candidates, then each tenant's oldest from the tenant furthest above its share,
    then the requester's own, then anyone's; see the module docstring."""

    name = "fair"

    def __init__(self, weights: TenantWeights | None = None) -> None:
        self.weights = weights or TenantWeights()

    def choose(
        self,
        candidates: EvictionCandidates[K],
        counts: Mapping[str, int],
        capacity: int,
        n: int,
        requester: str | None = None,
    ) -> list[K]:
        if n <= 0:
            return []
        out = list(islice(candidates.oldest_of(None), n))
        if len(out) == n:
            return out
        left = {t: c for t, c in counts.items() if c > 0}
        if requester is not None and requester not in left:
            # a tenant asking for room is entitled to its share before it holds a page
            shares = self.weights.shares({**left, requester: 1}, capacity)
        else:
            shares = self.weights.shares(left, capacity)
        queues: dict[str, Iterator[K]] = {}

        def next_of(tenant: str) -> K | None:
            queue = queues.get(tenant)
            if queue is None:
                queue = queues[tenant] = candidates.oldest_of(tenant)
            return next(queue, None)

        def take(above_only: bool) -> None:
            # the tenant furthest above its share first (ties: by name, for a stable order)
            heap = [(shares.get(t, 0.0) - c, t) for t, c in left.items()]
            heapq.heapify(heap)
            while heap and len(out) < n:
                below, tenant = heap[0]
                if above_only and below >= 0:
                    return
                # as many as it gives before another tenant is further above (or it reaches
                # its share): one slice of its queue, not a heap step per page
                budget = n - len(out)
                if above_only:
                    budget = min(budget, math.ceil(-below))
                if len(heap) > 1:
                    second = min(entry[0] for entry in heap[1:3])
                    budget = min(budget, max(1, math.floor(second - below) + 1))
                queue = queues.get(tenant)
                if queue is None:
                    queue = queues[tenant] = candidates.oldest_of(tenant)
                got = list(islice(queue, budget))
                out.extend(got)
                left[tenant] -= len(got)
                if len(got) < budget:  # every page it has left is held
                    heapq.heappop(heap)
                else:
                    heapq.heapreplace(heap, (below + len(got), tenant))

        take(above_only=True)
        if requester is not None and requester in left:
            while len(out) < n:
                key = next_of(requester)
                if key is None:
                    break
                out.append(key)
                left[requester] -= 1
        if len(out) < n:
            take(above_only=False)
        if len(out) < n:  # candidates of tenants `counts` does not name (a tier's bug)
            chosen = set(out)
            out.extend(islice((k for k in candidates.oldest() if k not in chosen), n - len(out)))
        return out


EVICTION_POLICIES: dict[str, type[LruEviction] | type[FairShareEviction]] = {
    "lru": LruEviction,
    "fair": FairShareEviction,
}
"""Registry of eviction policies by the name the config uses."""


def make_eviction(name: str, weights: TenantWeights | None = None) -> EvictionPolicy:
    """The policy called `name`; `ConfigError` names the choices."""
    if name == "fair":
        return FairShareEviction(weights)
    if name == "lru":
        return LruEviction()
    raise ConfigError(
        f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
    )
