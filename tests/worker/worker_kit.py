"""What the in-process worker-actor tests share: a small config, fresh prompts, two workers.

Heartbeats are made rare so that only explicit flushes (and the flush after
each request) report to the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig
from kvmesh.hashing import PageHasher
from kvmesh.types import WorkerId
from kvmesh.worker.actor import GenerateRequest, WorkerActor, WorkerSpec

BASE = dataclasses.replace(
    ClusterConfig(),
    pool=PoolConfig(num_pages=64),
    coordinator=CoordinatorConfig(heartbeat_interval_s=3600.0, heartbeat_timeout_s=3600.0),
)
PAGE = BASE.hash.page_size
HASHER = PageHasher.from_config(BASE.hash)


class Prompts:
    """Random prompts and requests from one seeded RNG (a module's own stream)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def prompt(self, pages: int) -> tuple[int, ...]:
        """`pages` full pages plus 3 tokens."""
        vocab = BASE.model.vocab_size
        return tuple(self._rng.randrange(vocab) for _ in range(pages * PAGE + 3))

    def request(self, tokens: tuple[int, ...], max_tokens: int = 3, **kw: Any) -> GenerateRequest:
        return GenerateRequest(f"r{self._rng.getrandbits(48):x}", tokens, max_tokens, **kw)


@contextlib.contextmanager
def two_workers(config: ClusterConfig, coordinator: Any) -> Iterator[list[WorkerActor]]:
    """Workers w0 and w1 in this process, registered with `coordinator`; shut down after."""
    made = [WorkerActor(WorkerSpec(WorkerId(f"w{i}"), config), coordinator) for i in range(2)]
    try:
        yield made
    finally:
        for w in made:
            w.shutdown()
