"""A worker's load, the value workers report and the coordinator routes on.

It lives in the shared base because both sides use it: a worker builds one
for its heartbeat, the coordinator's registry and routing policies read it,
and neither may import the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.types import WorkerId


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as last reported (heartbeat) or as a simulator tracks it.

    `active_prefill_tokens`: prompt tokens queued or being computed (not the
    cached ones). `active_decode_pages`: pages held by running requests.
    `total_pages` 0 means capacity unknown (the worker is then never "full").
    """

    worker_id: WorkerId
    active_prefill_tokens: int = 0
    active_decode_pages: int = 0
    free_pages: int = 0
    total_pages: int = 0
    stale: bool = False
    draining: bool = False
    active_requests: int = 0

    def load_pages(self, page_size: int) -> float:
        """Queued prefill work plus held decode pages, in pages."""
        return self.active_prefill_tokens / page_size + self.active_decode_pages

    def fits(self, pages: int) -> bool:
        """Whether `pages` new pages can be allocated here (always, if capacity is unknown)."""
        return self.total_pages <= 0 or self.free_pages >= pages
