"""The columnar page store's growth (columns grow in place, the lookup table stays half
empty) and its lookups: the general path's and the compiled walk's (`PageStore.walk`)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.coordinator.index_kernels import GOLDEN
from kvmesh.coordinator.index_store import PageStore, PromptKeys
from kvmesh.types import PageHash


def _h(i: int, width: int = 32) -> PageHash:
    return PageHash(hashlib.sha256(i.to_bytes(8, "little")).digest()[:width])


def _chain(start: int, n: int, width: int = 32) -> list[PageHash]:
    return [_h(start + k, width) for k in range(n)]


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
    homes = store._table[((keys * GOLDEN) >> store._table_shift).astype(np.int64)]
    return int((homes != store.find(hashes)).sum())


@pytest.mark.parametrize("seed", range(8))
def test_find_gives_every_digest_its_row_in_a_crowded_table_with_tombstones(seed: int) -> None:
    """The compiled table (`find_rows`, `place_rows`, `unplace_rows`): after stores and
    removals in a small table that grows, with digests crowding one home slot and digests
    of two widths, every row in use is found by its digest and nothing else is found."""
    rng = random.Random(seed)
    store = PageStore(min_slots=16)
    for slot in range(3):
        store.ensure_slot(slot)
    crowd = [PageHash(b"samekey!" + k.to_bytes(24, "little")) for k in range(1, 30)]
    chains = [_chain(k * 100, 40) for k in range(60)] + [crowd]
    chains += [_chain(10**5 + k * 100, 10, 16) for k in range(5)]  # narrow: lengths compared
    for c in chains:
        slot = rng.randrange(3)
        store.store([(c, None)], slot, 1 << rng.randrange(4) << 4 * slot)
    for c in rng.sample(chains, 30):  # holes, ghosts and tombstones in the table
        start = rng.randrange(len(c))
        for slot in range(3):
            store.remove(c[start : start + rng.randint(1, 8)], slot, 0b1111 << 4 * slot)
    used = np.flatnonzero(store._length[: store._top] > 0)
    digests = store._digests(used)
    assert _displaced(store, [d for d in digests if len(d) == 32]) > 0  # probing on is exercised
    assert np.array_equal(store.find(digests), used)
    gone = [h for c in chains for h in c if h not in set(digests)]
    never = [*_chain(10**7, 50), PageHash(b"samekey!" + (99).to_bytes(24, "little"))]
    never += [h[:16] for h in chains[0]] + [h[:8] for h in crowd]  # a prefix of a digest
    never += [PageHash(h + bytes(16)) for h in chains[-1]]  # a narrow one's padded words
    assert len(gone) > 0
    assert (store.find(gone + never) == -1).all()
    store.check_invariants([0, 1, 2])


def test_prompt_keys_of_other_widths_and_zero_digests_take_the_general_path() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    chain = _chain(0, 6)
    store.store([(chain, None)], 0, 1)
    zero = PageHash(bytes(32))
    for prompt in ([*chain[:2], PageHash(b"x" * 16)], [zero, *chain], [*chain[:3], zero]):
        keys = PromptKeys.of([prompt])
        assert keys.width == 0
        assert store.walk(keys) is None
    assert PromptKeys.of([chain]).width == 32


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
    """One `PromptKeys` shared by stores whose tables differ in size (each walk finds the home
    slots of its own table) walks each store as `find` and the masks give."""
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
    keys = PromptKeys.of(prompts)
    for store in (small, large, small):
        if not store._top or not any(prompts):
            continue
        rows, _ = _walked(store, prompts, 2, keys)
        for i, prompt in enumerate(prompts):
            want = [(slot, _prefix_by_find(store, prompt, slot)) for slot in range(2)]
            assert sorted(rows[i]) == [(slot, n) for slot, n in want if n]


_OFF_DEVICE = int("e" * 20, 16)  # the cpu, disk and other bits of 20 slots


def _prefix_by_find(store: PageStore, prompt: list[PageHash], slot: int) -> int:
    """How many pages from the first `slot` holds, by the general path (`find`, masks)."""
    n = 0
    for mid in _holder_ids_by_find(store, prompt):
        if not store.masks[mid] >> (4 * slot) & 0b1111:
            break
        n += 1
    return n


def _walked(
    store: PageStore, prompts: list[list[PageHash]], slots: int, keys: PromptKeys | None = None
) -> tuple[list[list[tuple[int, int]]], list[bool]]:
    """`store.walk` of `prompts` (by `keys`, else their own): per prompt its (slot, length)
    rows in the order given, and whether it was flagged (a page off the device)."""
    k = store.walk(keys or PromptKeys.of(prompts))
    assert k is not None
    w = store.walker
    rows: list[list[tuple[int, int]]] = [[] for _ in prompts]
    found = zip(w.prompt[:k].tolist(), w.slot[:k].tolist(), w.length[:k].tolist(), strict=True)
    for p, slot, n in found:
        assert 0 <= slot < slots and n > 0
        rows[p].append((slot, n))
    return rows, w.flagged[: len(prompts)].tolist()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slots=st.integers(1, 20),
    width=st.sampled_from([8, 16, 32]),
    chains=st.integers(1, 60),
    stored=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 19), st.integers(0, 3)), max_size=40),
    removed=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 39), st.integers(0, 19)), max_size=10),
    kept=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=20),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_compiled_walk_gives_every_slots_prefix_as_the_general_path(
    slots: int,
    width: int,
    chains: int,
    stored: list[tuple[int, int, int]],
    removed: list[tuple[int, int, int]],
    kept: list[tuple[int, int, int]],
    seed: int,
) -> None:
    """`walk` (one compiled call for a batch, probing a small, crowded table) gives every
    slot's prefix of every prompt as `find` and the masks do, slots in the order they drop
    out (depth, then slot: the general path's order), with masks interned between walks
    described before the next; it flags exactly the prompts with a page held off the
    device within some slot's prefix. Engine (8-byte) and SHA-256 digests alike."""
    rng = random.Random(seed)
    store = PageStore(min_slots=16)
    for slot in range(slots):
        store.ensure_slot(slot)
    all_chains = [_chain(k * 100, 40, width) for k in range(chains)]
    for k, slot, tier in stored:
        chain = all_chains[k % chains]
        slot %= slots
        store.store([(chain[: rng.randint(1, 40)], None)], slot, 1 << tier << 4 * slot)
    for k, start, slot in removed:  # holes, ghosts and tombstones
        slot %= slots
        store.remove(all_chains[k % chains][start : start + 3], slot, 0b1111 << 4 * slot)
    prompts = [
        all_chains[k % chains][:n] + _chain(10**6 + 100 * i, fresh, width)
        for i, (k, n, fresh) in enumerate(kept)
    ]
    if not store._top or not any(prompts):  # nothing to walk: the general path answers
        assert store.walk(PromptKeys.of(prompts)) is None
        return
    for _ in range(2):  # a second walk after more masks were interned
        rows, flagged = _walked(store, prompts, slots)
        for i, prompt in enumerate(prompts):
            want = [(slot, _prefix_by_find(store, prompt, slot)) for slot in range(slots)]
            held = sorted([(s, n) for s, n in want if n], key=lambda sn: (sn[1], sn[0]))
            assert rows[i] == held
            longest = max((n for _, n in held), default=0)
            walked = _holder_ids_by_find(store, prompt)[:longest]
            assert flagged[i] == any(store.masks[mid] & _OFF_DEVICE for mid in walked)
        chain = all_chains[rng.randrange(chains)]
        slot = rng.randrange(slots)
        store.store([(chain[:5], None)], slot, 0b0010 << 4 * slot)  # new masks, off device
    store.check_invariants(list(range(slots)))


def test_the_walk_leaves_digests_of_several_widths_to_the_general_path() -> None:
    store = PageStore(min_slots=16)
    store.ensure_slot(0)
    chain = _chain(0, 6)
    store.store([(chain, None)], 0, 1)
    assert store.walk(PromptKeys.of([chain[:3]])) == 1  # one slot holds a prefix
    assert store.walk(PromptKeys.of([_chain(0, 3, 8)])) is None  # not the store's width
    assert store.walk(PromptKeys.of([[*chain[:2], PageHash(b"x" * 16)]])) is None
    store.store([([PageHash(b"short")], None)], 0, 1)  # now narrow: compares lengths
    assert store.walk(PromptKeys.of([chain[:3]])) is None


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
    rows, flagged = _walked(store, prompts, 1)
    assert rows == [[(0, 19)], [(0, 3)], [], [(0, 19)]]
    assert flagged == [False] * 4


@pytest.mark.parametrize("crowded", [False, True])
def test_a_batch_repeating_new_digests_ends_as_its_events_stored_one_by_one(
    crowded: bool,
) -> None:
    """Conversations sharing a system prompt not indexed yet, stored in one batch: each new
    digest gets one row, made where it first appears, and the store ends as it does with the
    same events stored one call each (no digest repeating within a call), parents included
    (a page stored twice takes the parent of its last appearance). `crowded`: digests
    sharing their first 8 bytes, told apart by whole rows."""

    def page(i: int) -> PageHash:
        return PageHash(b"samekey!" + i.to_bytes(24, "little")) if crowded else _h(i)

    system = [page(k) for k in range(4)]
    convs = [[*system, *(page(100 + 10 * c + k) for k in range(6))] for c in range(8)]
    moved = ([page(100), page(900)], system[1])  # conversation 0's page again, another parent
    events = [*((conv, None) for conv in convs), moved]
    together, one_by_one = PageStore(min_slots=64), PageStore(min_slots=64)
    for store in (together, one_by_one):
        store.ensure_slot(0)
        store.ensure_slot(1)
    together.store(events, 0, 1)
    assert together.parent(page(100)) == system[1]
    together.store(events[:3], 1, 1)  # found now: the general path
    for event in events:
        one_by_one.store([event], 0, 1)
    for event in events[:3]:
        one_by_one.store([event], 1, 1)
    distinct = {h for hs, _ in events for h in hs}
    assert len(together) == len(distinct) == len(one_by_one)
    assert together.items() == one_by_one.items()
    together.check_invariants([0, 1])
    assert _walked(together, convs, 2) == _walked(one_by_one, convs, 2)
