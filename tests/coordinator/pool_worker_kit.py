"""The worker side of the coordinator's contract, for tests without Ray.

A real `PagePool` serves requests; its events leave as encoded batches
with one seq counter, and a snapshot takes the next seq (what a worker
sends when the coordinator asks to rebuild its pages).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.coordination import WorkerRegistration
from kvmesh.coordinator.service import Coordinator
from kvmesh.events import encode_batch, make_batch
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.page_pool import PagePool


def serve_request(pool: PagePool, hashes: Sequence[PageHash]) -> int:
    """Run one request through `pool` as a worker does (hit, allocate, cache, free), so the
    pool's events are a worker's; returns the pages hit."""
    hit = pool.match_prefix(hashes, len(hashes))
    pool.touch(hit)
    pages = hit + pool.get_new_pages(len(hashes) - len(hit))
    pool.cache_full_pages(pages, hashes, len(hit), len(hashes))
    pool.free_pages(list(reversed(pages)))
    return len(hit)


class PoolWorker:
    """A worker's side: a real pool, its seq counter, its incarnation."""

    def __init__(
        self, worker_id: str, num_pages: int = 64, incarnation: str = "inc-1", page_size: int = 4
    ) -> None:
        self.worker_id = WorkerId(worker_id)
        self.incarnation = incarnation
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size=page_size)
        self.seq = 0

    def serve(self, hashes: Sequence[PageHash]) -> int:
        return serve_request(self.pool, hashes)

    def batch(self) -> bytes:
        data = encode_batch(
            make_batch(self.pool.take_events(), self.worker_id, self.incarnation, self.seq)
        )
        self.seq += 1
        return data

    def snapshot(self) -> bytes:
        self.pool.take_events()
        data = encode_batch(
            make_batch(
                self.pool.snapshot_events(),
                self.worker_id,
                self.incarnation,
                self.seq,
                snapshot=True,
            )
        )
        self.seq += 1
        return data

    def restart(self, incarnation: str) -> None:
        """A new life: an empty pool of the same size, seq from 0."""
        self.incarnation = incarnation
        self.pool = PagePool(self.pool.num_pages, page_size=self.page_size)
        self.seq = 0

    def register(self, coord: Coordinator, **kw: object) -> bool:
        reg = coord.register_worker(
            WorkerRegistration(
                self.worker_id,
                f"127.0.0.1:{5000 + len(self.worker_id)}",
                self.pool.num_pages - 1,
                self.incarnation,
                **kw,
            ),  # type: ignore[arg-type]
        )
        return reg.needs_snapshot
