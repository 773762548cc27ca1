"""Typed identifiers shared by every component.

They are `NewType`s so that mypy keeps a page hash, a page id and a worker id
apart while they cost nothing at run time.
"""

from __future__ import annotations

from typing import NewType

PageHash = NewType("PageHash", bytes)
"""Chained page identity: H(parent, token ids, extra keys); 32 bytes (SHA-256) or 16 (xxh3-128)."""

PageId = NewType("PageId", int)
"""Index of a page in one worker's pool and KV tensor; 0 is the null page."""

WorkerId = NewType("WorkerId", str)
"""Stable name of a worker in the cluster (e.g. ``worker-0``)."""

NULL_PAGE_ID = PageId(0)

TIERS = ("gpu", "cpu", "disk")
"""Storage tiers (the ``medium`` of a KV event) the index knows about."""
