"""The serving path with tiers: a prefix evicted to host memory or disk is promoted, not
recomputed, and the answer is the model's own; the benchmark runs."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest
import torch

from kvmesh.benchmarks import bench_tiers
from kvmesh.config import ModelConfig
from kvmesh.hashing import ExtraKeys, PageHasher, RequestHashes
from kvmesh.worker.cache_manager import KVCacheManager
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.serving import ServingEngine
from kvmesh.worker.tiered_cache import DISK, HOST, TieredCache

PAGE = 8
CFG = ModelConfig(num_layers=2, prefill_chunk_tokens=3 * PAGE, device="cpu")


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CFG)


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


def engine_with_tiers(
    model: TinyTransformer, tmp_path: Path, host_pages: int
) -> tuple[ServingEngine, TieredCache]:
    pool = PagePool(7, page_size=PAGE)  # 6 pages: one 6-page prompt evicts another
    store = KVStore(7, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, PAGE, CFG.dtype)
    lock = threading.RLock()
    tiers = TieredCache(
        pool,
        store,
        host_pages=host_pages,
        disk_dir=tmp_path,
        disk_bytes=1 << 22,
        disk_fsync=False,
        lock=lock,
    )
    manager = KVCacheManager(pool, PAGE, tiers=tiers)
    return ServingEngine(model, manager, store, PageHasher(PAGE), lock=lock), tiers


@pytest.mark.parametrize(("host_pages", "tier"), [(16, HOST), (0, DISK)])
def test_an_evicted_prefix_is_promoted_and_the_answer_is_the_models_own(
    model: TinyTransformer, tmp_path: Path, host_pages: int, tier: str
) -> None:
    engine, tiers = engine_with_tiers(model, tmp_path, host_pages)
    salt = ExtraKeys(cache_salt="tenant-a")
    first = tokens(5 * PAGE + 3, seed=1)
    engine.serve("a", first, 4, extra_keys=salt)
    engine.serve("b", tokens(5 * PAGE + 3, seed=2), 4)
    tiers.flush()
    hashes = RequestHashes(PageHasher(PAGE), first, salt).hashes
    with engine.lock:
        assert [tiers.tier_of(h) for h in hashes] == [tier] * 5
    result = engine.serve("a2", first, 4, extra_keys=salt)
    assert result.pages_hit_local == 5 and result.pages_computed == 1
    assert list(result.tokens) == engine.compute_from_scratch(first, 4)
    tiers.close()


def test_the_tiers_benchmark_prints_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_tiers.configure(parser)
    args = parser.parse_args(["--pages", "4", "--repeats", "1", "--warm", "--json"])
    assert bench_tiers.run(args) == 0
    figures = json.loads(capsys.readouterr().out)
    for key in ("recompute_ms_per_page", "host_promote_ms_per_page", "disk_promote_ms_per_page"):
        assert figures[key] > 0
    assert (
        figures["host_vs_recompute"]
        == figures["recompute_ms_per_page"] / figures["host_promote_ms_per_page"]
    )
    assert figures["quiet_hit_ratio_alone"] == 1.0  # its 128 pages fit the 512-page pool
    assert figures["quiet_flooded_vs_alone_fair"] >= 0.9 > figures["quiet_flooded_vs_alone_lru"]
    assert figures["allocation_us_lru"] > 0 and figures["allocation_us_fair"] > 0
    assert figures["allocation_fair_vs_lru"] == (
        figures["allocation_us_fair"] / figures["allocation_us_lru"]
    )
