"""The connector's store and seal without an engine: real stores on loopback gRPC.

`EngineStore` (the worker beside an engine) takes sealed blocks only with a
proof from their tokens, pulls what it lacks from a peer store, and answers
bad calls with clear errors; `unseal` refuses any page that is not the block
asked for, whole. Block digests come from `EngineHasher` (vLLM's own hash,
proven equal to the engine's by tests/engines/test_hash_parity.py).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import msgpack
import pytest
import torch

from kvmesh.benchmarks import bench_connector
from kvmesh.connector.block_path import BlockPath, KVLayers, PendingSave
from kvmesh.connector.blocks import (
    SEAL_BYTES,
    BlockRun,
    block_run,
    seal,
    sealed_page_bytes,
    unseal,
)
from kvmesh.connector.directories import StoreDirectories
from kvmesh.connector.engine_config import check_vllm_version, connector_config, prepare_wait_s
from kvmesh.connector.saver import BackgroundSaver
from kvmesh.connector.store_client import Located, StoreClient
from kvmesh.connector.store_launcher import StoreProcess, engine_block_nbytes
from kvmesh.engine_hash import EngineExtraKeys, EngineHasher
from kvmesh.errors import (
    ArenaUnavailable,
    ChecksumMismatch,
    ConfigError,
    HashMismatch,
    InvalidInput,
    KVMeshError,
    PageFormatError,
    TransportError,
)
from kvmesh.metrics import counter_value
from kvmesh.page_arena import ArenaLayout, PageDirectory, open_arena, page_key, sweep_stale
from kvmesh.worker.engine_store import EngineStore

B = 32
NBYTES = 1000
PAGE = sealed_page_bytes(NBYTES, B)
HASHER = EngineHasher("sha256", B, int_hashes=False)


def request(seed: int, blocks: int = 3, salt: str | None = None) -> tuple[BlockRun, list[bytes]]:
    """A request's full blocks as a run, and each block sealed (its bytes: the block index)."""
    tokens = [seed * 1000 + i for i in range(blocks * B + 5)]
    keys = EngineExtraKeys(cache_salt=salt)
    digests = list(HASHER.hash_blocks(tokens, keys).digests)
    extra = [keys.for_block(i * B, (i + 1) * B) for i in range(blocks)]
    run = block_run(digests, tokens, extra, 0, blocks, B)
    return run, [seal(d, bytes([i + 1]) * NBYTES, PAGE) for i, d in enumerate(digests)]


@pytest.fixture
def stores() -> Iterator[tuple[EngineStore, EngineStore]]:
    with (
        EngineStore(page_bytes=PAGE, block_size=B, num_pages=16, name="a") as a,
        EngineStore(page_bytes=PAGE, block_size=B, num_pages=16, name="b") as b,
    ):
        yield a, b


def client(store: EngineStore) -> StoreClient:
    return StoreClient(store.address, store.control_address, timeout_s=5.0)


# ------------------------------------------------------------------ the seal


def test_a_sealed_block_unseals_to_its_bytes() -> None:
    digest = HASHER.hash_blocks(list(range(B))).digests[0]
    page = seal(digest, b"\x05" * NBYTES, PAGE)
    assert len(page) == PAGE and PAGE % (2 * B) == 0 and PAGE >= NBYTES + SEAL_BYTES
    assert bytes(unseal(digest, page, NBYTES)) == b"\x05" * NBYTES


def test_unseal_refuses_changed_bytes_another_block_and_another_layout() -> None:
    first, second = HASHER.hash_blocks(list(range(2 * B))).digests
    page = bytearray(seal(first, b"\x05" * NBYTES, PAGE))
    with pytest.raises(HashMismatch, match="handed over"):
        unseal(second, page, NBYTES)
    with pytest.raises(PageFormatError, match="no seal"):
        unseal(first, page, NBYTES - 2)
    page[10] ^= 1
    with pytest.raises(ChecksumMismatch, match="recomputed"):
        unseal(first, page, NBYTES)


def test_a_block_too_big_for_the_page_is_refused_by_name() -> None:
    with pytest.raises(PageFormatError, match="sealed_page_bytes"):
        seal(bytes(32), bytes(PAGE), PAGE)
    with pytest.raises(InvalidInput):
        sealed_page_bytes(0, B)


# ------------------------------------------------------------------ the store


def test_the_store_keeps_proven_blocks_and_serves_them_sealed(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, _ = stores
    run, pages = request(1)
    c = client(a)
    assert c.save(run, pages) == [True, True, True]
    assert c.save(run, pages) == [False, False, False]  # held: never overwritten
    got = c.fetch(run.digests)
    assert [bytes(unseal(d, p, NBYTES))[:1] for d, p in zip(run.digests, got, strict=True)] == [
        b"\x01",
        b"\x02",
        b"\x03",
    ]


def test_a_block_whose_tokens_do_not_prove_its_digest_is_refused_and_nothing_is_kept(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, _ = stores
    run, pages = request(2)
    lying = BlockRun(run.parent, run.digests, tuple(t + 1 for t in run.tokens), run.extra)
    with pytest.raises(HashMismatch, match="do not hash to it"):
        client(a).save(lying, pages)
    assert a.service.prefix_length(run.digests) == 0


def test_a_forgotten_block_is_gone_and_can_be_saved_again(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, _ = stores
    run, pages = request(9)
    c = client(a)
    c.save(run, pages)
    assert c.forget(run.digests[1:2]) == 1
    assert a.service.prefix_length(run.digests) == 1
    assert c.fetch(run.digests)[1] is None
    assert c.save(run, pages) == [False, True, False]


def test_a_page_of_the_wrong_size_is_refused(stores: tuple[EngineStore, EngineStore]) -> None:
    a, _ = stores
    run, pages = request(3)
    with pytest.raises(PageFormatError, match="bytes"):
        client(a).save(run, [p[:-64] for p in pages])


def test_prepare_pulls_what_a_peer_holds_and_proves_it(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, b = stores
    run, pages = request(4, salt="tenant-1")
    client(a).save(run, pages)
    assert client(b).prepare(run).held == 0  # b has no peers of its own
    pulled = counter_value("kvmesh_engine_store_blocks", store="b", outcome="pulled")
    prepared = client(b).prepare(run, [a.address])
    assert (prepared.held, prepared.pulled, prepared.source) == (3, 3, a.address)
    assert counter_value("kvmesh_engine_store_blocks", store="b", outcome="pulled") == pulled + 3
    assert unseal(run.digests[2], client(b).fetch(run.digests)[2], NBYTES)[0] == 3


def test_another_tenants_request_neither_finds_nor_pulls_the_blocks(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, b = stores
    mine, pages = request(5, salt="tenant-1")
    client(a).save(mine, pages)
    theirs, _ = request(5, salt="tenant-2")
    assert set(theirs.digests).isdisjoint(mine.digests)
    assert client(b).prepare(theirs, [a.address]).held == 0


def test_a_dead_peer_leaves_prepare_with_what_the_store_holds(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    _, b = stores
    run, _ = request(6)
    assert client(b).prepare(run, ["127.0.0.1:1"]).held == 0


def test_malformed_control_calls_get_invalid_argument(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, _ = stores
    with grpc.insecure_channel(a.control_address) as channel:
        save = channel.unary_unary("/kvmesh.v1.EngineStore/Save")
        for body in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"digests": [b"x"]})):
            with pytest.raises(grpc.RpcError) as err:
                save(body, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_store_refuses_a_page_size_its_blocks_cannot_fill() -> None:
    with pytest.raises(ConfigError, match="sealed_page_bytes"):
        EngineStore(page_bytes=PAGE + 1, block_size=B)


def test_a_store_down_is_a_transport_error_not_a_hang() -> None:
    c = StoreClient("127.0.0.1:1", "127.0.0.1:1", timeout_s=1.0)
    run, _ = request(7)
    with pytest.raises(TransportError):
        c.prepare(run)
    with pytest.raises(TransportError):
        c.fetch(run.digests)


# ------------------------------------------------------------------ launcher, config, pin


def test_the_store_process_starts_serves_and_stops(tmp_path: Path) -> None:
    with StoreProcess(block_nbytes=NBYTES, block_size=B, pages=8, log_dir=tmp_path) as proc:
        run, pages = request(8)
        c = StoreClient(proc.page_address, proc.control_address)
        assert c.describe().page_bytes == PAGE
        assert c.save(run, pages) == [True] * 3
    assert not proc.running()


def test_a_block_is_sized_from_the_models_config(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 4, "num_key_value_heads": 8, "num_attention_heads": 8,
              "head_dim": 64, "hidden_size": 512, "dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert engine_block_nbytes(tmp_path, 32) == 4 * 2 * 32 * 8 * 64 * 2
    with pytest.raises(ConfigError, match=r"config\.json"):
        engine_block_nbytes(tmp_path / "nowhere", 32)


def test_the_connector_config_loads_the_connector_with_recompute_on_failure() -> None:
    config = json.loads(connector_config("127.0.0.1:1", "127.0.0.1:2", role="kv_consumer"))
    assert config["kv_connector_module_path"] == "kvmesh.connector.vllm_connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_role"] == "kv_consumer"
    with pytest.raises(ConfigError, match="kv_role"):
        connector_config("a:1", "a:2", role="both")


def test_the_connector_runs_only_on_the_vllm_line_it_targets() -> None:
    check_vllm_version("0.32.0")
    with pytest.raises(ConfigError, match=r"0\.32\.x"):
        check_vllm_version("0.33.1")


# ------------------------------------------------------------------ the background saver


def test_the_saver_seals_and_saves_in_order_off_the_callers_thread(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    a, _ = stores
    c = client(a)
    path = BlockPath(c, KVLayers([torch.zeros(4, NBYTES, dtype=torch.uint8)]), B, shm=False)
    saver = BackgroundSaver(path.send, store="saver-test")
    runs = [request(20 + i)[0] for i in range(3)]
    for run in runs:
        blocks = tuple(bytes([7]) * NBYTES for _ in run.digests)
        assert saver.submit(PendingSave(run, blocks=blocks))
    assert saver.flush(10)
    assert counter_value("kvmesh_connector_blocks", store="saver-test", outcome="saved") == 9
    for run in runs:
        assert a.service.prefix_length(run.digests) == 3
        assert bytes(unseal(run.digests[0], c.fetch(run.digests)[0], NBYTES))[:1] == b"\x07"
    saver.close()


def test_a_saver_whose_store_is_behind_drops_and_one_that_fails_reports() -> None:
    gate = threading.Event()
    errors: list[KVMeshError] = []

    def slow_send(pending: PendingSave) -> None:
        gate.wait(10)
        raise TransportError("store down")

    released: list[PendingSave] = []
    saver = BackgroundSaver(
        slow_send, release=released.append, max_pending=1, on_error=errors.append
    )
    run, _ = request(30)
    blocks = tuple(bytes(NBYTES) for _ in run.digests)
    results = [saver.submit(PendingSave(run, blocks=blocks)) for _ in range(4)]
    assert results[0] and not all(results)
    assert counter_value("kvmesh_connector_blocks", store="", outcome="dropped") >= 3
    assert len(released) == results.count(False)  # what a dropped save held is given back
    gate.set()
    assert saver.flush(10)
    assert counter_value("kvmesh_connector_blocks", store="", outcome="save_failed") >= 3
    assert isinstance(errors[0], TransportError)
    saver.close()


def test_a_store_proves_blocks_with_the_engines_hash_algorithm_and_seed() -> None:
    hasher = EngineHasher("sha256_cbor", B, seed="42", int_hashes=False)
    tokens = list(range(2 * B))
    digests = list(hasher.hash_blocks(tokens).digests)
    run = block_run(digests, tokens, [None, None], 0, 2, B)
    pages = [seal(d, bytes(NBYTES), PAGE) for d in digests]
    with EngineStore(page_bytes=PAGE, block_size=B, algo="sha256_cbor", seed="42") as cbor:
        assert client(cbor).save(run, pages) == [True, True]
        assert client(cbor).describe().algo == "sha256_cbor"
    with (
        EngineStore(page_bytes=PAGE, block_size=B, algo="sha256_cbor") as unseeded,
        pytest.raises(HashMismatch),
    ):
        client(unseeded).save(run, pages)  # the engine's seed is part of every digest
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        EngineStore(page_bytes=PAGE, block_size=B, algo="xxhash")


def test_a_connector_without_its_stores_addresses_is_refused_by_name() -> None:
    with pytest.raises(InvalidInput, match="kv_connector_extra_config"):
        StoreClient("", "127.0.0.1:2")
    with pytest.raises(InvalidInput, match="timeout_s"):
        StoreClient("127.0.0.1:1", "127.0.0.1:2", timeout_s=0)


@pytest.mark.parametrize("wait", [-1, "10", True, float("nan")])
def test_a_prepare_wait_that_is_not_milliseconds_is_refused_by_name(wait: object) -> None:
    with pytest.raises(ConfigError, match="prepare_wait_ms"):
        prepare_wait_s(wait)


def test_a_prepare_wait_is_read_in_milliseconds_with_a_default() -> None:
    assert prepare_wait_s(None) == 0.01
    assert prepare_wait_s(0) == 0.0
    assert prepare_wait_s(250) == 0.25


# ------------------------------------------------------------------ the shared-memory path

LAYERS, HEADS, HEAD_DIM, ENGINE_BLOCKS = 3, 2, 16, 16


def kv_cache(seed: int | None = None) -> list[torch.Tensor]:
    """An engine's paged KV cache: per layer [blocks, kv_heads, block_size, 2 x head_dim] bf16."""
    shape = (ENGINE_BLOCKS, HEADS, B, 2 * HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


KV_NBYTES = KVLayers(kv_cache()).block_nbytes
KV_PAGE = sealed_page_bytes(KV_NBYTES, B)


@pytest.fixture
def shm_store() -> Iterator[EngineStore]:
    with EngineStore(page_bytes=KV_PAGE, block_size=B, num_pages=16, staging_pages=8) as store:
        yield store


def engine_path(store: EngineStore | StoreProcess, layers: list[torch.Tensor]) -> BlockPath:
    address = store.address if isinstance(store, EngineStore) else store.page_address
    path = BlockPath(StoreClient(address, store.control_address), KVLayers(layers), B)
    path.connect()
    return path


def same_blocks(
    a: list[torch.Tensor], a_ids: list[int], b: list[torch.Tensor], b_ids: list[int]
) -> bool:
    return all(torch.equal(x[a_ids], y[b_ids]) for x, y in zip(a, b, strict=True))


def no_grpc_fetch(path: BlockPath) -> None:
    def refuse(digests: Sequence[bytes]) -> list[bytes | None]:
        raise AssertionError("the shared-memory path fetched pages over gRPC")

    path.client.fetch = refuse  # type: ignore[method-assign]


def test_blocks_move_through_shared_memory_as_the_engines_own_bytes(
    shm_store: EngineStore,
) -> None:
    source = kv_cache(seed=1)
    saving = engine_path(shm_store, source)
    assert saving.mapped is not None and saving.mapped.arena.layout.path.startswith("/dev/shm/")
    run, _ = request(40)
    pending = saving.stage(run, [5, 9, 2])
    assert pending is not None and pending.staged is saving.mapped and not pending.blocks
    assert saving.send(pending) == [True, True, True]
    assert shm_store.service.prefix_length(run.digests) == 3

    target = kv_cache()
    loading = engine_path(shm_store, target)
    no_grpc_fetch(loading)
    loaded = loading.load(run.digests, [0, 1, 2])
    assert (loaded.blocks, loaded.refused, loaded.error) == (3, None, None)
    assert same_blocks(source, [5, 9, 2], target, [0, 1, 2])
    assert not same_blocks(source, [5], target, [3])  # untouched blocks stay as they were


def saved_three_blocks(
    store: EngineStore, *, seed: int, n: int
) -> tuple[list[torch.Tensor], BlockRun]:
    """A KV cache of `seed` whose blocks 0-2 are saved to `store` as request `n`'s run."""
    source = kv_cache(seed=seed)
    path = engine_path(store, source)
    run, _ = request(n)
    pending = path.stage(run, [0, 1, 2])
    assert pending is not None
    path.send(pending)
    return source, run


def test_a_load_stops_at_the_first_block_the_store_lacks(shm_store: EngineStore) -> None:
    source, run = saved_three_blocks(shm_store, seed=2, n=41)
    shm_store.forget(run.digests[1:2])
    target = kv_cache()
    assert engine_path(shm_store, target).load(run.digests, [4, 5, 6]).blocks == 1
    assert same_blocks(source, [0], target, [4])


def test_the_directory_names_exactly_the_pages_the_store_holds(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    store = stores[0]
    assert store.arena is not None
    directory = open_arena(store.arena.layout).directory  # what an engine reads
    runs = [request(60 + i) for i in range(8)]  # 24 blocks through a 16-page store: evictions
    for run, pages in runs:
        client(store).save(run, pages)
    every = [d for run, _ in runs for d in run.digests]
    held = store.service.lookup(every)
    assert 0 < sum(held) < len(every)  # the oldest were evicted
    assert [bool(directory.leading([d])) for d in every] == held
    last = runs[-1][0].digests
    with store.service.pinned(last) as ids:
        assert directory.leading(last) == ids
    store.forget(last[1:2])
    assert directory.leading(last) == directory.leading(last[:1])
    assert len(directory.leading(last)) == 1


def test_a_directory_key_is_never_zero_for_a_found_block() -> None:
    assert page_key(bytes(24) + bytes(range(1, 9))) == int.from_bytes(bytes(range(1, 9)), "little")
    keys = bytearray(16 * 8)
    directory = PageDirectory(keys, 16)  # type: ignore[arg-type]
    zero = bytes(32)  # a digest whose key is 0 reads as "no block": it is computed, never found
    directory.put(3, zero)
    assert directory.leading([zero]) == []


def test_a_load_through_shared_memory_makes_no_call_to_the_store(
    shm_store: EngineStore,
) -> None:
    source, run = saved_three_blocks(shm_store, seed=5, n=45)
    target = kv_cache()
    loading = engine_path(shm_store, target)

    def no_call(*args: object) -> object:
        raise AssertionError("the load called the store")

    for name in ("locate", "fetch", "describe", "prepare"):
        setattr(loading.client, name, no_call)
    loaded = loading.load(run.digests, [4, 5, 6])
    assert (loaded.blocks, loaded.refused, loaded.error) == (3, None, None)
    assert same_blocks(source, [0, 1, 2], target, [4, 5, 6])


def test_a_load_goes_on_in_a_peer_stores_arena_with_no_call_to_either_store(
    shm_store: EngineStore,
) -> None:
    with EngineStore(page_bytes=KV_PAGE, block_size=B, num_pages=16, staging_pages=8) as peer:
        source = kv_cache(seed=9)
        run, _ = request(90, blocks=4)
        own_part = replace(run, digests=run.digests[:2], tokens=run.tokens[: 2 * B],
                           extra=run.extra[:2])  # fmt: skip
        saving = engine_path(shm_store, source)
        pending = saving.stage(own_part, [0, 1])
        assert pending is not None and saving.send(pending) == [True, True]
        at_peer = engine_path(peer, source)
        pending = at_peer.stage(run, [0, 1, 2, 3])
        assert pending is not None and at_peer.send(pending) == [True] * 4
        peer.forget(run.digests[:1])  # the peer need not hold what the engine's store holds

        target = kv_cache()
        peer_client = StoreClient(peer.address, peer.control_address)
        loading = BlockPath(
            StoreClient(shm_store.address, shm_store.control_address),
            KVLayers(target), B, peers=[peer_client],
        )  # fmt: skip
        loading.connect()
        loading._peer_mapped(0)  # mapped once, as on the first load

        def no_call(*args: object) -> object:
            raise AssertionError("the load called a store")

        for client_ in (loading.client, peer_client):
            for name in ("locate", "fetch", "describe", "prepare"):
                setattr(client_, name, no_call)
        loaded = loading.load(run.digests, [4, 5, 6, 7])
        assert (loaded.blocks, loaded.refused, loaded.error) == (4, None, None)
        assert same_blocks(source, [0, 1, 2, 3], target, [4, 5, 6, 7])

        # a peer page rewritten with another block's bytes is refused by its seal
        assert peer.arena is not None
        with peer.service.pinned(run.digests[2:4]) as ids:
            size = KV_PAGE
            third, fourth = (int(i) * size for i in ids)  # type: ignore[arg-type]
            peer.arena.pages[third : third + size] = peer.arena.pages[fourth : fourth + size]
        again = loading.load(run.digests, [8, 9, 10, 11])
        assert (again.blocks, again.refused) == (2, run.digests[2])
        loading.close()


def test_blocks_loaded_through_the_directory_are_hits_in_the_stores_lru(
    shm_store: EngineStore,
) -> None:
    path = engine_path(shm_store, kv_cache(seed=8))
    runs = [request(70 + i) for i in range(5)]  # 15 of the store's 16 pages, oldest first
    for run, _ in runs:
        pending = path.stage(run, [0, 1, 2])
        assert pending is not None and path.send(pending) == [True] * 3
    oldest, next_oldest = runs[0][0], runs[1][0]
    assert path.load(oldest.digests, [4, 5, 6]).blocks == 3  # read from the directory: no call
    newer, _ = request(80, blocks=4)  # one page free: three evicted
    pending = path.stage(newer, [0, 1, 2, 3])
    assert pending is not None and path.send(pending) == [True] * 4  # carries the loads
    assert shm_store.service.prefix_length(oldest.digests) == 3  # loaded: kept
    assert shm_store.service.prefix_length(next_oldest.digests) == 0  # evicted instead
    assert path.take_touched() == []  # sent once


def test_a_save_with_touched_blocks_that_are_not_digests_is_refused_by_name(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    store = stores[0]
    run, pages = request(81, blocks=1)
    with pytest.raises(InvalidInput, match="touched block digest"):
        client(store).save(run, pages, touched=["not a digest"])  # type: ignore[list-item]
    assert store.service.prefix_length(run.digests) == 0  # nothing kept


def test_without_the_directory_a_load_asks_the_store_where_its_pages_lie(
    shm_store: EngineStore,
) -> None:
    source, run = saved_three_blocks(shm_store, seed=7, n=46)
    target = kv_cache()
    client_ = StoreClient(shm_store.address, shm_store.control_address)
    asking = BlockPath(client_, KVLayers(target), B, directory=False)
    asking.connect()
    located: list[int] = []
    locate = client_.locate

    def counted(digests: Sequence[bytes]) -> Located:
        answer = locate(digests)
        located.append(len(answer.slots))
        return answer

    client_.locate = counted  # type: ignore[method-assign]
    assert asking.load(run.digests, [3, 4, 5]).blocks == 3
    assert located == [3] and same_blocks(source, [0, 1, 2], target, [3, 4, 5])
    assert (
        json.loads(connector_config("a:1", "b:2", directory=False))["kv_connector_extra_config"][
            "directory"
        ]
        is False
    )


def test_prepare_copies_what_a_peer_holds_out_of_its_arena_not_over_grpc(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    own, peer = stores
    run, pages = request(53, blocks=4)
    client(peer).save(run, pages)
    client(own).save(*request(53, blocks=1))  # the first block is held already

    def no_grpc(address: str) -> object:
        raise AssertionError("the pull went over gRPC")

    own._peer_links.get = no_grpc  # type: ignore[method-assign]
    answer = client(own).prepare(run, [peer.address], [peer.control_address])
    assert (answer.held, answer.pulled, answer.source) == (4, 3, peer.address)
    with own.service.pinned(run.digests) as ids:
        assert [own.kv.page_bytes(i) for i in ids] == pages  # type: ignore[arg-type]


def test_a_peers_blocks_that_do_not_prove_their_digest_are_not_pulled_from_its_arena(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    own, peer = stores
    run, pages = request(54)
    client(peer).save(run, pages)
    lying = replace(run, tokens=tuple(t + 1 for t in run.tokens))  # other tokens, same digests
    answer = client(own).prepare(lying, [peer.address], [peer.control_address])
    assert (answer.held, answer.pulled) == (0, 0)


def test_store_directories_read_the_own_store_and_whether_a_peer_holds_more(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    own, peer = stores
    run, pages = request(50, blocks=4)
    client(own).save(*request(50, blocks=2))  # the same first two blocks
    client(peer).save(run, pages)
    directories = StoreDirectories(client(own), [client(peer)])
    try:
        assert directories.held(run.digests) == 2
        assert directories.peer_holds(run.digests[2]) is True
        other, _ = request(51)
        assert directories.held(other.digests) == 0
        assert directories.peer_holds(other.digests[0]) is False
        assert not directories.pulls_possible([])  # neither the engine nor the store names one
        assert directories.pulls_possible([peer.address])
    finally:
        directories.close()
    unknown = StoreDirectories(client(own))  # peers named by page address only
    try:
        assert unknown.peer_holds(run.digests[2]) is None
    finally:
        unknown.close()


def test_store_directories_count_the_blocks_peers_hold_after_the_own_store_as_prepare_pulls(
    stores: tuple[EngineStore, EngineStore],
) -> None:
    own, peer = stores
    run, _ = request(55, blocks=4)
    client(own).save(*request(55, blocks=2))  # blocks 0-1
    client(peer).save(*request(55, blocks=3))  # blocks 0-2
    # each peer in order, from where the one before stopped (the store's Prepare does so)
    in_turn = StoreDirectories(client(own), [client(own), client(peer)])
    try:
        assert in_turn.peers_leading(run.digests) == 3  # 0-1 from the first, 2 from the second
        assert in_turn.peers_leading(run.digests[2:]) == 1
        assert in_turn.peers_leading(run.digests[3:]) == 0  # nobody holds block 3
    finally:
        in_turn.close()
    unknown = StoreDirectories(client(own))  # peers named by page address only
    try:
        assert unknown.peers_leading(run.digests[2:]) is None
    finally:
        unknown.close()


def test_store_directories_of_a_store_without_shared_memory_are_unknown() -> None:
    with EngineStore(page_bytes=PAGE, block_size=B, num_pages=16, shm_dir=None) as store:
        run, pages = request(52)
        client(store).save(run, pages)
        directories = StoreDirectories(client(store))
        try:
            assert directories.held(run.digests) is None  # the connector asks by Prepare
        finally:
            directories.close()


def test_peer_controls_must_pair_with_peers() -> None:
    with pytest.raises(ConfigError, match="peer_controls"):
        connector_config("127.0.0.1:1", "127.0.0.1:2", peers=["a:1"], peer_controls=["b:2", "c:3"])
    config = json.loads(
        connector_config("127.0.0.1:1", "127.0.0.1:2", peers=["a:1"], peer_controls=["b:2"])
    )
    assert config["kv_connector_extra_config"]["peer_controls"] == ["b:2"]


@pytest.mark.parametrize("rewrite", ["another block's page", "bytes under the seal"])
def test_a_page_rewritten_between_the_directory_read_and_the_copy_is_refused_never_used(
    shm_store: EngineStore, rewrite: str
) -> None:
    source = kv_cache(seed=3)
    path = engine_path(shm_store, source)
    run, _ = request(42)
    other, _ = request(43)
    for r, ids in ((run, [0, 1, 2]), (other, [3, 4, 5])):
        pending = path.stage(r, ids)
        assert pending is not None
        path.send(pending)
    target = kv_cache()
    loading = engine_path(shm_store, target)
    assert loading.mapped is not None
    directory = loading.mapped.arena.directory
    leading = directory.leading

    def leading_then_reuse(digests: Sequence[bytes]) -> list[int]:
        slots = leading(digests)
        # the store evicts block 1 and reuses its page, after the engine read where it lay
        page = shm_store.kv.page_buffer(slots[1])
        assert page is not None
        if rewrite == "another block's page":
            with shm_store.service.pinned(other.digests[:1]) as (other_id,):
                assert other_id is not None
                page[:] = shm_store.kv.page_bytes(other_id)
        else:
            page[:100] = bytes(100)
        return slots

    directory.leading = leading_then_reuse  # type: ignore[method-assign]
    loaded = loading.load(run.digests, [7, 8, 9])
    assert loaded.blocks == 1 and loaded.refused == run.digests[1]
    wanted = HashMismatch if rewrite == "another block's page" else ChecksumMismatch
    assert isinstance(loaded.error, wanted)
    assert same_blocks(source, [0], target, [7])  # the block before it is good and kept


def test_a_newer_lease_on_the_staging_ends_the_older_one(shm_store: EngineStore) -> None:
    run, _ = request(44)
    first, second = client(shm_store), client(shm_store)
    old = first.attach()
    second.attach()
    with pytest.raises(ArenaUnavailable, match="Attach again"):
        first.save_staged(run, old, [0, 1, 2])
    assert shm_store.service.prefix_length(run.digests) == 0
    with pytest.raises(InvalidInput, match="distinct staging slots"):
        second.save_staged(run, second.attach(), [0, 0, 1])
    with pytest.raises(InvalidInput, match=r"\[0, 8\)"):
        second.save_staged(run, second.attach(), [0, 1, 8])


def test_an_engine_whose_lease_was_taken_leases_again_and_its_save_lands(
    shm_store: EngineStore,
) -> None:
    source = kv_cache(seed=4)
    path = engine_path(shm_store, source)
    run, _ = request(45)
    pending = path.stage(run, [1, 2, 3])
    assert pending is not None
    client(shm_store).attach()  # another client takes the staging
    assert path.send(pending) == [True, True, True]
    target = kv_cache()
    assert engine_path(shm_store, target).load(run.digests, [0, 1, 2]).blocks == 3
    assert same_blocks(source, [1, 2, 3], target, [0, 1, 2])


def test_a_step_with_more_blocks_than_free_staging_slots_is_dropped_and_slots_come_back(
    shm_store: EngineStore,
) -> None:
    path = engine_path(shm_store, kv_cache(seed=5))
    run, _ = request(46, blocks=6)
    first = path.stage(run, list(range(6)))
    assert first is not None
    assert path.stage(run, list(range(6))) is None  # 8 staging slots: 2 left
    path.release(first)
    again = path.stage(run, list(range(6)))
    assert again is not None and path.send(again) == [True] * 6


def test_a_restarted_store_has_a_new_arena_that_the_engine_maps(tmp_path: Path) -> None:
    source = kv_cache(seed=6)
    with StoreProcess(block_nbytes=KV_NBYTES, block_size=B, pages=16, log_dir=tmp_path) as proc:
        path = engine_path(proc, source)
        assert path.mapped is not None
        old = path.mapped.arena.layout
        run, _ = request(47)
        pending = path.stage(run, [0, 1, 2])
        assert pending is not None and path.send(pending) == [True] * 3
        proc.restart()
        assert not Path(old.path).exists()  # a store removes its arena when it stops
        assert path.load(run.digests, [3, 4, 5]).blocks == 0  # the new store is empty
        mapped = path.mapped
        assert mapped is not None and mapped.token != old.token  # the old file gone: remapped
        pending = path.stage(run, [0, 1, 2])  # staged under the old lease...
        assert pending is not None
        proc.restart()
        assert path.send(pending) == [True] * 3  # ...refused, leased again, saved
        target = kv_cache()
        no_grpc_fetch(path)
        fresh = BlockPath(path.client, KVLayers(target), B)
        fresh.connect()
        no_grpc_fetch(fresh)
        assert fresh.load(run.digests, [7, 8, 9]).blocks == 3
        assert same_blocks(source, [0, 1, 2], target, [7, 8, 9])


def test_a_killed_stores_arena_is_removed_by_the_next_store_on_the_host(tmp_path: Path) -> None:
    with StoreProcess(block_nbytes=KV_NBYTES, block_size=B, pages=4, log_dir=tmp_path) as proc:
        layout = StoreClient(proc.page_address, proc.control_address).describe().arena
        assert layout is not None and Path(layout.path).exists()
        proc.kill()
        assert Path(layout.path).exists()  # SIGKILL: no chance to unlink
        proc.start()
        assert not Path(layout.path).exists()


def test_an_arena_this_host_cannot_map_means_grpc_counted(shm_store: EngineStore) -> None:
    arena = shm_store.arena
    assert arena is not None
    before = counter_value(
        "kvmesh_connector_shm_unmapped", store=shm_store.address, reason="unmappable"
    )
    Path(arena.layout.path).unlink()  # as seen from another host: no such file
    source = kv_cache(seed=7)
    path = engine_path(shm_store, source)
    assert path.mapped is None
    assert (
        counter_value("kvmesh_connector_shm_unmapped", store=shm_store.address, reason="unmappable")
        == before + 1
    )
    run, _ = request(48)
    pending = path.stage(run, [3, 4, 5])
    assert pending is not None and pending.staged is None and len(pending.blocks) == 3
    assert path.send(pending) == [True] * 3
    target = kv_cache()
    assert engine_path(shm_store, target).load(run.digests, [0, 1, 2]).blocks == 3
    assert same_blocks(source, [3, 4, 5], target, [0, 1, 2])


def test_a_store_without_shared_memory_is_reached_over_grpc_counted() -> None:
    with EngineStore(page_bytes=KV_PAGE, block_size=B, num_pages=8, shm_dir=None) as store:
        path = engine_path(store, kv_cache(seed=8))
        assert path.mapped is None and store.arena is None
        assert (
            counter_value(
                "kvmesh_connector_shm_unmapped", store=store.address, reason="not_offered"
            )
            == 1
        )
        run, _ = request(49)
        pending = path.stage(run, [0, 1, 2])
        assert pending is not None and path.send(pending) == [True] * 3
        with pytest.raises(ArenaUnavailable, match="no-shm"):
            client(store).attach()


def test_an_arena_with_another_token_or_size_is_refused(shm_store: EngineStore) -> None:
    arena = shm_store.arena
    assert arena is not None
    layout = arena.layout
    with pytest.raises(ArenaUnavailable, match="restarted"):
        open_arena(replace(layout, token=bytes(16)))
    with pytest.raises(ArenaUnavailable, match="restarted"):
        open_arena(replace(layout, staging=layout.staging + 1))
    with pytest.raises(ArenaUnavailable, match="no usable arena"):
        ArenaLayout.from_wire({"path": layout.path})
    with pytest.raises(ConfigError, match="--no-shm"):
        EngineStore(page_bytes=KV_PAGE, block_size=B, shm_dir="/nonexistent/kvmesh")


def test_the_connector_benchmark_moves_the_same_blocks_both_ways_in_one_run() -> None:
    parser = argparse.ArgumentParser()
    bench_connector.configure(parser)
    flags = "--blocks 4 --repeats 2 --warmup 1 --layers 2 --kv-heads 2 --head-dim 16"
    args = parser.parse_args([*flags.split(), "--dtype", "float32"])
    result = bench_connector.measure(args)  # raises if a load did not bring the saved bytes
    assert result["block_bytes"] == 2 * 2 * B * 2 * 16 * 4
    for part in ("stage", "send", "save", "load"):
        assert result[f"shm_{part}_ms"] > 0 and result[f"grpc_{part}_ms"] > 0
        assert result[f"grpc_over_shm_{part}"] == pytest.approx(
            result[f"grpc_{part}_ms"] / result[f"shm_{part}_ms"]
        )


def test_a_live_stores_arena_is_never_swept(shm_store: EngineStore) -> None:
    arena = shm_store.arena
    assert arena is not None
    assert Path(arena.layout.path) not in sweep_stale()
    assert Path(arena.layout.path).exists()


def test_a_store_refused_at_start_leaves_no_arena_behind() -> None:
    ours = f"kvmesh-store-{os.getpid()}-*"
    before = set(Path("/dev/shm").glob(ours))
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        EngineStore(page_bytes=PAGE, block_size=B, algo="xxhash")
    assert set(Path("/dev/shm").glob(ours)) == before
