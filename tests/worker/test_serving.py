"""A worker serving requests: hit, pulled and computed pages all give the from-scratch answer."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from kvmesh.config import ModelConfig
from kvmesh.errors import (
    InvalidInput,
    KVMeshError,
    PoolExhausted,
    RequestCancelled,
    RequestExpired,
    TransportError,
)
from kvmesh.events import PagesStored
from kvmesh.hashing import ExtraKeys, PageHasher, RequestHashes
from kvmesh.metrics import REQUEST_HASH_MISMATCHES
from kvmesh.types import PageHash
from kvmesh.worker.cache_manager import KVCacheManager, Request
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import IncomingPage, PageService, PullOutcome
from kvmesh.worker.serving import (
    GenerationResult,
    PullFn,
    PullRequest,
    RouteHint,
    ServingEngine,
)

PAGE = 8
CFG = ModelConfig(num_layers=2, prefill_chunk_tokens=3 * PAGE)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CFG)


def make_engine(
    model: TinyTransformer, num_pages: int = 64, chunk_tokens: int | None = None, **kw: object
) -> ServingEngine:
    pool = PagePool(num_pages, page_size=PAGE)
    store = KVStore(num_pages, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, PAGE, CFG.dtype)
    return ServingEngine(
        model,
        KVCacheManager(pool, PAGE),
        store,
        PageHasher(PAGE),
        chunk_tokens=chunk_tokens,
        **kw,  # type: ignore[arg-type]
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


def assert_idle_and_consistent(engine: ServingEngine) -> None:
    engine.pool.check_invariants()
    assert engine.pool.get_num_free_pages() == engine.pool.num_pages - 1
    assert engine.cache_manager.request_ids() == []


Exported = list[tuple[PageHash, PageBlob]]


def copying_pull_fn(
    source: ServingEngine,
    asked: list[PullRequest],
    target: ServingEngine,
    tamper: Callable[[Exported], Exported] | None = None,
) -> PullFn:
    """An in-process peer: the asked pages `source` holds (in order, up to the first it
    lacks), optionally `tamper`ed with, taken into `target`'s pool one by one through a
    `PageService` receiver proven against the request, as every transport takes them;
    the first refused page ends the pull with its error."""
    into = PageService(target.pool, target.kv_store, target.hasher, lock=target.lock)

    def pull(req: PullRequest) -> PullOutcome:
        asked.append(req)
        pages: Exported = []
        with source.lock:
            for h in req.page_hashes:
                page = source.pool.get_cached_page(h)
                if page is None:
                    break
                pages.append((h, source.kv_store.export_page(page.page_id, copy=True)))
        receiver = into.receiving(req.proofs(PAGE))
        inserted = 0
        for h, blob in tamper(pages) if tamper is not None else pages:
            try:
                inserted += receiver.insert_many([IncomingPage(h, None, (), blob)])[0]
            except KVMeshError as exc:
                error = f"{type(exc).__name__}: {exc}"
                return PullOutcome(req.page_hashes, "copy", inserted, error)
        return PullOutcome(req.page_hashes, "copy", inserted)

    return pull


def nothing_pulled(req: PullRequest) -> PullOutcome:
    """What a peer that had none of the pages answers."""
    return PullOutcome(req.page_hashes, "copy")


def test_the_same_prompt_twice_hits_the_second_time_with_identical_tokens(
    model: TinyTransformer,
) -> None:
    engine = make_engine(model)
    p = prompt(5 * PAGE + 3)
    first = engine.serve("r1", p, 10)
    second = engine.serve("r2", p, 10)
    assert first.pages_hit_local == 0 and first.pages_computed == 6
    assert second.pages_hit_local == 5 and second.pages_computed == 1
    assert second.cached_tokens == 5 * PAGE
    assert second.tokens == first.tokens == tuple(engine.compute_from_scratch(p, 10))
    assert_idle_and_consistent(engine)


def test_a_prompt_of_whole_pages_recomputes_its_last_page(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(4 * PAGE, seed=1)
    engine.serve("a", p, 4)
    again = engine.serve("b", p, 4)
    assert (again.pages_hit_local, again.pages_computed) == (3, 1)
    assert list(again.tokens) == engine.compute_from_scratch(p, 4)


def test_a_shared_prefix_is_reused_and_only_the_rest_is_computed(model: TinyTransformer) -> None:
    engine = make_engine(model)
    system = prompt(6 * PAGE, seed=2)
    a = system + prompt(2 * PAGE + 5, seed=3)
    b = system + prompt(3 * PAGE + 1, seed=4)
    engine.serve("a", a, 6)
    rb = engine.serve("b", b, 6)
    assert rb.pages_hit_local == 6
    assert rb.pages_computed == 4
    assert list(rb.tokens) == engine.compute_from_scratch(b, 6)


@pytest.mark.parametrize("chunk_pages", [1, 2, 64])
@pytest.mark.parametrize("length", [1, PAGE - 1, PAGE, 3 * PAGE + 1, 9 * PAGE])
def test_results_equal_compute_from_scratch_for_any_length_and_chunking(
    model: TinyTransformer, length: int, chunk_pages: int
) -> None:
    engine = make_engine(model, chunk_tokens=chunk_pages * PAGE)
    p = prompt(length, seed=length)
    expected = engine.compute_from_scratch(p, 7)
    assert list(engine.serve("cold", p, 7).tokens) == expected
    assert list(engine.serve("warm", p, 7).tokens) == expected
    assert_idle_and_consistent(engine)


def test_cached_pages_hold_the_kv_of_a_whole_prompt_pass(model: TinyTransformer) -> None:
    engine = make_engine(model, chunk_tokens=PAGE)  # strictly page by page
    p = prompt(7 * PAGE + 2, seed=9)
    engine.serve("r", p, 1)
    _, whole_kv = model.prefill(p)
    hashes = PageHasher(PAGE).hash_prompt(p)
    for i, h in enumerate(hashes):
        page = engine.pool.get_cached_page(h)
        assert page is not None
        stored = engine.kv_store.read_page(page.page_id)  # [L, 2, P, H, D]
        torch.testing.assert_close(
            stored, whole_kv[:, :, i * PAGE : (i + 1) * PAGE], atol=ATOL, rtol=0
        )


def test_serving_caches_the_full_prompt_pages_and_announces_them(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(3 * PAGE + 4, seed=11)
    engine.serve("r", p, 2)
    events = engine.take_events()
    stored = [h for ev in events if isinstance(ev, PagesStored) for h in ev.page_hashes]
    assert stored == PageHasher(PAGE).hash_prompt(p)
    assert engine.pool.cached_hashes() == set(stored)
    assert engine.take_events() == []


def test_the_routers_page_hashes_are_taken_when_they_check_out(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(4 * PAGE + 3, seed=21)
    hashes = PageHasher(PAGE).hash_prompt(p)
    before = REQUEST_HASH_MISMATCHES.value(worker=engine.worker_id)
    first = engine.serve("a", p, 3, page_hashes=hashes)
    again = engine.serve("b", p, 3, page_hashes=hashes)
    assert engine.pool.cached_hashes() == set(hashes)
    assert again.pages_hit_local == 4
    assert list(first.tokens) == list(again.tokens) == engine.compute_from_scratch(p, 3)
    assert REQUEST_HASH_MISMATCHES.value(worker=engine.worker_id) == before


def test_a_routers_hashes_of_another_seed_are_counted_and_replaced_by_the_workers(
    model: TinyTransformer,
) -> None:
    engine = make_engine(model)
    p = prompt(3 * PAGE + 1, seed=22)
    wrong = PageHasher(PAGE, seed="another cluster").hash_prompt(p)
    before = REQUEST_HASH_MISMATCHES.value(worker=engine.worker_id)
    result = engine.serve("a", p, 2, page_hashes=wrong)
    assert REQUEST_HASH_MISMATCHES.value(worker=engine.worker_id) == before + 1
    assert engine.pool.cached_hashes() == set(PageHasher(PAGE).hash_prompt(p))
    assert list(result.tokens) == engine.compute_from_scratch(p, 2)


def test_cache_salts_separate_tenants_completely(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(6 * PAGE, seed=12)
    alice, bob = ExtraKeys(cache_salt="alice"), ExtraKeys(cache_salt="bob")
    ra = engine.serve("a", p, 5, extra_keys=alice)
    rb = engine.serve("b", p, 5, extra_keys=bob)
    plain = engine.serve("c", p, 5)
    assert rb.pages_hit_local == 0 and plain.pages_hit_local == 0
    assert engine.serve("a2", p, 5, extra_keys=alice).pages_hit_local == 5
    assert ra.tokens == rb.tokens == plain.tokens  # a salt changes identity, never the answer


def test_pages_pulled_from_a_peer_give_the_from_scratch_tokens(model: TinyTransformer) -> None:
    peer, engine = make_engine(model), make_engine(model)
    p = prompt(8 * PAGE + 5, seed=13)
    peer.serve("warm", p, 1)
    asked: list[PullRequest] = []
    hint = RouteHint(promised_local=0, promised_pull=8, peer="peer-0")
    result = engine.serve("r", p, 9, hint=hint, pull_fn=copying_pull_fn(peer, asked, engine))
    assert (result.pages_hit_local, result.pages_pulled, result.pages_computed) == (0, 8, 1)
    assert (result.promised_local, result.promised_pull) == (0, 8)
    assert result.pull_error is None
    assert list(result.tokens) == engine.compute_from_scratch(p, 9)
    (req,) = asked
    assert req.peer == "peer-0" and req.parent_hash is None
    assert list(req.page_hashes) == PageHasher(PAGE).hash_prompt(p)[:8]
    assert req.token_ids == tuple(p[: 8 * PAGE])
    for h in req.page_hashes:  # bit-exact copies, now cached locally
        mine, theirs = engine.pool.get_cached_page(h), peer.pool.get_cached_page(h)
        assert mine is not None and theirs is not None
        assert torch.equal(
            engine.kv_store.read_page(mine.page_id), peer.kv_store.read_page(theirs.page_id)
        )
    assert engine.serve("again", p, 9).pages_hit_local == 8
    assert_idle_and_consistent(engine)
    assert_idle_and_consistent(peer)


def test_a_pull_only_fetches_what_the_local_prefix_lacks(model: TinyTransformer) -> None:
    peer, engine = make_engine(model), make_engine(model)
    p = prompt(10 * PAGE, seed=14)
    peer.serve("warm", p, 1)
    engine.serve("head", p[: 3 * PAGE + 2], 1)  # the worker holds the first 3 pages
    asked: list[PullRequest] = []
    hint = RouteHint(promised_local=3, promised_pull=7, peer="peer-0")
    result = engine.serve("r", p, 5, hint=hint, pull_fn=copying_pull_fn(peer, asked, engine))
    assert (result.pages_hit_local, result.pages_pulled, result.pages_computed) == (3, 6, 1)
    hashes = PageHasher(PAGE).hash_prompt(p)
    assert asked[0].page_hashes == tuple(hashes[3:9])  # the last token is always recomputed
    assert asked[0].parent_hash == hashes[2]
    assert list(result.tokens) == engine.compute_from_scratch(p, 5)


def test_a_peer_that_lost_some_pages_sends_fewer_and_the_rest_is_computed(
    model: TinyTransformer,
) -> None:
    peer, engine = make_engine(model), make_engine(model)
    p = prompt(6 * PAGE + 1, seed=15)
    peer.serve("warm", p[: 2 * PAGE], 1)  # the peer holds only 2 of the 6 pages promised
    hint = RouteHint(promised_pull=6, peer="peer-0")
    result = engine.serve("r", p, 4, hint=hint, pull_fn=copying_pull_fn(peer, [], engine))
    assert (result.pages_pulled, result.pages_computed) == (2, 5)
    assert list(result.tokens) == engine.compute_from_scratch(p, 4)


def test_a_failed_pull_is_computed_instead_and_reported(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(4 * PAGE, seed=16)

    def unreachable(req: PullRequest) -> PullOutcome:
        raise TransportError(f"peer {req.peer} unreachable")

    hint = RouteHint(promised_pull=3, peer="peer-0")
    result = engine.serve("r", p, 3, hint=hint, pull_fn=unreachable)
    assert result.pull_error is not None and "unreachable" in result.pull_error
    assert (result.pages_pulled, result.pages_computed) == (0, 4)
    assert list(result.tokens) == engine.compute_from_scratch(p, 3)
    assert_idle_and_consistent(engine)


def test_an_in_place_pull_failing_part_way_counts_the_whole_pages_it_cached(
    model: TinyTransformer,
) -> None:
    peer, engine = make_engine(model), make_engine(model)
    p = prompt(6 * PAGE + 1, seed=17)
    peer.serve("warm", p, 1)
    three = copying_pull_fn(peer, [], engine, lambda pages: pages[:3])

    def lands_three_then_times_out(req: PullRequest) -> PullOutcome:
        """A peer whose stream ends after three whole pages (a deadline, say)."""
        landed = three(req)
        assert landed.inserted == 3
        return dataclasses.replace(landed, error="DeadlineExceeded: peer-0 too slow")

    hint = RouteHint(promised_pull=6, peer="peer-0")
    result = engine.serve("r", p, 4, hint=hint, pull_fn=lands_three_then_times_out)
    assert result.pull_error == "DeadlineExceeded: peer-0 too slow"
    assert (result.pages_hit_local, result.pages_pulled, result.pages_computed) == (0, 3, 4)
    assert list(result.tokens) == engine.compute_from_scratch(p, 4)
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize("damage", ["checksum", "wrong_hash", "wrong_shape"])
def test_a_bad_pulled_page_and_those_after_it_never_enter_the_pool(
    model: TinyTransformer, damage: str
) -> None:
    peer, engine = make_engine(model), make_engine(model)
    p = prompt(5 * PAGE + 3, seed=17)
    peer.serve("warm", p, 1)
    def damaged(pages: Exported) -> Exported:
        pages = list(pages)
        h, blob = pages[1]
        if damage == "checksum":
            raw = bytearray(bytes(blob.data))
            raw[3] ^= 0x7F  # sign and exponent of the first value
            pages[1] = (h, PageBlob(bytes(raw), blob.dtype, blob.shape, blob.checksum))
        elif damage == "wrong_hash":
            pages[1] = (PageHash(bytes(len(h))), blob)
        else:
            pages[1] = (h, PageBlob.from_bytes(bytes(blob.data)[:-4], blob.dtype, (1,)))
        return pages

    bad = copying_pull_fn(peer, [], engine, damaged)

    result = engine.serve("r", p, 3, hint=RouteHint(promised_pull=5, peer="p"), pull_fn=bad)
    assert result.pull_error is not None
    assert result.pages_pulled == 1 and result.pages_computed == 5  # the page before is kept
    hashes = PageHasher(PAGE).hash_prompt(p)
    assert engine.pool.cached_hashes() == set(hashes)  # 1 pulled + 4 computed full pages
    mine, theirs = engine.pool.get_cached_page(hashes[1]), peer.pool.get_cached_page(hashes[1])
    assert mine is not None and theirs is not None
    torch.testing.assert_close(  # recomputed, not the damaged bytes
        engine.kv_store.read_page(mine.page_id),
        peer.kv_store.read_page(theirs.page_id),
        atol=ATOL,
        rtol=0,
    )
    assert list(result.tokens) == engine.compute_from_scratch(p, 3)
    assert_idle_and_consistent(engine)


def test_promised_and_realized_pages_are_reported_side_by_side(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(5 * PAGE, seed=18)
    result = engine.serve("r", p, 2, hint=RouteHint(promised_local=4))  # a wrong promise
    assert (result.promised_local, result.pages_hit_local) == (4, 0)


def test_a_prompt_larger_than_the_pool_is_refused_clearly(model: TinyTransformer) -> None:
    engine = make_engine(model, num_pages=5)
    with pytest.raises(PoolExhausted, match="needs 7 pages"):
        engine.serve("big", prompt(6 * PAGE + 1), 2)
    assert_idle_and_consistent(engine)


def test_a_pool_held_by_other_requests_raises_pool_exhausted_and_leaks_nothing(
    model: TinyTransformer,
) -> None:
    engine = make_engine(model, num_pages=12)
    p = prompt(4 * PAGE + 2, seed=19)
    engine.serve("warm", p, 1)  # 4 cached pages, free
    blocker = Request("blocker", RequestHashes(engine.hasher, prompt(8 * PAGE, seed=20)))
    with engine.lock:
        assert engine.cache_manager.allocate_slots(blocker, 8 * PAGE) is not None
    free_before = engine.pool.get_num_free_pages()
    cached_before = engine.pool.cached_hashes()
    with pytest.raises(PoolExhausted, match="retry later or grow the pool"):
        engine.serve("r", p + prompt(2 * PAGE, seed=21), 3)
    engine.pool.check_invariants()
    assert engine.pool.get_num_free_pages() == free_before
    assert engine.pool.cached_hashes() == cached_before
    assert engine.cache_manager.request_ids() == ["blocker"]
    with engine.lock:
        engine.cache_manager.free(blocker)
    assert list(engine.serve("r", p, 3).tokens) == engine.compute_from_scratch(p, 3)
    assert_idle_and_consistent(engine)


def test_concurrent_requests_get_correct_answers_and_leave_the_pool_clean(
    model: TinyTransformer,
) -> None:
    engine = make_engine(model, num_pages=128, max_concurrent=3)
    system = prompt(5 * PAGE, seed=22)
    prompts = [system + prompt(PAGE * (i % 3) + i, seed=100 + i) for i in range(12)]
    expected = [engine.compute_from_scratch(q, 6) for q in prompts]
    with ThreadPoolExecutor(max_workers=6) as ex:
        results = list(ex.map(lambda iq: engine.serve(f"r{iq[0]}", iq[1], 6), enumerate(prompts)))
    assert [list(r.tokens) for r in results] == expected
    assert sum(r.pages_hit_local for r in results) > 0
    assert_idle_and_consistent(engine)


def test_waiting_requests_count_as_queued_load(model: TinyTransformer) -> None:
    engine = make_engine(model, max_concurrent=1)
    entered, release = threading.Event(), threading.Event()

    def slow_pull(req: PullRequest) -> PullOutcome:
        entered.set()
        release.wait(timeout=30)
        return nothing_pulled(req)

    p = prompt(3 * PAGE, seed=23)
    with ThreadPoolExecutor(max_workers=2) as ex:
        first = ex.submit(
            engine.serve, "a", p, 2, hint=RouteHint(promised_pull=2, peer="x"), pull_fn=slow_pull
        )
        assert entered.wait(timeout=30)
        second = ex.submit(engine.serve, "b", p, 2)
        for _ in range(3000):
            if engine.load().waiting == 1:
                break
            threading.Event().wait(0.01)
        load = engine.load()
        assert (load.running, load.waiting) == (1, 1)
        assert (load.prefill_tokens, load.decode_tokens) == (2 * len(p), 4)
        release.set()
        ra, rb = first.result(timeout=60), second.result(timeout=60)
    assert ra.tokens == rb.tokens
    assert rb.timings.queue_ms >= 0
    assert engine.load().running == engine.load().waiting == 0


def test_a_request_id_already_running_is_refused(model: TinyTransformer) -> None:
    engine = make_engine(model, max_concurrent=2)
    errors: list[Exception] = []

    def reentrant_pull(req: PullRequest) -> PullOutcome:
        try:
            engine.serve("same", prompt(4), 1)
        except InvalidInput as exc:
            errors.append(exc)
        return nothing_pulled(req)

    hint = RouteHint(promised_pull=2, peer="x")
    engine.serve("same", prompt(3 * PAGE), 1, hint=hint, pull_fn=reentrant_pull)
    assert len(errors) == 1 and "already being served" in str(errors[0])
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize(
    ("tokens", "max_tokens", "message"),
    [
        ([], 3, "empty"),
        ([1, 256], 3, r"\[0, 256\)"),
        ([1, -1], 3, r"\[0, 256\)"),
        ([1, 2], -1, "max_tokens"),
        (["a"], 1, "integers"),
        ([1] * CFG.max_positions, 2, "max_positions"),
    ],
)
def test_bad_requests_are_refused_before_touching_the_pool(
    model: TinyTransformer, tokens: list[object], max_tokens: int, message: str
) -> None:
    engine = make_engine(model, num_pages=2048)
    with pytest.raises(InvalidInput, match=message):
        engine.serve("bad", tokens, max_tokens)  # type: ignore[arg-type]
    assert_idle_and_consistent(engine)
    assert engine.take_events() == []


def test_zero_max_tokens_prefills_and_caches_without_an_answer(model: TinyTransformer) -> None:
    engine = make_engine(model)
    p = prompt(3 * PAGE + 1, seed=24)
    result = engine.serve("prefill-only", p, 0)
    assert result.tokens == ()
    assert engine.serve("decode", p, 4).pages_hit_local == 3


def test_timings_are_consistent(model: TinyTransformer) -> None:
    engine = make_engine(model)
    result: GenerationResult = engine.serve("r", prompt(40), 5, arrival_time=None)
    t = result.timings
    assert min(t.queue_ms, t.pull_ms, t.prefill_ms) >= 0
    assert t.queue_ms + t.prefill_ms <= t.ttft_ms <= t.total_ms


def test_parts_that_disagree_are_refused(model: TinyTransformer) -> None:
    pool = PagePool(16, page_size=PAGE)
    store = KVStore(16, CFG.num_layers + 1, CFG.num_kv_heads, CFG.head_dim, PAGE)
    with pytest.raises(InvalidInput, match="KV store pages"):
        ServingEngine(model, KVCacheManager(pool, PAGE), store, PageHasher(PAGE))


# ------------------------------------------------------------------ cancellation


def count_prefill_chunks(
    monkeypatch: pytest.MonkeyPatch,
    model: TinyTransformer,
    before_chunk: Callable[[str, int], None] = lambda thread, n: None,
) -> Counter[str]:
    """Count the model's prefill chunks by the name of the thread computing them.

    `before_chunk(thread, n)` runs before that thread's `n`-th chunk (from 1) is computed.
    """
    chunks: Counter[str] = Counter()
    compute = model.prefill_into

    def counted(kv: torch.Tensor, num_past: int, token_ids: Sequence[int]) -> torch.Tensor:
        name = threading.current_thread().name
        chunks[name] += 1
        before_chunk(name, chunks[name])
        return compute(kv, num_past, token_ids)

    monkeypatch.setattr(model, "prefill_into", counted)
    return chunks


def run_in_thread(name: str, fn: Callable[[], GenerationResult]) -> Future[GenerationResult]:
    """Run `fn` in a thread called `name`; its outcome (result or error) lands in the future."""
    future: Future[GenerationResult] = Future()

    def body() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=body, name=name, daemon=True).start()
    return future


def test_a_request_cancelled_mid_prefill_stops_frees_its_pages_and_spares_a_concurrent_one(
    model: TinyTransformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(model, num_pages=128, chunk_tokens=PAGE, max_concurrent=2)
    long_prompt = prompt(12 * PAGE + 3, seed=40)  # 13 chunks of one page
    other = prompt(5 * PAGE + 2, seed=41)
    expected = engine.compute_from_scratch(other, 6)
    cancel, other_started = threading.Event(), threading.Event()

    def cancel_during_second_chunk(thread: str, n: int) -> None:
        if thread == "other":
            other_started.set()
        elif thread == "cancelled" and n == 2:
            assert other_started.wait(timeout=60)  # both requests are computing now
            cancel.set()

    chunks = count_prefill_chunks(monkeypatch, model, cancel_during_second_chunk)
    doomed = run_in_thread(
        "cancelled", lambda: engine.serve("c", long_prompt, 4, cancelled=cancel.is_set)
    )
    survivor = run_in_thread("other", lambda: engine.serve("o", other, 6))

    with pytest.raises(RequestCancelled, match="cancelled by its caller after 16 of 99") as err:
        doomed.result(timeout=120)
    assert not isinstance(err.value, RequestExpired)
    assert chunks["cancelled"] == 2  # the chunk being computed finished, no other started
    assert list(survivor.result(timeout=120).tokens) == expected
    assert_idle_and_consistent(engine)
    # the chunks it computed were never cached: nobody can hit a cancelled request's pages
    assert not any(engine.pool.get_cached_page(h) for h in engine.hasher.hash_prompt(long_prompt))
    assert engine.load().running == engine.load().waiting == 0


def test_a_request_cancelled_mid_decode_stops_at_the_next_step_and_keeps_its_prompt_pages(
    model: TinyTransformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(model)
    p = prompt(2 * PAGE + 3, seed=42)  # one prefill chunk
    steps = 0
    forward = model._forward

    def counted(tokens: torch.Tensor, window: torch.Tensor, n_past: int) -> torch.Tensor:
        nonlocal steps
        steps += 1
        return forward(tokens, window, n_past)

    monkeypatch.setattr(model, "_forward", counted)
    with pytest.raises(RequestCancelled, match="after 4 of 20 answer tokens"):
        engine.serve("c", p, 20, cancelled=lambda: steps >= 1 + 3)
    assert steps == 1 + 3  # the prefill and three decode steps of the 19 asked
    assert_idle_and_consistent(engine)
    monkeypatch.undo()
    again = engine.serve("again", p, 20)  # its prompt was whole: those pages were cached
    assert again.pages_hit_local == 2
    assert list(again.tokens) == engine.compute_from_scratch(p, 20)


@pytest.mark.parametrize("why", ["deadline", "cancelled"])
def test_a_request_stopped_while_waiting_for_a_slot_leaves_the_queue_and_never_starts(
    model: TinyTransformer, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    now = [0.0]
    engine = make_engine(model, max_concurrent=1, clock=lambda: now[0])
    entered, release, cancel = threading.Event(), threading.Event(), threading.Event()

    def slow_pull(req: PullRequest) -> PullOutcome:
        entered.set()
        release.wait(timeout=60)
        return nothing_pulled(req)

    chunks = count_prefill_chunks(monkeypatch, model)
    p = prompt(3 * PAGE + 1, seed=43)
    hint = RouteHint(promised_pull=2, peer="x")
    first = run_in_thread("first", lambda: engine.serve("a", p, 3, hint=hint, pull_fn=slow_pull))
    assert entered.wait(timeout=60)  # "a" holds the only slot
    queued = run_in_thread(
        "queued", lambda: engine.serve("b", p, 3, cancelled=cancel.is_set, deadline=10.0)
    )
    assert wait_for(lambda: engine.load().waiting == 1)
    if why == "deadline":
        now[0] = 10.0
        stopped: type[RequestCancelled] = RequestExpired
    else:
        cancel.set()
        stopped = RequestCancelled
    with pytest.raises(stopped, match="while waiting for a compute slot"):
        queued.result(timeout=60)
    assert engine.load().waiting == 0 and engine.load().running == 1
    release.set()
    assert list(first.result(timeout=60).tokens) == engine.compute_from_scratch(p, 3)
    assert chunks["queued"] == 0
    assert_idle_and_consistent(engine)


def test_waiting_requests_start_in_arrival_order_and_a_cancelled_one_keeps_the_others_order(
    model: TinyTransformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(model, max_concurrent=1)
    entered, release = threading.Event(), threading.Event()
    started: list[str] = []

    def slow_pull(req: PullRequest) -> PullOutcome:
        entered.set()
        release.wait(timeout=60)
        return nothing_pulled(req)

    def note_start(thread: str, n: int) -> None:
        if n == 1:
            started.append(thread)

    count_prefill_chunks(monkeypatch, model, note_start)
    p = prompt(2 * PAGE + 1, seed=44)
    hint = RouteHint(promised_pull=1, peer="x")
    holder = run_in_thread("holder", lambda: engine.serve("h", p, 2, hint=hint, pull_fn=slow_pull))
    assert entered.wait(timeout=60)
    flags = {name: threading.Event() for name in "bcde"}
    queued: dict[str, Future[GenerationResult]] = {}

    def enqueue(name: str) -> None:
        waiting = engine.load().waiting
        cancelled = flags[name].is_set
        queued[name] = run_in_thread(name, lambda: engine.serve(name, p, 2, cancelled=cancelled))
        assert wait_for(lambda: engine.load().waiting == waiting + 1)

    for name in "bcde":
        enqueue(name)
    flags["c"].set()
    with pytest.raises(RequestCancelled, match="while waiting for a compute slot"):
        queued["c"].result(timeout=60)
    release.set()
    answers = [holder.result(timeout=60)] + [queued[n].result(timeout=60) for n in "bde"]
    assert started == ["holder", "b", "d", "e"]
    assert {r.tokens for r in answers} == {tuple(engine.compute_from_scratch(p, 2))}
    assert_idle_and_consistent(engine)


def test_a_request_whose_deadline_passed_before_it_was_served_is_refused_untouched(
    model: TinyTransformer,
) -> None:
    engine = make_engine(model, clock=lambda: 5.0)
    with pytest.raises(RequestExpired, match="before it started"):
        engine.serve("late", prompt(2 * PAGE), 3, deadline=5.0)
    assert_idle_and_consistent(engine)
    assert engine.take_events() == []


def wait_for(cond: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes (a bound on state, not a timing)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
