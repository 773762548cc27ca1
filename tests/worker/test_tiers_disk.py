"""The disk tier: bit-exact pages, corrupted and truncated files, the budget, a restart."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tiers_kit import TierRig, make_store, page_data, prompt, replay_by_tier, same_bits

from kvmesh.errors import ConfigError, DiskPageCorrupt
from kvmesh.events import PagesRemoved, PagesStored
from kvmesh.metrics import DISK_PAGES_DROPPED
from kvmesh.types import PageHash
from kvmesh.worker.disk_tier import SUFFIX, DiskTier
from kvmesh.worker.kv_store import PageBlob
from kvmesh.worker.page_pool import PageMeta, PagePool
from kvmesh.worker.tiered_cache import DISK, HOST, TieredCache, page_blob


def dropped(worker: str, reason: str) -> float:
    return DISK_PAGES_DROPPED.value(worker=worker, reason=reason)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_pages_come_back_bit_exact_through_host_and_disk(tmp_path: Path, dtype: str) -> None:
    # 4 device pages, 2 host pages: a 3-page prompt pushed out by two others goes to disk
    rig = TierRig(5, dtype=dtype, host_pages=2, disk_dir=tmp_path, disk_bytes=1 << 20)
    first = prompt(1, 3)
    rig.serve(first)
    rig.serve(prompt(2, 3))
    rig.serve(prompt(3, 3))
    where = {rig.tiers.tier_of(h) for h in rig.request(first).page_hashes}
    assert where == {DISK}
    assert rig.serve(first) == 3  # promoted from disk, bytes checked by the rig
    assert {rig.tiers.tier_of(h) for h in rig.request(first).page_hashes} == {"gpu"}
    rig.tiers.check_invariants()


def test_a_host_hit_is_promoted_instead_of_recomputed() -> None:
    rig = TierRig(5, host_pages=8)
    first = prompt(1, 3)
    rig.serve(first)
    rig.serve(prompt(2, 3))
    assert {rig.tiers.tier_of(h) for h in rig.request(first).page_hashes} == {HOST}
    assert rig.serve(first) == 3
    rig.tiers.check_invariants()


def _spill_to_disk(tmp_path: Path, worker: str) -> tuple[TierRig, list[int]]:
    rig = TierRig(5, disk_dir=tmp_path, disk_bytes=1 << 20, worker=worker)
    first = prompt(1, 2)
    rig.serve(first)
    rig.serve(prompt(2, 3))
    assert {rig.tiers.tier_of(h) for h in rig.request(first).page_hashes} == {DISK}
    rig.pool.take_events()
    return rig, first


def test_a_corrupted_disk_page_is_dropped_counted_and_never_served(tmp_path: Path) -> None:
    rig, first = _spill_to_disk(tmp_path, "w-corrupt")
    second = rig.request(first).page_hashes[1]
    path = tmp_path / (second.hex() + SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # one bit of the page bytes
    path.write_bytes(bytes(raw))
    before = dropped("w-corrupt", "corrupt")

    assert rig.serve(first) == 1  # the first page is promoted, the corrupted one recomputed
    assert dropped("w-corrupt", "corrupt") == before + 1
    assert not path.exists() or rig.tiers.tier_of(second) == "gpu"
    removed = [
        e for e in rig.pool.take_events() if isinstance(e, PagesRemoved) and e.medium == DISK
    ]
    assert any(second in e.page_hashes for e in removed)
    rig.tiers.check_invariants()


def test_a_truncated_disk_page_is_dropped_counted_and_never_served(tmp_path: Path) -> None:
    rig, first = _spill_to_disk(tmp_path, "w-trunc")
    head = rig.request(first).page_hashes[0]
    path = tmp_path / (head.hex() + SUFFIX)
    path.write_bytes(path.read_bytes()[:-7])
    before = dropped("w-trunc", "truncated")

    assert rig.serve(first) == 0  # nothing past a bad first page can be used
    assert dropped("w-trunc", "truncated") == before + 1
    assert rig.tiers.disk is not None and head not in rig.tiers.disk
    rig.tiers.check_invariants()


def test_take_raises_disk_page_corrupt_for_a_bad_header(tmp_path: Path) -> None:
    store = make_store(3)
    disk = DiskTier(tmp_path, 1 << 20, dtype="float32", page_shape=store.page_shape, fsync=True)
    meta = PageMeta(b"h" * 32, None, None, "default")  # type: ignore[arg-type]
    disk.put(meta, page_blob(page_data(meta.page_hash, store), "float32"))
    path = disk.path_of(meta.page_hash)
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0xFF  # inside the msgpack header
    path.write_bytes(bytes(raw))
    with pytest.raises(DiskPageCorrupt, match=r"corrupt.*deleted"):
        disk.take(meta.page_hash)
    assert not path.exists() and meta.page_hash not in disk
    disk.check_invariants()


def test_a_full_disk_budget_evicts_the_oldest_pages_and_says_so(tmp_path: Path) -> None:
    probe, _ = _spill_to_disk(tmp_path / "probe", "w-budget")
    size = max(e.nbytes for e in probe.tiers.disk.entries())  # type: ignore[union-attr]
    budget = 3 * size + size // 2
    rig = TierRig(4, disk_dir=tmp_path / "d", disk_bytes=budget)
    for seed in range(4):
        rig.serve(prompt(seed, 2))  # 8 pages through a 3-page pool: 5 or more reach the disk
    events = rig.pool.take_events()
    disk = rig.tiers.disk
    assert disk is not None and len(disk) == 3 and disk.used_bytes <= budget
    assert len(list((tmp_path / "d").glob("*" + SUFFIX))) == 3
    held: dict[str, set[PageHash]] = {}
    replay_by_tier(events, held)
    assert held[DISK] == {e.meta.page_hash for e in disk.entries()}
    assert any(isinstance(e, PagesRemoved) and e.medium == DISK for e in events)
    # the newest pages stay: the last prompt's pages are on the device, the one before on disk
    before_last = rig.request(prompt(2, 2)).page_hashes
    assert all(rig.tiers.tier_of(h) is not None for h in before_last)
    assert rig.tiers.tier_of(rig.request(prompt(0, 2)).page_hashes[0]) is None
    rig.tiers.check_invariants()


def test_a_restarted_worker_adopts_its_disk_pages_and_announces_them(tmp_path: Path) -> None:
    rig, first = _spill_to_disk(tmp_path, "w-restart")
    on_disk = {e.meta.page_hash for e in rig.tiers.disk.entries()}  # type: ignore[union-attr]
    (tmp_path / ".tmp-stray-page").write_bytes(b"half a page")
    del rig

    again = TierRig(5, disk_dir=tmp_path, disk_bytes=1 << 20, worker="w-restart")
    snapshot = again.tiers.snapshot_events()
    assert {h for e in snapshot if e.medium == DISK for h in e.page_hashes} == on_disk
    assert all(isinstance(e, PagesStored) for e in snapshot)
    assert not (tmp_path / ".tmp-stray-page").exists()
    assert again.serve(first) == 2  # promoted from the adopted files, bytes checked
    again.tiers.check_invariants()


def test_a_worker_that_does_not_adopt_deletes_the_old_files(tmp_path: Path) -> None:
    rig, _ = _spill_to_disk(tmp_path, "w-wipe")
    del rig
    again = TierRig(5, disk_dir=tmp_path, disk_bytes=1 << 20, disk_adopt=False)
    assert again.tiers.snapshot_events() == []
    assert not list(tmp_path.glob("*" + SUFFIX))


def test_adopting_drops_another_models_pages(tmp_path: Path) -> None:
    _spill_to_disk(tmp_path, "w-format")
    before = dropped("w-format", "format")
    pool = PagePool(5, page_size=4)
    store = make_store(5, "float16")
    tiers = TieredCache(pool, store, disk_dir=tmp_path, disk_bytes=1 << 20, worker="w-format")
    assert tiers.disk is not None and len(tiers.disk) == 0
    assert dropped("w-format", "format") == before + 2


def test_disk_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    pool = PagePool(5, page_size=4)
    store = make_store(5)
    with pytest.raises(ConfigError, match="disk_bytes budget"):
        TieredCache(pool, store, disk_dir=tmp_path)
    with pytest.raises(ConfigError, match="cannot hold one page file"):
        TieredCache(pool, store, disk_dir=tmp_path, disk_bytes=100)
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="not a writable folder"):
        TieredCache(pool, store, disk_dir=blocker / "sub", disk_bytes=1 << 20)
    assert pool.spill_listener is None  # a refused attach leaves the pool alone


def test_bytes_read_back_from_a_disk_file_are_the_pages_own(tmp_path: Path) -> None:
    for dtype in ("float16", "bfloat16", "float32"):
        store = make_store(2, dtype)
        disk = DiskTier(tmp_path / dtype, 1 << 20, dtype=dtype, page_shape=store.page_shape)
        meta = PageMeta(b"k" * 16, b"p" * 16, 3, "t-1")  # type: ignore[arg-type]
        page = page_data(meta.page_hash, store)
        disk.put(meta, page_blob(page, dtype))
        got = disk.take(meta.page_hash)
        assert got is not None and got[0] == meta
        store.import_page(1, got[1])  # type: ignore[arg-type]
        assert same_bits(store.read_page(1), page)  # type: ignore[arg-type]


def test_spilling_to_disk_never_waits_for_the_disk(tmp_path: Path) -> None:
    lock = threading.RLock()
    rig = TierRig(4, disk_dir=tmp_path, disk_bytes=1 << 20, lock=lock, worker="w-async")
    disk, writer = rig.tiers.disk, rig.tiers.writer
    assert disk is not None and writer is not None
    release = threading.Event()
    write = disk.write

    def slow_write(meta: PageMeta, blob: PageBlob) -> int:
        release.wait(30)  # a disk that takes its time
        return write(meta, blob)

    disk.write = slow_write  # type: ignore[method-assign]
    first = prompt(1, 2)
    with lock:
        rig.serve(first)
        rig.serve(prompt(2, 2))  # evicts first's pages to the (stalled) disk
    heads = rig.request(first).page_hashes
    assert writer.in_flight() >= set(heads) and len(disk) == 0  # not admitted yet
    held: dict[str, set[PageHash]] = {}
    replay_by_tier(rig.pool.take_events(), held)
    assert not held.get(DISK)
    release.set()
    rig.tiers.flush()
    replay_by_tier(rig.pool.take_events(), held)
    assert held[DISK] == set(heads) == {e.meta.page_hash for e in disk.entries()}
    with lock:
        rig.tiers.check_invariants()
        assert rig.serve(first) == 2
    rig.tiers.close()


def test_a_failed_disk_write_drops_the_page_and_counts_it(tmp_path: Path) -> None:
    lock = threading.RLock()
    rig = TierRig(4, disk_dir=tmp_path, disk_bytes=1 << 20, lock=lock, worker="w-wfail")
    disk = rig.tiers.disk
    assert disk is not None

    def failing_write(meta: PageMeta, blob: PageBlob) -> int:
        raise OSError(28, "No space left on device")

    disk.write = failing_write  # type: ignore[method-assign]
    before = dropped("w-wfail", "write_error")
    with lock:
        rig.serve(prompt(1, 2))
        rig.serve(prompt(2, 2))
    rig.tiers.flush()
    assert dropped("w-wfail", "write_error") == before + 2
    assert len(disk) == 0 and not list(tmp_path.glob("*" + SUFFIX))
    rig.tiers.close()


def test_disk_pages_are_read_before_the_lock_and_others_never_wait_for_them(
    tmp_path: Path,
) -> None:
    lock = threading.RLock()
    rig = TierRig(4, disk_dir=tmp_path, disk_bytes=1 << 20, lock=lock, worker="w-prefetch")
    first = prompt(1, 2)
    with lock:
        rig.serve(first)
        rig.serve(prompt(2, 2))
    rig.tiers.flush()
    disk = rig.tiers.disk
    assert disk is not None and len(disk) == 2
    reading, release = threading.Event(), threading.Event()
    reads: list[PageHash] = []
    read = disk.read

    def slow_read(page_hash: PageHash) -> tuple[PageMeta, PageBlob]:
        reads.append(page_hash)
        reading.set()
        release.wait(30)  # a slow disk
        return read(page_hash)

    disk.read = slow_read  # type: ignore[method-assign]
    hashes = rig.request(first).page_hashes
    reader = threading.Thread(target=rig.tiers.prefetch, args=(hashes, 2))
    reader.start()
    assert reading.wait(30)
    with lock:  # not held by the reader: another request goes ahead meanwhile
        assert rig.serve(prompt(3, 1)) == 0
    release.set()
    reader.join(30)
    with lock:
        assert rig.serve(first) == 2  # promoted from what was read, bytes checked
    assert reads == list(hashes)  # each page read once, by the prefetch
    with lock:
        rig.tiers.check_invariants()
    rig.tiers.close()


def test_a_corrupted_page_found_by_a_prefetch_is_dropped_once_and_never_served(
    tmp_path: Path,
) -> None:
    lock = threading.RLock()
    rig = TierRig(4, disk_dir=tmp_path, disk_bytes=1 << 20, lock=lock, worker="w-prebad")
    first = prompt(1, 2)
    with lock:
        rig.serve(first)
        rig.serve(prompt(2, 2))
    rig.tiers.flush()
    head = rig.request(first).page_hashes[0]
    path = tmp_path / (head.hex() + SUFFIX)
    path.write_bytes(path.read_bytes()[:-3])
    before = dropped("w-prebad", "truncated")
    assert rig.tiers.prefetch(rig.request(first).page_hashes, 2) == 1  # stops at the bad one
    with lock:
        rig.pool.take_events()
        assert rig.serve(first) == 0
        events = rig.pool.take_events()
        rig.tiers.check_invariants()
    assert dropped("w-prebad", "truncated") == before + 1
    assert not path.exists()
    assert any(isinstance(e, PagesRemoved) and head in e.page_hashes for e in events)
    rig.tiers.close()
