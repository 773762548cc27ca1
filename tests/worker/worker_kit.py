"""What the in-process worker-actor tests share: a small config, fresh prompts, two workers.

Heartbeats are made rare so that only explicit flushes (and the flush after
each request) report to the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig
from kvmesh.hashing import NO_EXTRA, ExtraKeys, PageHasher
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.requests import GenerateRequest, WorkerSpec
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.page_service import ProofBook

BASE = dataclasses.replace(
    ClusterConfig(),
    pool=PoolConfig(num_pages=64),
    coordinator=CoordinatorConfig(heartbeat_interval_s=3600.0, heartbeat_timeout_s=3600.0),
)
PAGE = BASE.hash.page_size
HASHER = PageHasher.from_config(BASE.hash)


class Recorder:
    """A `ChunkSink` keeping every chunk's fields and bytes (buffers of its own)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[pb.PageChunk, bytes]] = []

    def target(self, meta: pb.PageChunk, nbytes: int) -> memoryview:
        return memoryview(bytearray(nbytes))

    def landed(self, meta: pb.PageChunk, data: memoryview) -> None:
        self.chunks.append((meta, bytes(data)))


def proofs_for(hasher: PageHasher, tokens: Sequence[int], keys: ExtraKeys = NO_EXTRA) -> ProofBook:
    """What a receiver serving a request for `tokens` (with `keys`: salt, LoRA, media) can
    prove: every full page of it, from its own tokens, never from what a sender says."""
    hashes = hasher.hash_prompt(tokens, keys)
    return ProofBook.for_pages(hashes, tokens, keys, hasher.page_size)


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


def check_pull_from_nowhere_computes(worker: WorkerActor, prompts: Prompts, model: Any) -> None:
    """A pull from an address nobody serves fails quietly: every page computed, right answer."""
    tokens = prompts.prompt(3)
    dead = "127.0.0.1:1"  # no worker registered there, nothing listens
    result = worker.generate(prompts.request(tokens, 2, promised_pull=3, peer_address=dead))
    assert (result.pages_pulled, result.pages_computed) == (0, 4)
    assert result.pull_error is not None
    assert list(result.tokens) == model.generate(list(tokens), 2)


def check_push_then_decode(
    prefill: WorkerActor, decode: WorkerActor, prompts: Prompts, model: Any
) -> None:
    """Prefill pushes a 5-page prompt under the ticket the decode worker granted for it; once
    `prefill` returns the decode worker holds the pages and continues from them (only the
    partial page computed), with the right answer."""
    tokens = prompts.prompt(5)
    request = prompts.request(tokens)
    done = prefill.prefill(request, decode.address, decode.expect_push(request))
    assert (done.pages_pushed, done.push_error) == (5, None)
    assert HASHER.hash_prompt(tokens)[-1] in decode.pool.cached_hashes()
    result = decode.generate(prompts.request(tokens, 6, promised_local=5))
    assert (result.pages_hit_local, result.pages_computed) == (5, 1)
    assert list(result.tokens) == model.generate(list(tokens), 6)


@contextlib.contextmanager
def two_workers(config: ClusterConfig, coordinator: Any) -> Iterator[list[WorkerActor]]:
    """Workers w0 and w1 in this process, registered with `coordinator`; shut down after."""
    made = [WorkerActor(WorkerSpec(WorkerId(f"w{i}"), config), coordinator) for i in range(2)]
    try:
        yield made
    finally:
        for w in made:
            w.shutdown()
