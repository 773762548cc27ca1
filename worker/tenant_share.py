"""Who loses a page when a tier is full: plain LRU, or LRU within a tenant's fair share.

A tenant is what already isolates requests in the cache: the cache salt,
named by `kvmesh.tenants.tenant_of` (a digest; weights: `kvmesh.tenants.TenantWeights`,
the config's ``CoordinatorConfig.tenant_weights``, one setting for the
router's shares and the workers' eviction).

Each tier (device pool, host, disk) keeps how many pages each tenant holds
and asks an `EvictionPolicy` which of its candidates (oldest first) to drop:

- `lru`: the oldest, whoever holds them (the baseline);
- `fair`: a tenant's share is ``capacity * weight / sum of weights`` over the
  tenants holding pages and the one asking for room. Victims are taken, oldest first, only from tenants
  above their share (counting each victim as it is taken, so nobody is cut
  below its share); when none is left, from the requesting tenant's own
  pages; only then the oldest of anyone. So a tenant below its share loses a
  page to a tenant above it only when every page of that tenant is in use by
  running requests (held pages cannot be evicted).

Cost: a choice walks the candidates until it has enough victims, O(pages
walked); `lru` stops after `n`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from typing import Protocol, TypeVar

from kvmesh.errors import ConfigError
from kvmesh.tenants import TenantWeights

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class EvictionPolicy(Protocol):
    """Chooses which `n` of a tier's eviction candidates to drop."""

    def choose(
        self,
        candidates: Iterable[tuple[K, str | None]],
        counts: Mapping[str, int],
        capacity: int,
        n: int,
        requester: str | None = None,
    ) -> list[K]:
        """Up to `n` keys among `candidates` (oldest first; tenant None: holds no cached data).

        `counts`: pages each tenant holds in the tier; `requester`: the tenant the
        room is made for (None: unknown). Fewer than `n` only when there are fewer candidates.
        """
        ...


class LruEviction:
    """The oldest candidates, whoever holds them."""

    name = "lru"

    def choose(
        self,
        candidates: Iterable[tuple[K, str | None]],
        counts: Mapping[str, int],
        capacity: int,
        n: int,
        requester: str | None = None,
    ) -> list[K]:
        out: list[K] = []
        if n <= 0:
            return out
        for key, _ in candidates:
            out.append(key)
            if len(out) == n:
                break
        return out


class FairShareEviction:
    """Oldest first from tenants above their share, then the requester's own, then anyone's."""

    name = "fair"

    def __init__(self, weights: TenantWeights | None = None) -> None:
        self.weights = weights or TenantWeights()

    def choose(
        self,
        candidates: Iterable[tuple[K, str | None]],
        counts: Mapping[str, int],
        capacity: int,
        n: int,
        requester: str | None = None,
    ) -> list[K]:
        out: list[K] = []
        if n <= 0:
            return out
        left = dict(counts)
        if requester is not None and not left.get(requester):
            left[requester] = 0
            # a tenant asking for room is entitled to its share before it holds a page
            shares = self.weights.shares({**left, requester: 1}, capacity)
        else:
            shares = self.weights.shares(left, capacity)
        own: list[K] = []
        rest: list[K] = []
        for key, tenant in candidates:
            if tenant is None or left.get(tenant, 0) > shares.get(tenant, 0.0):
                out.append(key)
                if tenant is not None:
                    left[tenant] -= 1
                if len(out) == n:
                    return out
            elif tenant == requester:
                own.append(key)
            else:
                rest.append(key)
        for key in own + rest:
            out.append(key)
            if len(out) == n:
                break
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


def second_chance(entries: OrderedDict[K, V], victims: list[K], walked: list[K]) -> list[K]:
    """Move the keys a choice walked past (`walked` less `victims`) to the end of `entries`,
    in their order, so the next choice does not walk them again; returns `victims`."""
    chosen = set(victims)
    for key in walked:
        if key not in chosen:
            entries.move_to_end(key)
    return victims
