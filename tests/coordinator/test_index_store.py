"""The columnar page store's growth (columns grow in place, the lookup table stays half
empty) and its batched lookups."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.coordinator.index_store import PageStore, PromptKeys
from kvmesh.types import PageHash


def _h(i: int) -> PageHash:
    return PageHash(hashlib.sha256(i.to_bytes(8, "little")).digest())


def _chain(start: int, n: int) -> list[PageHash]:
    return [_h(start + k) for k in range(n)]


def test_pages_survive_the_columns_growing() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    first = _chain(0, 700)
    store.store([(first, None)], 0, 1)
    rows_before = len(store._length)
    later = _chain(10_000, 5_000)  # forces several rounds of growth
    store.store([(later, first[-1])], 0, 1)
    assert len(store._length) > rows_before
    assert store.holder_ids(first + later) == [store.holder_ids(first[:1])[0]] * 5_700
    assert store.parent(later[0]) == first[-1]
    assert store.parent(first[0]) is None
    store.check_invariants([0])


def test_rows_handed_out_after_growth_start_with_no_parent_and_no_holder() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    store.store([(_chain(0, 3_000), None)], 0, 1)
    top = store._top
    assert (store._holders[top:] == 0).all()
    assert (store._kids[top:] == 0).all()
    rows = store._alloc(5)  # fresh rows from past the top
    assert rows.tolist() == list(range(top, top + 5))
    assert (store._parent[rows] == -1).all()


def test_the_lookup_table_is_at_most_a_third_full_and_at_least_a_sixth() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    for k in range(20):
        store.store([(_chain(k * 1_000, 1_000), None)], 0, 1)
        used = int((store._table >= 0).sum())
        assert used * 3 <= len(store._table)
    assert used * 6 >= len(store._table)  # 3-6 slots a page once grown past the minimum
    store.check_invariants([0])


def test_the_rows_in_use_and_the_table_cost_at_most_70_bytes_per_32_byte_page() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    pages = 50_000
    for k in range(0, pages, 500):
        store.store([(_chain(k, 500), None)], 0, 1)
    columns = (store._digest, store._length, store._holders, store._parent, store._kids)
    per_row = sum(c.nbytes for c in columns) / len(store._length)  # the rows past the top
    used = per_row * store._top + store._table.nbytes  # are mapped but never written
    assert len(store) == pages
    assert used / pages <= 70


def test_extra_bytes_counts_the_mapped_columns_tracemalloc_cannot_see() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    for k in range(0, 20_000, 500):
        store.store([(_chain(k, 500), None)], 0, 1)
    columns = (store._digest, store._length, store._holders, store._parent, store._kids)
    mapped = sum(c.nbytes for c in columns) + store._table.nbytes
    assert store.extra_bytes() >= mapped
    assert store.extra_bytes() < mapped + 20_000  # and the bitmaps: small beside them


def _displaced(store: PageStore, hashes: list[PageHash]) -> int:
    """How many of `hashes` sit past their home slot (a lookup must probe on for them)."""
    keys = np.frombuffer(b"".join(hashes), np.uint64)[:: store._words]
    homes = store._table[store._home(np.ascontiguousarray(keys))]
    return int((homes != store.find(hashes)).sum())


@pytest.mark.parametrize("seed", range(8))
def test_holder_ids_many_gives_each_prompts_holder_ids(seed: int) -> None:
    rng = random.Random(seed)
    store = PageStore(min_slots=16)
    for slot in range(3):
        store.ensure_slot(slot)
    chains = [_chain(k * 100, 40) for k in range(60)]
    for c in chains:
        store.store([(c, None)], rng.randrange(3), 1 << rng.randrange(4))
    for c in rng.sample(chains, 20):  # holes, ghosts and tombstones in the table
        start = rng.randrange(40)
        store.remove(c[start : start + rng.randint(1, 5)], 0, 0b1111)
    prompts = [
        c[: rng.randint(0, 40)] + _chain(10**6 + 100 * i, rng.randint(0, 4))
        for i, c in enumerate(rng.sample(chains, 24))
    ]
    prompts += [[], _chain(10**7, 3), chains[0][5:9]]
    assert _displaced(store, [h for p in prompts for h in p]) > 0  # probing is exercised
    assert store.holder_ids_many(prompts) == [store.holder_ids(p) for p in prompts]
    narrow = [[PageHash(b"short")], chains[1][:4]]  # another width: the general path
    assert store.holder_ids_many(narrow) == [store.holder_ids(p) for p in narrow]
    # keys made once for several stores (a sharded router) look up as each store alone
    assert store.holder_ids_many(prompts, PromptKeys.of(prompts)) == store.holder_ids_many(prompts)
    for p in [*prompts, *narrow]:
        assert store.holder_ids(p, PromptKeys.of([p])) == store.holder_ids(p)


def test_prompt_keys_send_other_widths_and_zero_digests_down_the_general_path() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    chain = _chain(0, 6)
    store.store([(chain, None)], 0, 1)
    zero = PageHash(bytes(32))
    for prompt in ([*chain[:2], PageHash(b"x" * 16)], [zero, *chain], [*chain[:3], zero]):
        keys = PromptKeys.of([prompt])
        assert keys.width == 0
        assert store.holder_ids(prompt, keys) == store.holder_ids(prompt)
    assert PromptKeys.of([chain]).width == 32
    # the widths must match the store's: 8-byte keys look a 32-byte store up the general way
    assert store.holder_ids(chain, PromptKeys.of([chain])) == store.holder_ids(chain)


def _holder_ids_by_find(store: PageStore, prompt: list[PageHash]) -> list[int]:
    """The holder ids a lookup must give, by the store's general path (`find`, row by row)."""
    out: list[int] = []
    for row in store.find(prompt).tolist() if prompt else []:
        if row < 0:
            break
        out.append(int(store._holders[row]))
        if not out[-1]:
            break
    return out


def _trimmed(ids: list[int]) -> list[int]:
    """Holder ids up to their first 0 (callers stop there)."""
    return ids[: ids.index(0) + 1] if 0 in ids else ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chains=st.integers(1, 80),
    kept=st.lists(st.tuples(st.integers(0, 79), st.integers(0, 40), st.integers(0, 4)), max_size=6),
    removed=st.lists(st.tuples(st.integers(0, 79), st.integers(0, 39)), max_size=10),
    seed=st.integers(0, 2**16),
)
def test_one_prompts_keys_look_up_stores_of_any_table_size_as_their_general_path(
    chains: int,
    kept: list[tuple[int, int, int]],
    removed: list[tuple[int, int]],
    seed: int,
) -> None:
    """The hot path (home slots taken at once, an empty home slot ending the walk without a
    probe) gives what `find` gives, with one `PromptKeys` shared by stores whose tables differ
    in size (its home slots are kept per table size)."""
    rng = random.Random(seed)
    small, large = PageStore(min_slots=16), PageStore(min_slots=1 << 14)
    for store in (small, large):
        store.ensure_slot(0)
        store.ensure_slot(1)
    all_chains = [_chain(k * 100, 40) for k in range(chains)]
    for c in all_chains:
        store = rng.choice((small, large))
        store.store([(c, None)], rng.randrange(2), 1 << rng.randrange(4))
    for k, start in removed:  # holes and tombstones
        for store in (small, large):
            store.remove(all_chains[k % chains][start : start + 3], 0, 0b1111)
    prompts = [
        all_chains[k % chains][:n] + _chain(10**6 + 100 * i, fresh)
        for i, (k, n, fresh) in enumerate(kept)
    ]
    for prompt in prompts:
        keys = PromptKeys.of([prompt])
        for store in (small, large, small):
            assert _trimmed(store.holder_ids(prompt, keys)) == _holder_ids_by_find(store, prompt)
            # a prompt's first pages read one by one, and the rest with numpy from there
            for count in (1, 5, 8, 41):
                by_find = _holder_ids_by_find(store, prompt[:count])
                assert store.head_holder_ids(prompt, keys, count) == by_find
                assert _trimmed(store.holder_ids(prompt, keys, count)) == _holder_ids_by_find(
                    store, prompt[count:]
                )


_OFF_DEVICE = int("e" * 12, 16)  # the cpu, disk and other bits of 12 slots


def _prefix_by_find(store: PageStore, prompt: list[PageHash], slot: int) -> int:
    """How many pages from the first `slot` holds, by the general path (`find`, masks)."""
    n = 0
    for mid in _holder_ids_by_find(store, prompt):
        if not store.masks[mid] >> (4 * slot) & 0b1111:
            break
        n += 1
    return n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slots=st.integers(1, 12),
    chains=st.integers(1, 60),
    stored=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 11), st.integers(0, 3)), max_size=40),
    removed=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 39), st.integers(0, 11)), max_size=10),
    kept=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=20),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_batchs_prefix_lengths_are_each_slots_walk_by_the_general_path(
    slots: int,
    chains: int,
    stored: list[tuple[int, int, int]],
    removed: list[tuple[int, int, int]],
    kept: list[tuple[int, int, int]],
    seed: int,
) -> None:
    """`holder_grid` + `prefix_lengths` (a batch's lookup in rounds of numpy calls, probing
    a small, crowded table) give every slot's prefix of every prompt as `find` does, with
    masks interned between lookups described before the next; `off_device` flags every
    prompt whose walked pages have a holder off the device."""
    rng = random.Random(seed)
    store = PageStore(min_slots=16)
    for slot in range(slots):
        store.ensure_slot(slot)
    all_chains = [_chain(k * 100, 40) for k in range(chains)]
    for k, slot, tier in stored:
        chain = all_chains[k % chains]
        store.store([(chain[: rng.randint(1, 40)], None)], slot % slots, 1 << tier)
    for k, start, slot in removed:  # holes, ghosts and tombstones
        store.remove(all_chains[k % chains][start : start + 3], slot % slots, 0b1111)
    prompts = [
        all_chains[k % chains][:n] + _chain(10**6 + 100 * i, fresh)
        for i, (k, n, fresh) in enumerate(kept)
    ]
    for _ in range(2):  # a second lookup after more masks were interned
        grid = store.holder_grid(prompts)
        lengths = store.prefix_lengths(grid)
        off = store.off_device(grid)
        for i, prompt in enumerate(prompts):
            assert _trimmed(grid[i].tolist()) == _trimmed([*_holder_ids_by_find(store, prompt), 0])
            assert [int(n) for n in lengths[i, :slots]] == [
                _prefix_by_find(store, prompt, slot) for slot in range(slots)
            ]
            walked = _holder_ids_by_find(store, prompt)
            if any(store.masks[mid] & _OFF_DEVICE for mid in walked):
                assert off[i]
        chain = all_chains[rng.randrange(chains)]
        store.store([(chain[:5], None)], rng.randrange(slots), 0b0010)  # new masks, off device


def test_a_batchs_lookup_probes_past_a_long_run_of_full_slots() -> None:
    """Digests sharing their first 8 bytes share a home slot: the later ones sit in a long
    run of full slots, and are found (or not) all the same."""
    store = PageStore(min_slots=64)
    store.ensure_slot(0)
    crowd = [PageHash(b"samekey!" + k.to_bytes(24, "little")) for k in range(1, 20)]
    store.store([(crowd, None)], 0, 1)
    assert _displaced(store, crowd) >= 12
    missing = PageHash(b"samekey!" + (99).to_bytes(24, "little"))
    prompts = [crowd, [*crowd[:3], missing], [missing], crowd[::-1]]
    grid = store.holder_grid(prompts)
    lengths = store.prefix_lengths(grid)
    assert lengths[:, 0].tolist() == [19, 3, 0, 19]
    for i, prompt in enumerate(prompts):
        assert _trimmed(grid[i].tolist()) == _trimmed([*_holder_ids_by_find(store, prompt), 0])
