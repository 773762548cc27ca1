"""Tenants of the cache: their names and their weights, shared by workers and the coordinator.

A tenant is what already isolates requests in the cache, the ``cache_salt``
(bound to API keys by `kvmesh.security.TenantPolicy`): pages of different
salts never share a hash, so each cached page belongs to one tenant. Events,
config and metrics name a tenant by `tenant_of(salt)`, a short digest, so a
salt never reaches a label, a log or the wire.

A tenant's fair share of some capacity is ``capacity * weight / sum of the
weights of the tenants holding pages``; `TenantWeights.parse` reads the
config's ``"name=weight,..."`` (`CoordinatorConfig.tenant_weights`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmesh.errors import ConfigError

DEFAULT_TENANT = "default"
"""The tenant of requests without a cache salt (and of events that name none)."""


def tenant_of(cache_salt: str | None) -> str:
    """The name a salt's pages count against: `DEFAULT_TENANT`, or ``t-`` and 12 hex digits."""
    if not cache_salt:
        return DEFAULT_TENANT
    return "t-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class TenantWeights:
    """Weights by tenant name; a tenant not named weighs `default`."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default: float = 1.0

    def __post_init__(self) -> None:
        bad = {t: w for t, w in self.weights.items() if not (math.isfinite(w) and w > 0)}
        if not (math.isfinite(self.default) and self.default > 0):
            bad["(default)"] = self.default
        if bad:
            raise ConfigError(f"tenant weights must be positive finite numbers, got {bad}")

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default)

    def shares(self, counts: Mapping[str, int], capacity: float) -> dict[str, float]:
        """Each tenant holding pages in `counts`: its share of `capacity` pages, by weight."""
        active = [t for t, n in counts.items() if n > 0]
        total = sum(self.weight(t) for t in active)
        return {t: capacity * self.weight(t) / total for t in active}

    @classmethod
    def parse(cls, text: str) -> TenantWeights:
        """Weights from ``"name=weight,name=weight"``; `ConfigError` shows the expected form."""
        weights: dict[str, float] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = math.nan
            if not sep or not name.strip() or not (math.isfinite(weight) and weight > 0):
                raise ConfigError(
                    f"tenant weight {item!r} must read name=weight with a positive number, "
                    "e.g. 't-3f2a9c01b7de=2,default=1'"
                )
            weights[name.strip()] = weight
        return cls(weights)
