"""The global index: longest prefix per worker, sequence order, staleness, snapshots."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

import pytest

from kvmesh.coordinator.index import ApplyResult, GlobalIndex
from kvmesh.errors import EventDecodeError, InvalidInput, InvariantViolation, UnknownWorker
from kvmesh.events import (
    AllPagesCleared,
    EventBatch,
    KVEvent,
    PagesRemoved,
    PagesStored,
    decode_batch,
    encode_batch,
    make_batch,
)
from kvmesh.types import PageHash, WorkerId

A, B, C = WorkerId("worker-a"), WorkerId("worker-b"), WorkerId("worker-c")


def chain(n: int, seed: str = "p") -> list[PageHash]:
    """n chained page hashes (each names its whole prefix, as real ones do)."""
    out: list[PageHash] = []
    parent = seed.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(PageHash(parent))
    return out


def stored(hashes: list[PageHash], parent: PageHash | None = None, medium: str = "gpu") -> KVEvent:
    return PagesStored(tuple(hashes), parent, (), 16, None, medium)


def batch(
    worker: WorkerId, seq: int, *events: KVEvent, inc: str = "i1", snapshot: bool = False
) -> EventBatch:
    return make_batch(events, worker, inc, seq, snapshot=snapshot)


P = chain(8)


def test_each_worker_gets_its_longest_held_prefix() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:6])))
    ix.apply(batch(B, 0, stored(P[:2])))
    ix.apply(batch(C, 0, stored(chain(3, "other"))))
    result = ix.match(P)
    assert result.pages == {A: 6, B: 2}
    assert result.longest() == (A, 6)
    ix.check_invariants()


def test_a_worker_missing_a_middle_page_matches_only_up_to_it() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:6])))
    ix.apply(batch(B, 0, stored(P[:6])))
    ix.apply(batch(A, 1, PagesRemoved((P[2],), "gpu")))
    assert ix.match(P).pages == {A: 2, B: 6}


def test_match_stops_at_the_first_page_nobody_holds() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:3]), stored(P[4:])))
    assert ix.match(P).pages == {A: 3}
    assert ix.match(P[3:]).pages == {}


def test_match_names_the_tiers_of_the_matched_prefix() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2], medium="gpu"), stored(P[2:4], P[1], medium="cpu")))
    ix.apply(batch(B, 0, stored(P[:4], medium="CPU")))
    result = ix.match(P[:3])
    assert result.pages == {A: 3, B: 3}
    assert result.tiers == {A: ("gpu", "cpu"), B: ("cpu",)}


def test_removal_with_a_medium_keeps_the_page_in_other_tiers() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2], medium="gpu"), stored(P[:2], medium="cpu")))
    ix.apply(batch(A, 1, PagesRemoved((P[0],), "gpu")))
    assert ix.holders(P[0]) == {A: ("cpu",)}
    ix.apply(batch(A, 2, PagesRemoved((P[0],), None)))
    assert ix.holders(P[0]) == {}
    assert P[0] not in ix
    ix.check_invariants()


def test_a_gap_marks_the_worker_stale_until_the_missing_batch_arrives() -> None:
    ix = GlobalIndex()
    assert ix.apply(batch(A, 0, stored(P[:2]))) is ApplyResult.REPLACED
    assert ix.apply(batch(A, 2, stored(P[3:4], P[2]))) is ApplyResult.STALE
    assert ix.is_stale(A)
    assert ix.match(P).pages == {A: 2}  # the held-back batch is not applied yet
    assert ix.apply(batch(A, 1, stored(P[2:3], P[1]))) is ApplyResult.APPLIED
    assert not ix.is_stale(A)
    assert ix.match(P).pages == {A: 4}
    ix.check_invariants()


def test_a_snapshot_replaces_a_stale_workers_entries_and_clears_stale() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:5])))
    ix.apply(batch(A, 3, PagesRemoved((P[0],), "gpu")))
    assert ix.is_stale(A)
    assert ix.apply(batch(A, 4, stored(P[:2]), snapshot=True)) is ApplyResult.REPLACED
    assert not ix.is_stale(A)
    assert ix.worker_pages(A) == frozenset(P[:2])
    assert ix.apply(batch(A, 3, PagesRemoved((P[0],), "gpu"))) is ApplyResult.IGNORED
    assert ix.apply(batch(A, 5, stored(P[2:3], P[1]))) is ApplyResult.APPLIED
    assert ix.match(P).pages == {A: 3}


def test_duplicate_and_old_batches_are_ignored() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2])))
    ix.apply(batch(A, 1, PagesRemoved((P[1],), "gpu")))
    assert ix.apply(batch(A, 0, stored(P[:2]))) is ApplyResult.IGNORED
    assert ix.apply(batch(A, 1, PagesRemoved((P[1],), "gpu"))) is ApplyResult.IGNORED
    assert ix.match(P).pages == {A: 1}


def test_an_old_snapshot_is_ignored() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2])))
    ix.apply(batch(A, 1, stored(P[2:3], P[1])))
    assert ix.apply(batch(A, 0, stored(P[:1]), snapshot=True)) is ApplyResult.IGNORED
    assert ix.match(P).pages == {A: 3}


def test_a_new_incarnation_replaces_everything_of_the_old_one() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:4]), inc="old"))
    ix.apply(batch(A, 1, stored(chain(2, "x")), inc="old"))
    assert ix.apply(batch(A, 0, stored(P[:1]), inc="new")) is ApplyResult.REPLACED
    assert ix.worker_pages(A) == frozenset(P[:1])
    assert len(ix) == 1
    assert ix.apply(batch(A, 2, stored(P[1:4], P[0]), inc="old")) is ApplyResult.IGNORED
    assert ix.worker_pages(A) == frozenset(P[:1])


def test_a_new_incarnations_first_batch_past_seq_zero_is_a_gap() -> None:
    ix = GlobalIndex()
    assert ix.apply(batch(A, 7, stored(P[:2]), inc="restarted")) is ApplyResult.STALE
    assert ix.is_stale(A)
    assert ix.apply(batch(A, 7, stored(P[:3]), inc="restarted", snapshot=True)) is (
        ApplyResult.REPLACED
    )
    assert not ix.is_stale(A)
    assert ix.match(P).pages == {A: 3}


def test_overflowing_the_reorder_window_requires_a_snapshot() -> None:
    ix = GlobalIndex(reorder_window=2)
    ix.apply(batch(A, 0, stored(P[:1])))
    for seq in (2, 3, 4):
        assert ix.apply(batch(A, seq, stored(P[seq : seq + 1], P[seq - 1]))) is ApplyResult.STALE
    # The missing batch comes, but the held-back ones were dropped: still stale.
    assert ix.apply(batch(A, 1, stored(P[1:2], P[0]))) is ApplyResult.STALE
    assert ix.is_stale(A)
    assert ix.apply(batch(A, 4, stored(P[:5]), snapshot=True)) is ApplyResult.REPLACED
    assert not ix.is_stale(A)
    ix.check_invariants()


def test_all_pages_cleared_drops_only_that_worker() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:3])))
    ix.apply(batch(B, 0, stored(P[:2])))
    ix.apply(batch(A, 1, AllPagesCleared()))
    assert ix.match(P).pages == {B: 2}
    assert ix.worker_pages(A) == frozenset()


def test_removing_a_worker_drops_all_its_entries_and_frees_its_slot() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:3])))
    ix.apply(batch(B, 0, stored(P[:5])))
    assert ix.remove_worker(B) == 5
    assert ix.match(P).pages == {A: 3}
    assert len(ix) == 3
    ix.apply(batch(C, 0, stored(P[:1])))  # takes B's slot; no bit of B may leak into C
    assert ix.match(P).pages == {A: 3, C: 1}
    ix.check_invariants()


def test_shared_pages_are_counted_once() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:4])))
    ix.apply(batch(B, 0, stored(P[:4])))
    assert len(ix) == 4
    assert ix.num_entries() == 8


def test_parent_links_give_the_chain() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2]), stored(P[2:5], P[1])))
    assert ix.parent(P[0]) is None
    assert ix.parent(P[3]) == P[2]
    assert ix.chain(P[4]) == P[:5]


def test_unknown_worker_is_rejected_when_registration_is_required() -> None:
    ix = GlobalIndex(require_registration=True)
    ix.register_worker(A, "i1")
    ix.apply(batch(A, 0, stored(P[:2])))
    before = ix.snapshot()
    with pytest.raises(UnknownWorker, match="register"):
        ix.apply(batch(B, 0, stored(P[:3])))
    assert ix.snapshot() == before


def test_a_bad_batch_is_rejected_before_anything_changes() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2])))
    before = ix.snapshot()
    bad = make_batch(
        [stored(P[2:4], P[1]), PagesRemoved(("not-bytes",), "gpu")],  # type: ignore[arg-type]
        A,
        "i1",
        1,
    )
    with pytest.raises(EventDecodeError, match="event 1"):
        ix.apply(bad)
    with pytest.raises(EventDecodeError, match="seq"):
        ix.apply(EventBatch((), A, "i1", -1))
    with pytest.raises(EventDecodeError):
        ix.apply_encoded(b"\xc1 definitely not msgpack")
    assert ix.snapshot() == before


def test_apply_encoded_decodes_and_applies() -> None:
    ix = GlobalIndex()
    assert ix.apply_encoded(encode_batch(batch(A, 0, stored(P[:3])))) is ApplyResult.REPLACED
    assert ix.match(P).pages == {A: 3}


def test_a_decoded_batch_applies_as_a_checked_one_does() -> None:
    checked, decoded = GlobalIndex(), GlobalIndex()
    batches = [
        batch(A, 0, stored(P[:5])),
        batch(B, 0, stored(P[:2])),
        batch(A, 1, PagesRemoved((P[4],), None)),
        batch(A, 3, stored(P[5:7], P[4])),  # past a gap: held back, stale
    ]
    for b in batches:
        want = checked.apply(b)
        assert decoded.apply_decoded(decode_batch(encode_batch(b))) is want
    assert decoded.match(P).pages == checked.match(P).pages == {A: 4, B: 2}
    assert decoded.stale_workers() == checked.stale_workers() == {A}
    decoded.check_invariants()


def test_snapshot_then_restore_gives_identical_matches_and_state() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:6], medium="gpu"), stored(P[:2], medium="cpu")))
    ix.apply(batch(B, 0, stored(P[:3])))
    ix.apply(batch(B, 2, stored(chain(2, "y"))))  # B is stale
    data = ix.snapshot()
    copy = GlobalIndex()
    copy.restore(data)
    copy.check_invariants()
    assert copy.snapshot() == data
    for n in range(len(P) + 1):
        assert copy.match(P[:n]) == ix.match(P[:n])
    assert copy.is_stale(B)
    # The restored stale worker still needs a snapshot: its held-back batch is gone.
    assert copy.apply(batch(B, 1, stored(P[3:4], P[2]))) is ApplyResult.STALE


def test_restore_rejects_garbage_and_keeps_the_index() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2])))
    before = ix.snapshot()
    for data in (b"junk", b"\x80", encode_batch(batch(A, 0, stored(P[:1])))):
        with pytest.raises(InvalidInput):
            ix.restore(data)
    assert ix.snapshot() == before


def test_check_invariants_reports_a_corrupted_index() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2])))
    ix._store._holders[ix._store.find([P[0]])[0]] = 0
    with pytest.raises(InvariantViolation, match="holder"):
        ix.check_invariants()


def test_a_late_batch_of_an_unseen_earlier_incarnation_is_ignored_by_its_timestamp() -> None:
    ix = GlobalIndex()
    early = EventBatch((stored(P[:4]),), A, "first-life", 0, ts=10.0)
    ix.apply(EventBatch((stored(P[:2]),), A, "second-life", 0, ts=20.0))
    assert ix.apply(early) is ApplyResult.IGNORED
    assert ix.worker_state(A).incarnation == "second-life"
    assert ix.apply(EventBatch((stored(P[:3]),), A, "third-life", 0, ts=30.0)) is (
        ApplyResult.REPLACED
    )
    assert ix.worker_pages(A) == frozenset(P[:3])


@pytest.mark.parametrize("ts", [math.inf, math.nan, -math.inf])
def test_a_non_finite_timestamp_cannot_lock_out_later_incarnations(ts: float) -> None:
    ix = GlobalIndex()
    ix.apply(EventBatch((stored(P[:2]),), A, "poisoned", 0, ts=ts))
    assert ix.apply(EventBatch((stored(P[:3]),), A, "next-life", 0, ts=5.0)) is (
        ApplyResult.REPLACED
    )
    assert ix.worker_pages(A) == frozenset(P[:3])


def test_an_all_zero_page_hash_is_matched_after_other_pages_are_freed() -> None:
    ix = GlobalIndex()
    zero = PageHash(bytes(32))
    ix.apply(batch(A, 0, stored(P[:1]), stored([zero])))
    ix.apply(batch(A, 1, PagesRemoved((P[0],), "gpu")))  # its storage is zeroed and reused
    assert ix.match([zero]).pages == {A: 1}
    ix.check_invariants()


def test_engine_ints_and_digests_sharing_their_first_8_bytes_stay_apart() -> None:
    ix = GlobalIndex()
    engine = [PageHash(i.to_bytes(8, "big")) for i in (7, 8)]
    digests = [PageHash(h + bytes(24)) for h in engine]  # same compact keys
    ix.apply(batch(A, 0, stored(engine)))
    ix.apply(batch(B, 0, stored(digests)))
    assert ix.match(engine).pages == {A: 2}
    assert ix.match(digests).pages == {B: 2}
    assert ix.parent(digests[1]) == digests[0]
    ix.apply(batch(A, 1, PagesRemoved(tuple(engine), None)))
    assert engine[0] not in ix
    assert ix.match(digests).pages == {B: 2}
    ix.check_invariants()


def test_a_removed_parent_is_still_named_by_its_held_child() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:3])))
    ix.apply(batch(A, 1, PagesRemoved((P[1],), "gpu")))
    assert P[1] not in ix
    assert ix.parent(P[2]) == P[1]
    assert ix.chain(P[2]) == [P[2]]
    ix.apply(batch(A, 2, PagesRemoved((P[2],), "gpu")))  # the last kid: the parent goes too
    assert len(ix) == 1
    ix.check_invariants()


def _random_reports(rng: random.Random, n: int) -> list[list[EventBatch]]:
    """Reports of a few workers: in-order runs mostly, with gaps, repeats, snapshots, restarts."""
    pages = chain(40)
    seqs = {A: 0, B: 0, C: 0}
    incs = {A: "i1", B: "i1", C: "i1"}
    reports: list[list[EventBatch]] = []
    for _ in range(n):
        w = rng.choice((A, B, C))
        report: list[EventBatch] = []
        for _ in range(rng.randint(1, 5)):
            start = rng.randrange(len(pages))
            roll = rng.random()
            if roll < 0.6:
                ev: KVEvent = stored(pages[start : start + rng.randint(1, 8)])
            elif roll < 0.9:
                ev = PagesRemoved(tuple(pages[start : start + 3]), rng.choice((None, "gpu")))
            else:
                ev = AllPagesCleared()
            roll = rng.random()
            if roll < 0.05:
                seqs[w] += 1  # a lost batch: a gap
            elif roll < 0.08:
                incs[w], seqs[w] = f"i{rng.randrange(10**6)}", 0  # a restart
            seq = seqs[w] - 1 if roll > 0.97 and seqs[w] else seqs[w]  # a repeat
            report.append(batch(w, seq, ev, inc=incs[w], snapshot=0.08 <= roll < 0.1))
            seqs[w] = max(seqs[w], seq + 1)
        reports.append(report)
    return reports


@pytest.mark.parametrize("seed", range(12))
def test_apply_many_gives_what_applying_one_by_one_gives(seed: int) -> None:
    one_by_one, many = GlobalIndex(), GlobalIndex()
    for report in _random_reports(random.Random(seed), 60):
        want = [one_by_one.apply_decoded(b) for b in report]
        assert many.apply_many(report) == want
        assert many.snapshot() == one_by_one.snapshot()
    many.check_invariants()
    assert many.match(chain(40)).pages == one_by_one.match(chain(40)).pages


def test_apply_many_runs_in_order_batches_of_one_worker_as_one() -> None:
    ix = GlobalIndex()
    ix.apply(batch(A, 0, stored(P[:2])))
    runs: list[int] = []
    original = ix._apply_run

    def counting(run: Sequence[EventBatch]) -> None:
        runs.append(len(run))
        original(run)

    ix._apply_run = counting  # type: ignore[method-assign]
    report = [batch(A, 1, stored(P[2:4], P[1])), batch(A, 2, stored(P[4:6], P[3])), batch(A, 4)]
    assert ix.apply_many(report) == [ApplyResult.APPLIED, ApplyResult.APPLIED, ApplyResult.STALE]
    assert runs == [2]  # the third is past a gap: one by one, held back
    assert ix.match(P).pages == {A: 6}


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_match_many_gives_what_matching_one_prompt_at_a_time_gives(seed: int, narrow: bool) -> None:
    """A batch's lookups (`match_many`, `overlaps_many`, `prefix_table`: one compiled walk
    for them all) answer as one prompt at a time does, tiers included; with `narrow`, a
    short digest in the store sends every lookup down the general path."""
    rng = random.Random(seed)
    ix = GlobalIndex()
    if narrow:
        ix.apply(batch(WorkerId("worker-e"), 0, stored([PageHash(b"engine-8")])))
    pages = chain(40)
    prompts = [
        [],
        pages,
        chain(5, "nobody"),
        pages[:3] + chain(4, "tail"),
        [pages[rng.randrange(40)]],
        pages[rng.randrange(40) :],
    ]
    tiered = WorkerId("worker-d")  # holds pages off the device, so tiers are named
    for seq, report in enumerate(_random_reports(rng, 60)):
        ix.apply_many(report)
        start = rng.randrange(40)
        medium = rng.choice(("gpu", "cpu", "disk"))
        ix.apply(batch(tiered, seq, stored(pages[start : start + 6], medium=medium)))
        assert ix.match_many(prompts) == [ix.match(p) for p in prompts]
        overlaps = [ix.overlaps(p) for p in prompts]
        assert ix.overlaps_many(prompts) == overlaps
        assert [o[0] for o in overlaps] == [ix.match(p).pages for p in prompts]
        table = ix.prefix_table(prompts)
        assert [table.overlaps(i) for i in range(len(prompts))] == overlaps
        for i, (found, _) in enumerate(overlaps):  # the row holds the prefixes, tiered or not
            row = table.lengths[i]
            assert {w: int(row[k]) for k, w in enumerate(table.workers) if row[k]} == found
