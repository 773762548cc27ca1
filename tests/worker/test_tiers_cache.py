"""The tiers together: spills and promotions as events, snapshots, resets, pulls, config."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers_kit import TierRig, make_store, page_data, prompt, replay_by_tier, same_bits

from kvmesh.config import ClusterConfig, CoordinatorConfig, PoolConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.errors import ConfigError, InvalidSetting, PagesInUse
from kvmesh.events import AllPagesCleared, PagesRemoved, PagesStored, make_batch
from kvmesh.metrics import TIER_PROMOTIONS
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.cache_manager import KVCacheGroupSpec, KVCacheManager
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService
from kvmesh.worker.tiered_cache import DEVICE, DISK, HOST, TieredCache


def test_a_spill_is_stored_below_before_it_is_removed_above() -> None:
    rig = TierRig(4, host_pages=4)
    first = prompt(1, 2)
    rig.serve(first)
    rig.pool.take_events()
    rig.serve(prompt(2, 2))
    events = rig.pool.take_events()
    moved = rig.request(first).page_hashes
    stored_at = next(
        i
        for i, e in enumerate(events)
        if isinstance(e, PagesStored) and e.medium == HOST and moved[0] in e.page_hashes
    )
    removed_at = next(
        i
        for i, e in enumerate(events)
        if isinstance(e, PagesRemoved) and e.medium == DEVICE and moved[0] in e.page_hashes
    )
    assert stored_at < removed_at


def test_a_promotion_is_a_move_back_to_the_device(tmp_path: Path) -> None:
    rig = TierRig(4, host_pages=1, disk_dir=tmp_path, disk_bytes=1 << 20, worker="w-move")
    first = prompt(1, 2)
    rig.serve(first)
    rig.serve(prompt(2, 2))  # first's tail goes first (to disk), its head stays in host memory
    held: dict[str, set[PageHash]] = {}
    replay_by_tier(rig.pool.take_events(), held)
    head, second = rig.request(first).page_hashes
    assert head in held[HOST] and second in held[DISK]
    from_disk = TIER_PROMOTIONS.value(worker="w-move", tier=DISK)

    assert rig.serve(first) == 2
    replay_by_tier(rig.pool.take_events(), held)
    assert {head, second} <= held[DEVICE]
    assert head not in held[HOST] and second not in held[DISK]
    assert held == rig.tiers.hashes_by_tier()
    assert TIER_PROMOTIONS.value(worker="w-move", tier=DISK) == from_disk + 1


def test_a_promotion_from_a_full_host_tier_sends_the_pages_it_displaces_to_disk(
    tmp_path: Path,
) -> None:
    rig = TierRig(5, host_pages=3, disk_dir=tmp_path, disk_bytes=1 << 20)
    first, second = prompt(1, 3), prompt(2, 3)
    rig.serve(first)
    rig.serve(second)  # first's 3 pages fill the host tier
    assert {rig.tiers.tier_of(h) for h in rig.request(first).page_hashes} == {HOST}
    assert rig.serve(first) == 3  # their slots stay reserved while second's pages spill
    where = [rig.tiers.tier_of(h) for h in rig.request(second).page_hashes]
    assert where == [HOST, DISK, DISK]  # the head spilled last, once the host had room again
    rig.tiers.check_invariants()
    assert rig.serve(second) == 3  # and come back from disk, bytes checked


def test_the_snapshot_lists_every_tier_parents_first(tmp_path: Path) -> None:
    rig = TierRig(5, host_pages=1, disk_dir=tmp_path, disk_bytes=1 << 20)
    rig.serve(prompt(1, 3))
    rig.serve(prompt(2, 3))
    snapshot = rig.pool.snapshot_events()  # what the worker's event reporter sends
    by_tier: dict[str, set[PageHash]] = {}
    replay_by_tier(snapshot, by_tier)
    assert by_tier == rig.tiers.hashes_by_tier()
    assert all(by_tier.values())  # each tier holds some page
    seen: set[PageHash] = set()
    listed = {e.page_hashes[0] for e in snapshot}
    for event in snapshot:
        assert (
            event.parent_hash is None
            or event.parent_hash not in listed
            or event.parent_hash in seen
        )
        seen.add(event.page_hashes[0])


def test_a_reset_forgets_every_tier_and_refuses_while_pages_are_held(tmp_path: Path) -> None:
    rig = TierRig(4, host_pages=2, disk_dir=tmp_path, disk_bytes=1 << 20)
    for seed in range(3):
        rig.serve(prompt(seed, 2))
    req = rig.request(prompt(9, 1))
    rig.manager.allocate_slots(req, 5)
    with pytest.raises(PagesInUse):
        rig.manager.reset_prefix_cache()
    assert len(rig.tiers.host or ()) == 2  # a refused reset changes nothing
    rig.manager.free(req)
    rig.manager.reset_prefix_cache()
    assert rig.tiers.hashes_by_tier() == {DEVICE: set(), HOST: set(), DISK: set()}
    assert isinstance(rig.pool.take_events()[-1], AllPagesCleared)
    assert not list(tmp_path.iterdir())


def test_a_peer_pulls_a_page_this_worker_keeps_in_host_memory() -> None:
    rig = TierRig(4, host_pages=4)
    service = PageService(rig.pool, rig.store, rig.hasher)
    service.tiers = rig.tiers
    first = prompt(1, 2)
    rig.serve(first)
    rig.serve(prompt(2, 2))
    hashes = rig.request(first).page_hashes
    assert rig.tiers.tier_of(hashes[0]) == HOST
    with service.pinned(hashes) as ids:
        assert None not in ids
        for h, pid in zip(hashes, ids, strict=True):
            blob = service.export(pid)  # type: ignore[arg-type]
            rig.store.check_blob(blob)
            assert same_bits(rig.store.read_page(pid), page_data(h, rig.store))  # type: ignore[arg-type]
    rig.tiers.check_invariants()


def test_workers_build_tiers_from_config_only_when_asked(tmp_path: Path) -> None:
    pool = PagePool(5, page_size=4)
    manager = KVCacheManager(pool, 4)
    store = make_store(5)
    assert TieredCache.for_worker(ClusterConfig(), manager, store) is None
    config = ClusterConfig(
        pool=PoolConfig(num_pages=5, host_pages=3, disk_dir=str(tmp_path), disk_bytes=1 << 20),
        coordinator=CoordinatorConfig(tenant_weights="t-aaaaaaaaaaaa=2"),
    )
    tiers = TieredCache.for_worker(config, manager, store, worker="worker-0")
    assert tiers is not None and manager.tiers is tiers and pool.medium == DEVICE
    assert tiers.host is not None and tiers.host.num_pages == 3 and tiers.disk is not None
    assert tiers.disk.directory == tmp_path / "worker-0"  # a folder of its own per worker
    other = TieredCache.for_worker(
        config, KVCacheManager(PagePool(5, page_size=4), 4), make_store(5), worker="../w 1"
    )
    assert other is not None and other.disk is not None
    assert other.disk.directory.parent == tmp_path and other.disk.directory.name.startswith("w-")


def test_tier_settings_are_checked() -> None:
    with pytest.raises(InvalidSetting, match="disk_bytes"):
        PoolConfig(disk_dir="/tmp/x")
    with pytest.raises(InvalidSetting, match="eviction"):
        PoolConfig(eviction="fifo")
    with pytest.raises(InvalidSetting, match="host_pages"):
        PoolConfig(host_pages=-1)


def test_tiers_refuse_a_manager_with_sliding_window_groups() -> None:
    pool = PagePool(5, page_size=4)
    tiers = TieredCache(pool, make_store(5), host_pages=2)
    groups = (KVCacheGroupSpec(), KVCacheGroupSpec("sliding_window", 8))
    with pytest.raises(ConfigError, match="one full-attention"):
        KVCacheManager(pool, 4, groups=groups, tiers=tiers)
    with pytest.raises(ConfigError, match="already has tiers"):
        TieredCache(pool, make_store(5), host_pages=2)


# -------------------------------------------------------------- property test

OPS = st.lists(
    st.tuples(st.integers(0, 7), st.integers(1, 3), st.sampled_from([None, "a", "b"])),
    min_size=1,
    max_size=25,
)


def index_by_tier(index: GlobalIndex, worker: WorkerId) -> dict[str, set[PageHash]]:
    """Per tier, the pages the coordinator's index believes `worker` holds there."""
    out: dict[str, set[PageHash]] = {DEVICE: set(), HOST: set(), DISK: set()}
    for h in index.all_pages():
        for tier in index.holders(h).get(worker, ()):
            out[tier].add(h)
    return out


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, host=st.integers(0, 4), fair=st.booleans())
def test_the_index_and_the_pools_agree_after_random_spills_and_promotions(
    tmp_path_factory: pytest.TempPathFactory,
    ops: list[tuple[int, int, str | None]],
    host: int,
    fair: bool,
) -> None:
    rig = TierRig(
        5,
        host_pages=host,
        disk_dir=tmp_path_factory.mktemp("disk"),
        disk_bytes=6 * 700,
        eviction="fair" if fair else "lru",
    )
    wid = WorkerId("w")
    index = GlobalIndex()
    index.register_worker(wid, "inc")
    for seq, (seed, pages, salt) in enumerate(ops):
        rig.serve(prompt(seed, pages), salt)  # checks every hit page's bytes
        index.apply(make_batch(rig.pool.take_events(), wid, "inc", seq))
        rig.tiers.check_invariants()
        assert index_by_tier(index, wid) == rig.tiers.hashes_by_tier()
    rebuilt = GlobalIndex()
    rebuilt.apply(make_batch(rig.pool.snapshot_events(), wid, "inc2", 0, snapshot=True))
    assert index_by_tier(rebuilt, wid) == rig.tiers.hashes_by_tier()
