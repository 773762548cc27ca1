"""One worker serving one request: cached prefix, pulled pages, computed rest, greedy answer.

Pure of Ray and gRPC: the actor owns a `ServingEngine` and injects the pull
(a callable that brings a peer's pages into the pool through the worker's
`PageService`, where each is checked and proven once) so that tests run the
same code in one process. The engine never inserts a page itself: it takes
from the pool what the pull cached. The steps of `ServingEngine.serve`::

    tokens ─► page hashes (the client's, checked cheaply; or chained here)
           ─► local match  ── pages the pool already holds      (pages_hit_local)
           ─► pull_fn      ── pages the route's peer holds      (pages_pulled)
           ─► compute      ── the rest, chunk by chunk over the cached KV,
                              written into the request's pages  (pages_computed)
           ─► cache the full pages, first token                 (TTFT)
           ─► greedy decode in a private buffer, free pages tail first

Locking: the pool and the cache manager are not thread-safe, so every call on
them happens under `lock` (shared with the worker's gRPC servicer, which pins
pages it streams out). The model runs outside the lock: a request reads only
pages it holds (a held page is never reused) and writes only pages it
allocated, which nobody can hit before they are cached, and they are cached
only after their KV is written.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from kvmesh.errors import (
    InvalidInput,
    KVMeshError,
    PoolExhausted,
    RequestCancelled,
    RequestExpired,
)
from kvmesh.events import KVEvent
from kvmesh.hashing import NO_EXTRA, ExtraKeys, PageHasher, RequestHashes, reusable_pages
from kvmesh.metrics import REQUEST_HASH_MISMATCHES
from kvmesh.requests import GenerationResult, RequestTimings
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.cache_manager import KVCacheManager, Request
from kvmesh.worker.free_queue import KVPage
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.page_service import ProofBook, PullOutcome

log = logging.getLogger(__name__)

DEFAULT_WORKER_ID = WorkerId("worker")


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the route decision promised this worker.

    `promised_local`: pages of the prompt the coordinator believes this worker
    holds. `peer` (an address `pull_fn` understands) holds the prefix up to
    ``promised_local + promised_pull`` pages, so that many more could be pulled.
    """

    promised_local: int = 0
    promised_pull: int = 0
    peer: str | None = None


NO_HINT = RouteHint()


@dataclass(frozen=True, slots=True)
class PullRequest:
    """Pages to fetch from a peer: consecutive pages of one prompt, in order.

    `token_ids` are those pages' tokens (``page_size`` each), `parent_hash`
    the hash before the first, `first_page` its index in the prompt and
    `extra_keys` the request's (salt, LoRA, media): all the receiver needs to
    prove each page it gets (`proofs`).
    """

    peer: str
    page_hashes: tuple[PageHash, ...]
    parent_hash: PageHash | None
    token_ids: tuple[int, ...]
    first_page: int = 0
    extra_keys: ExtraKeys = NO_EXTRA

    def proofs(self, page_size: int) -> ProofBook:
        """The receiver's own proof of every page asked for (from the request it serves)."""
        return ProofBook.for_pages(
            self.page_hashes,
            self.token_ids,
            self.extra_keys,
            page_size,
            first_page=self.first_page,
            parent=self.parent_hash,
        )


PullFn = Callable[[PullRequest], PullOutcome]
"""Fetches pages from a peer into this worker's pool through its `PageService` (each page
checked and proven once, on the way in) and says how it went. A failure part-way is the
outcome's `error`; raising a `KVMeshError` (e.g. `TransportError`) means nothing came."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a router weighs: requests running and waiting, tokens still to compute, pages.

    `prefill_tokens` / `decode_tokens`: prompt tokens not yet computed and answer
    tokens not yet produced, over running and waiting requests.
    """

    running: int
    waiting: int
    prefill_tokens: int
    decode_tokens: int
    free_pages: int
    num_pages: int
    usage: float


@dataclass(slots=True)
class _Progress:
    """Mutable bookkeeping of one `serve` call (what the result reports)."""

    pull_ms: float = 0.0
    pull_error: str | None = None
    pulled: frozenset[PageHash] = frozenset()  # hashes the pull asked for


CANCEL_POLL_S = 0.05
"""How often a request waiting for a compute slot looks at its cancellation and deadline."""


@dataclass(slots=True)
class _Stop:
    """When one request must stop: its caller's `cancelled` flag or its `deadline` on `clock`.

    The first reason seen is kept (`reason`), so that the error raised names it even
    when the flag it came from is asked again later. Each check costs one clock
    read and one call of `cancelled`.
    """

    request_id: str
    cancelled: Callable[[], bool] | None
    deadline: float | None
    clock: Callable[[], float]
    reason: str | None = None  # "deadline" or "cancelled" once stopped

    @property
    def can_stop(self) -> bool:
        return self.cancelled is not None or self.deadline is not None

    @property
    def stop_fn(self) -> Callable[[], bool] | None:
        """What `TinyTransformer.decode` asks before each step (None: nothing to ask)."""
        return self.stopped if self.can_stop else None

    def stopped(self) -> bool:
        if self.reason is None:
            if self.deadline is not None and self.clock() >= self.deadline:
                self.reason = "deadline"
            elif self.cancelled is not None and self.cancelled():
                self.reason = "cancelled"
        return self.reason is not None

    def check(self, where: str) -> None:
        """Raise `RequestCancelled` / `RequestExpired` (saying `where`) when stopped."""
        if self.stopped():
            raise self.error(where)

    def error(self, where: str) -> RequestCancelled:
        if self.reason == "deadline":
            return RequestExpired(
                f"request {self.request_id!r} passed its deadline {where} and was stopped; "
                "give it a longer request_timeout_s or send fewer requests at once"
            )
        return RequestCancelled(
            f"request {self.request_id!r} was cancelled by its caller {where}; its work "
            "stopped and its pages were released"
        )


class ServingEngine:
    """The request-serving logic of one worker over its pool, KV store and model.

    `serve` is safe to call from several threads; at most `max_concurrent`
    requests compute at once (the others wait, in arrival order, which is their
    queue time).
    """

    def __init__(
        self,
        model: TinyTransformer,
        cache_manager: KVCacheManager,
        kv_store: KVStore,
        hasher: PageHasher,
        *,
        worker_id: WorkerId = DEFAULT_WORKER_ID,
        max_concurrent: int = 1,
        chunk_tokens: int | None = None,
        lock: AbstractContextManager[object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        page_size = hasher.page_size
        problems = []
        if cache_manager.page_size != page_size:
            problems.append(f"cache manager page_size {cache_manager.page_size} != {page_size}")
        want = (model.num_layers, 2, page_size, model.num_kv_heads, model.head_dim)
        if tuple(kv_store.page_shape) != want or kv_store.dtype != model.dtype:
            problems.append(
                f"KV store pages are {kv_store.dtype} {list(kv_store.page_shape)}, the model "
                f"needs {model.dtype} {list(want)}"
            )
        if kv_store.num_pages != cache_manager.pool.num_pages:
            problems.append(
                f"KV store has {kv_store.num_pages} pages, the pool {cache_manager.pool.num_pages}"
            )
        if max_concurrent < 1:
            problems.append(f"max_concurrent must be >= 1, got {max_concurrent}")
        if problems:
            raise InvalidInput("ServingEngine parts disagree: " + "; ".join(problems))
        chunk = model.cfg.prefill_chunk_tokens if chunk_tokens is None else chunk_tokens
        self.model = model
        self.cache_manager = cache_manager
        self.pool = cache_manager.pool
        self.kv_store = kv_store
        self.hasher = hasher
        self.page_size = page_size
        self.worker_id = worker_id
        self.chunk_pages = max(1, chunk // page_size)
        self.lock: AbstractContextManager[object] = lock if lock is not None else threading.RLock()
        self.clock = clock
        self._admission = threading.Condition()
        self._queue: deque[str] = deque()  # request ids waiting for a slot, in arrival order
        self._free_slots = max_concurrent
        self._state = threading.Lock()
        self._active: dict[str, list[int]] = {}  # request id -> [prefill, decode] tokens to go
        self._waiting = 0
        self._warned_hashes = False

    # ------------------------------------------------------------------ serving

    def serve(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        extra_keys: ExtraKeys = NO_EXTRA,
        hint: RouteHint = NO_HINT,
        pull_fn: PullFn | None = None,
        arrival_time: float | None = None,
        cancelled: Callable[[], bool] | None = None,
        deadline: float | None = None,
        page_hashes: Sequence[PageHash] = (),
    ) -> GenerationResult:
        """Answer one request with `max_tokens` greedy tokens; see the module docstring.

        `page_hashes`: the prompt's hashes as the router computed them; taken
        after a two-page check (`RequestHashes.given`), else (none given, or
        they disagree: counted in ``kvmesh_request_hash_mismatches``) the
        prompt is hashed here.

        `arrival_time` (on `clock`) starts the queue time; default: now. Raises
        `InvalidInput` for bad tokens, lengths or a request id already running, and
        `PoolExhausted` when the pool cannot hold the prompt's pages; in every
        failure the request's pages are released and nothing else changes. A
        failed pull is not an error: its pages are computed instead (`pull_error`).

        Cancellation: `cancelled` (the caller gave up) and `deadline` (on `clock`)
        are checked while the request waits for a slot (every `CANCEL_POLL_S`),
        before each prefill chunk and before each decode step; a request stopped
        there raises `RequestCancelled` (`RequestExpired` for the deadline) and
        releases its pages. Pages of prompt chunks it computed are not cached.
        """
        stop = _Stop(request_id, cancelled, deadline, self.clock)
        arrived = self.clock() if arrival_time is None else arrival_time
        tokens = self._check_request(token_ids, max_tokens)
        num_pages = -(-len(tokens) // self.page_size)
        if num_pages > self.pool.num_pages - 1:
            raise PoolExhausted(
                f"a {len(tokens)}-token prompt needs {num_pages} pages of {self.page_size} tokens "
                f"but the pool has only {self.pool.num_pages - 1}; shorten the prompt or grow "
                "the pool (num_pages)"
            )
        request = Request(request_id, self._hashes(tokens, extra_keys, page_hashes))
        with self._admitted(request_id, len(tokens), max_tokens, stop):
            stop.check("before it started")
            started = self.clock()
            progress = _Progress()
            try:
                matched, new_pages = self._take_pages(request, hint, pull_fn, progress)
                t0 = self.clock()
                kv, logits = self._prefill(request, matched, new_pages, max_tokens, stop)
                with self.lock:
                    self.cache_manager.cache_pages(request, len(tokens))
                answer: list[int] = []
                if max_tokens:
                    answer.append(int(torch.argmax(logits)))
                first = self.clock()
                if max_tokens > 1:
                    rest, _ = self.model.decode(
                        answer[0], kv, len(tokens), max_tokens - 1, stop.stop_fn
                    )
                    answer.extend(rest)
                    if len(answer) < max_tokens:
                        raise stop.error(f"after {len(answer)} of {max_tokens} answer tokens")
            finally:
                with self.lock:
                    self.cache_manager.free(request)
            done = self.clock()
        n_pulled = sum(1 for p in matched if p.page_hash in progress.pulled)
        return GenerationResult(
            request_id=request_id,
            worker_id=self.worker_id,
            tokens=tuple(answer),
            timings=RequestTimings(
                queue_ms=(started - arrived) * 1e3,
                pull_ms=progress.pull_ms,
                prefill_ms=(first - t0) * 1e3,
                ttft_ms=(first - arrived) * 1e3,
                total_ms=(done - arrived) * 1e3,
            ),
            prompt_tokens=len(tokens),
            cached_tokens=len(matched) * self.page_size,
            pages_hit_local=len(matched) - n_pulled,
            pages_pulled=n_pulled,
            pages_computed=num_pages - len(matched),
            promised_local=hint.promised_local,
            promised_pull=hint.promised_pull,
            pull_error=progress.pull_error,
        )

    def compute_from_scratch(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The reference answer: the whole prompt in one pass, no cache, no pool."""
        return self.model.generate(self._check_request(token_ids, max_tokens), max_tokens)

    # -------------------------------------------------------------- inspection

    def load(self) -> EngineLoad:
        """The engine's load now (cheap; for heartbeats and routing)."""
        with self._state:
            running, waiting = len(self._active) - self._waiting, self._waiting
            prefill = sum(todo[0] for todo in self._active.values())
            decode = sum(todo[1] for todo in self._active.values())
        with self.lock:
            free = self.pool.get_num_free_pages()
            usage = self.pool.usage
        return EngineLoad(running, waiting, prefill, decode, free, self.pool.num_pages, usage)

    def take_events(self) -> list[KVEvent]:
        """The pool's KV events since the last call (drained atomically)."""
        with self.lock:
            return self.cache_manager.take_events()

    # ----------------------------------------------------------------- steps

    def _hashes(
        self, tokens: list[int], keys: ExtraKeys, given: Sequence[PageHash]
    ) -> RequestHashes:
        if given:
            checked = RequestHashes.given(self.hasher, tokens, keys, given)
            if checked is not None:
                return checked
            REQUEST_HASH_MISMATCHES.labels(self.worker_id).inc()
            if not self._warned_hashes:  # once: a misconfigured router sends many
                self._warned_hashes = True
                log.warning(
                    "the router's page hashes of a %d-token prompt disagree with this "
                    "worker's (hash seed %r, %s): hashing prompts here; check the "
                    "cluster's hash settings (kvmesh_request_hash_mismatches counts them)",
                    len(tokens),
                    self.hasher.seed,
                    self.hasher.algo,
                )
        return RequestHashes(self.hasher, tokens, keys)

    def _check_request(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidInput(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        try:
            tokens = [operator.index(t) for t in token_ids]
        except TypeError as exc:
            raise InvalidInput(f"token ids must be integers: {exc}") from exc
        if not tokens:
            raise InvalidInput("the prompt is empty: give at least one token")
        vocab = self.model.cfg.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise InvalidInput(
                f"token ids must lie in [0, {vocab}), got range [{min(tokens)}, {max(tokens)}]"
            )
        limit = self.model.cfg.max_positions
        if len(tokens) + max(max_tokens - 1, 0) > limit:
            raise InvalidInput(
                f"prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's max_positions={limit}"
            )
        return tokens

    @contextmanager
    def _admitted(
        self, request_id: str, num_tokens: int, max_tokens: int, stop: _Stop
    ) -> Iterator[None]:
        """Register the request, wait for a compute slot (`_wait_for_slot`), run, unregister."""
        with self._state:
            if request_id in self._active:
                raise InvalidInput(f"request id {request_id!r} is already being served")
            self._active[request_id] = [num_tokens, max_tokens]
            self._waiting += 1
        admitted = False
        try:
            self._wait_for_slot(request_id, stop)
            try:
                with self._state:
                    self._waiting -= 1
                    admitted = True
                yield
            finally:
                with self._admission:
                    self._free_slots += 1
                    self._admission.notify_all()
        finally:
            with self._state:
                if not admitted:
                    self._waiting -= 1
                self._active.pop(request_id, None)

    def _wait_for_slot(self, request_id: str, stop: _Stop) -> None:
        """Take a compute slot, in arrival order (a first-come queue, not a semaphore's race).

        A request that can be stopped looks at `stop` every `CANCEL_POLL_S` and,
        once stopped, leaves the queue (`RequestCancelled`) keeping the others' order.
        """
        timeout = CANCEL_POLL_S if stop.can_stop else None
        with self._admission:
            self._queue.append(request_id)
            try:
                while self._queue[0] != request_id or self._free_slots == 0:
                    self._admission.wait(timeout)
                    stop.check("while waiting for a compute slot")
            except BaseException:
                self._queue.remove(request_id)
                self._admission.notify_all()  # the next in line may start now
                raise
            self._queue.popleft()
            self._free_slots -= 1
            self._admission.notify_all()  # so may the one after it, if a slot is left

    def _take_pages(
        self, request: Request, hint: RouteHint, pull_fn: PullFn | None, progress: _Progress
    ) -> tuple[list[KVPage], list[KVPage]]:
        """Hold the request's pages: the cached prefix (after an optional pull) and new ones."""
        if pull_fn is not None and hint.peer is not None and self.cache_manager.enable_caching:
            t0 = self.clock()
            self._pull(request, hint, pull_fn, progress)
            progress.pull_ms = (self.clock() - t0) * 1e3
        cm, pool = self.cache_manager, self.pool
        if cm.tiers is not None:  # read its disk pages now, not while holding the lock
            cm.tiers.prefetch(request.page_hashes, (request.num_tokens - 1) // self.page_size)
        with self.lock:
            matched, _ = cm.get_computed_pages(request)
            new_pages = cm.allocate_slots(
                request,
                request.num_tokens - len(matched) * self.page_size,
                len(matched) * self.page_size,
                matched,
                delay_caching=True,
            )
            if new_pages is None:
                need = -(-request.num_tokens // self.page_size)
                raise PoolExhausted(
                    f"request {request.request_id!r} needs {need} pages ({len(matched)} cached)"
                    f" but only {pool.get_num_free_pages()} of "
                    f"{pool.num_pages - 1} are free: too many requests at once for this pool; "
                    "retry later or grow the pool (num_pages)"
                )
        return matched, new_pages

    def _pull(
        self, request: Request, hint: RouteHint, pull_fn: PullFn, progress: _Progress
    ) -> None:
        """Have `pull_fn` bring the pages past the local prefix from the hinted peer into the
        pool; notes which hashes it asked for and why it failed, if it did."""
        hashes = request.page_hashes
        limit = min(reusable_pages(request.num_tokens, self.page_size), len(hashes))
        end = min(hint.promised_local + hint.promised_pull, limit)
        with self.lock:
            start = len(self.pool.match_prefix(hashes, limit))
        if start >= end or hint.peer is None:
            return
        ps = self.page_size
        ask = PullRequest(
            peer=hint.peer,
            page_hashes=tuple(hashes[start:end]),
            parent_hash=hashes[start - 1] if start else None,
            token_ids=tuple(request.token_ids[start * ps : end * ps]),
            first_page=start,
            extra_keys=request.hashes.keys,
        )
        # Pulling is an optimisation: the whole pages that arrived are used, the rest are
        # computed, and a failure is reported with the result.
        progress.pulled = frozenset(ask.page_hashes)
        try:
            outcome = pull_fn(ask)
        except (KVMeshError, OSError) as exc:
            progress.pull_error = f"{type(exc).__name__}: {exc}"
            log.warning("pull from %s failed, computing instead: %s", hint.peer, exc)
            return
        if outcome.error is not None:
            progress.pull_error = outcome.error
            log.warning("pull from %s failed part-way: %s", hint.peer, outcome.error)

    def _prefill(
        self,
        request: Request,
        matched: list[KVPage],
        new_pages: list[KVPage],
        max_tokens: int,
        stop: _Stop,
    ) -> tuple[Tensor, Tensor]:
        """Compute the uncached tokens chunk by chunk; returns the KV buffer and last logits.

        The buffer holds the whole prompt's KV (cached pages copied in) and room
        to decode; each computed chunk's pages are written to the KV store. `stop`
        is checked before every chunk.
        """
        model, store, ps = self.model, self.kv_store, self.page_size
        tokens = request.token_ids
        n = len(tokens)
        pages = [*matched, *new_pages]
        capacity = max(n + max(max_tokens - 1, 0), len(pages) * ps)
        kv = model.empty_kv(capacity)
        start = len(matched) * ps
        if matched:
            cached = store.read_pages([p.page_id for p in matched])
            kv[:, :, :start] = _pages_to_tokens(cached)
        logits = torch.empty(0)
        step = self.chunk_pages * ps
        for lo in range(start, n, step):
            stop.check(f"after {lo - start} of {n - start} prompt tokens to compute")
            hi = min(lo + step, n)
            logits = model.prefill_into(kv, lo, tokens[lo:hi])
            first_page, end_page = lo // ps, -(-hi // ps)
            store.write_pages(
                [p.page_id for p in pages[first_page:end_page]],
                _tokens_to_pages(kv[:, :, first_page * ps : end_page * ps], ps),
            )
            with self._state:
                todo = self._active.get(request.request_id)
                if todo is not None:
                    todo[0] = n - hi
        return kv, logits


def _pages_to_tokens(pages: Tensor) -> Tensor:
    """``[n, L, 2, P, H, D]`` (store layout) -> ``[L, 2, n * P, H, D]`` (model layout)."""
    n, layers, two, ps, heads, dim = pages.shape
    return pages.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * ps, heads, dim)


def _tokens_to_pages(kv: Tensor, page_size: int) -> Tensor:
    """``[L, 2, n * P, H, D]`` (model layout) -> contiguous ``[n, L, 2, P, H, D]``."""
    layers, two, total, heads, dim = kv.shape
    n = total // page_size
    return kv.reshape(layers, two, n, page_size, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()
