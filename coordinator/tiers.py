"""Where a worker's matched prefix lives (device, host, disk) and what reusing it costs.

Pure (no Ray, no gRPC). The index keeps each page's tier per worker in its
holder masks (four bits per worker: gpu, cpu, disk, other; see
`coordinator.index`), so a tier costs the index no memory per page beyond
the holder mask it already stores; a move between tiers is a `PagesStored`
in the new tier and a `PagesRemoved` in the old one. `GlobalIndex.tier_pages`
counts, per worker, how many pages of its matched prefix sit in each tier
(a page held in two tiers at once, mid-move, counts in the cheaper one).

`TierCosts` turns those counts into the cost `kv_aware` charges, in units of
recomputing one page (1.0)::

    device hit          0
    host hit            host_hit_cost   (copy into the device pool / prefill time)
    disk hit            disk_hit_cost   (read + copy / prefill time)
    pull from a peer    pull_cost       (transfer time / prefill time)
    recompute           1

Every cost is capped at 1: a tier slower than recomputing is recomputed
instead, so a hit there is never worse than a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import CoordinatorConfig
from kvmesh.errors import ConfigError

TIER_ORDER: tuple[str, ...] = ("gpu", "cpu", "disk", "other")
"""The index's tier bits in order, cheapest first (the same order as `index.TIER_NAMES`)."""


@dataclass(frozen=True, slots=True)
class TierPages:
    """How many pages of one worker's matched prefix sit in each tier."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.disk + self.other

    @property
    def lower(self) -> int:
        """Pages that must be promoted to the device before they serve (host, disk, other)."""
        return self.cpu + self.disk + self.other


@dataclass(frozen=True, slots=True)
class TierCosts:
    """Cost of reusing a page from each tier, as a fraction of recomputing it (capped at 1)."""

    host: float
    disk: float
    pull: float

    def __post_init__(self) -> None:
        for name in ("host", "disk", "pull"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise ConfigError(f"tier cost {name} must be a number >= 0, got {value!r}")

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> TierCosts:
        return cls(config.host_hit_cost, config.disk_hit_cost, config.pull_cost)

    @classmethod
    def from_ms(
        cls, prefill_page_ms: float, host_page_ms: float, disk_page_ms: float, pull_page_ms: float
    ) -> TierCosts:
        """Costs from measured times per page (e.g. `kvmesh bench tiers`, or a time model)."""
        if not prefill_page_ms > 0:
            raise ConfigError(f"prefill time per page must be positive, got {prefill_page_ms!r}")
        return cls(
            host_page_ms / prefill_page_ms,
            disk_page_ms / prefill_page_ms,
            pull_page_ms / prefill_page_ms,
        )

    def prefix_cost(self, pages: TierPages) -> float:
        """What reusing a held prefix costs, in recomputed pages: device pages are free."""
        lower_disk = pages.disk + pages.other
        return pages.cpu * min(self.host, 1.0) + lower_disk * min(self.disk, 1.0)

    @property
    def pull_saves(self) -> float:
        """What pulling a page saves against recomputing it (0 when pulling is no cheaper)."""
        return max(0.0, 1.0 - self.pull)
