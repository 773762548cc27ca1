"""What the reliability tests share: reference answers and a worker's true state, read from outside.

A worker's state is read only through its public surfaces: its gRPC server
(``Lookup`` for which pages it holds, ``FetchPages`` for their bytes and
checksums), its Ray actor (`stats`, `check_invariants`) and the coordinator
(`snapshot_index`, `workers`). Nothing here reaches into an actor's memory,
so a test sees what a peer or a router would see.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from kvmesh.config import ModelConfig, TransferConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.types import PageHash
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.transfer_client import SyncPeerClient

TRANSFER = TransferConfig(deadline_s=30.0)
KV_ATOL = 1e-4


def wait_until(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes; returns its last value."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


def random_prompt(rng: random.Random, pages: int, page_size: int, extra: int = 5) -> list[int]:
    """`pages` full pages plus `extra` tokens, byte-sized token ids."""
    return [rng.randrange(256) for _ in range(pages * page_size + extra)]


def held(address: str, hashes: Sequence[PageHash]) -> set[PageHash]:
    """The subset of `hashes` the worker at `address` holds (its gRPC ``Lookup``)."""
    if not hashes:
        return set()
    with SyncPeerClient(address, TRANSFER) as client:
        found = client.lookup(list(hashes))
    return {h for h, ok in zip(hashes, found, strict=True) if ok}


def page_blobs(address: str, hashes: Iterable[PageHash]) -> dict[PageHash, Any]:
    """Bytes (verified against their checksum) of the held pages among `hashes`, by hash."""
    wanted = sorted(set(hashes))
    if not wanted:
        return {}
    with SyncPeerClient(address, TRANSFER) as client:
        fetched = client.fetch_pages(wanted)
    return {p.page_hash: p.blob for p in fetched.pages}


def page_checksums(address: str, hashes: Iterable[PageHash]) -> dict[PageHash, int]:
    """Checksum of every held page among `hashes` (of the bytes it streams now)."""
    return {h: int(blob.checksum) for h, blob in page_blobs(address, hashes).items()}


def blob_tensor(blob: Any) -> torch.Tensor:
    """A received page's bytes as a tensor ``[L, 2, page_size, kv_heads, head_dim]``."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    flat = torch.frombuffer(bytearray(bytes(blob.data)), dtype=dtype[blob.dtype])
    return flat.reshape(tuple(blob.shape))


def reference_pages(model: TinyTransformer, tokens: Sequence[int], page_size: int) -> torch.Tensor:
    """The from-scratch KV of every full page of `tokens`: ``[n, L, 2, page_size, H, D]``."""
    n = len(tokens) // page_size
    kv = model.empty_kv(len(tokens))
    model.prefill_into(kv, 0, list(tokens))
    pages = kv[:, :, : n * page_size].reshape(
        model.num_layers, 2, n, page_size, model.num_kv_heads, model.head_dim
    )
    return pages.permute(2, 0, 1, 3, 4, 5).contiguous()


def assert_pages_match_reference(
    address: str,
    hashes: Sequence[PageHash],
    tokens: Sequence[int],
    model: TinyTransformer,
    page_size: int,
) -> int:
    """Every page of this prompt the worker holds equals the from-scratch KV; returns how many.

    A half-written page (zeros, another page's bytes, a torn copy) fails here.
    """
    blobs = page_blobs(address, hashes)
    ref = reference_pages(model, tokens, page_size)
    for i, h in enumerate(hashes):
        blob = blobs.get(h)
        if blob is None:
            continue
        got = blob_tensor(blob)
        if not torch.allclose(got, ref[i], atol=KV_ATOL, rtol=0):
            err = float((got - ref[i]).abs().max())
            raise AssertionError(f"page {i} ({h.hex()[:12]}) differs from scratch by {err}")
    return len(blobs)


def index_of(coordinator: Any) -> GlobalIndex:
    """A copy of the coordinator actor's index (its msgpack snapshot, restored here)."""
    import ray

    index = GlobalIndex()
    index.restore(ray.get(coordinator.snapshot_index.remote(), timeout=60))
    return index


def reference_model(config: ModelConfig) -> TinyTransformer:
    """The workers' model, built here (same seed: the same weights)."""
    return TinyTransformer(config)


def start_worker(
    config: Any,
    worker_id: str,
    *,
    page_delay_s: float = 0.0,
    num_cpus: float = 0.5,
) -> Any:
    """Start one more worker actor in `config`'s cluster namespace; returns its handle.

    It registers with the coordinator before this returns, as `kvmesh.app.connect`'s
    workers do, and a client finds it by name at its next route to it.
    """
    import ray

    from kvmesh.requests import WorkerSpec
    from kvmesh.types import WorkerId
    from kvmesh.worker.actor import WorkerActor, worker_actor_name

    ns = config.coordinator.namespace
    coordinator = ray.get_actor(config.coordinator.actor_name, namespace=ns)
    spec = WorkerSpec(WorkerId(worker_id), config, page_delay_s=page_delay_s)
    handle = (
        ray.remote(WorkerActor)
        .options(
            name=worker_actor_name(worker_id),
            namespace=ns,
            num_cpus=num_cpus,
            max_concurrency=8,
            max_restarts=0,
        )
        .remote(spec, coordinator)
    )
    ray.get(handle.info.remote(), timeout=300)
    return handle


@contextlib.contextmanager
def in_process_worker(spec: Any) -> Iterator[Any]:
    """A `WorkerActor` built in this process (no Ray, no coordinator), shut down on exit.

    A worker sets torch's thread count for its process; it is restored on exit
    so that the tests after it run as before.
    """
    from kvmesh.worker.actor import WorkerActor

    threads = torch.get_num_threads()
    worker = WorkerActor(spec)
    try:
        yield worker
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
