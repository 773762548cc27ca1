"""A real vLLM engine's KV events in kvmesh's index: exact blocks, parity canary, replay, restart.

One engine (vLLM 0.32 CPU, block size 32, default `sha256`, int hashes in
events) for the whole module; the subscriber runs on its own thread, so the
tests read the index under its lock. The restart test runs last: it restarts
the shared engine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.engine_canary import CanaryResult, run_hash_parity_canary
from kvmesh.engine_hash import EngineExtraKeys, EngineHasher
from kvmesh.engine_launcher import EngineSpec, VLLMEngine
from kvmesh.engine_subscriber import (
    EngineEventsEndpoint,
    EngineSubscriber,
    EngineSubscriberThread,
)
from kvmesh.errors import HashParityError
from kvmesh.types import PageHash, WorkerId

StartEngine = Callable[..., VLLMEngine]
BOUND_S = 60.0
BLOCK = 32
REPLAY_STEPS = 3
HASHER = EngineHasher("sha256", BLOCK)


@dataclass
class Followed:
    engine: VLLMEngine
    index: GlobalIndex
    runner: EngineSubscriberThread
    drop: set[int] = field(default_factory=set)
    baseline: frozenset[PageHash] = frozenset()  # blocks indexed before the tests (the canary's)
    rng: random.Random = field(default_factory=lambda: random.Random(1234))

    @property
    def subscriber(self) -> EngineSubscriber:
        return self.runner.subscriber

    @property
    def wid(self) -> WorkerId:
        return WorkerId(self.engine.name)

    def pages(self) -> frozenset[PageHash]:
        with self.subscriber.lock:
            if self.wid not in self.index.workers():
                return frozenset()
            return self.index.worker_pages(self.wid)

    def stale(self) -> bool:
        with self.subscriber.lock:
            return self.index.is_stale(self.wid)

    def prompt(self, blocks: int) -> list[int]:
        """Fresh random token ids: `blocks` full blocks and one token more."""
        return [self.rng.randrange(10, 1700) for _ in range(blocks * BLOCK + 1)]

    def canary(self, hasher: EngineHasher) -> CanaryResult:
        """The hash-parity canary on the subscriber's own loop."""
        return self.runner.call(
            run_hash_parity_canary(
                self.subscriber, self.engine.name, self.engine.url, hasher, timeout_s=BOUND_S
            )
        )

    def complete(self, tokens: list[int], **body: object) -> None:
        complete(self.engine, tokens, body=body)


def complete(
    engine: VLLMEngine,
    tokens: list[int],
    client: httpx.Client | None = None,
    body: dict[str, object] | None = None,
) -> None:
    """One completion of `tokens`, one token long; `client`: one kept across thousands of
    requests (each `httpx.post` builds its own TLS context, which a slow machine pays
    milliseconds for)."""
    post = httpx.post if client is None else client.post
    response = post(
        f"{engine.url}/v1/completions",
        json={"model": engine.spec.served_model_name, "prompt": tokens, "max_tokens": 1}
        | (body or {}),
        timeout=BOUND_S,
    )
    assert response.status_code == 200, response.text


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name + "_total", labels) or 0.0


@pytest.fixture(scope="module")
def followed(start_engine: StartEngine) -> Iterator[Followed]:
    # a short replay buffer, so that a test can lose more batches than replay still has
    engine = start_engine(EngineSpec(replay_buffer_steps=REPLAY_STEPS), name="engine-idx")
    index = GlobalIndex()
    drop: set[int] = set()
    subscriber = EngineSubscriber(
        index,
        [EngineEventsEndpoint.of_engine(engine)],
        drop_frame=lambda wid, seq: seq in drop,
    )
    runner = EngineSubscriberThread(subscriber)
    runner.start()
    try:
        followed = Followed(engine, index, runner, drop)
        # The engine's publisher connects to the subscriber after it binds, and drops what
        # it sends before (ZMQ): the canary proves events flow (and any gap it revealed is
        # healed) before a test counts blocks; its blocks are the module's baseline.
        blocks = set(followed.canary(HASHER).page_hashes)
        wait_until(
            lambda: blocks <= followed.pages() and not followed.stale(), "the canary's blocks"
        )
        followed.baseline = followed.pages()
        yield followed
    finally:
        runner.stop()


def test_the_index_holds_exactly_the_blocks_the_engine_stored(followed: Followed) -> None:
    prompts = [followed.prompt(n) for n in (1, 2, 3)]
    shared = prompts[2][: 2 * BLOCK] + followed.prompt(1)  # reuses two blocks of the third
    want: set[PageHash] = set()
    for tokens in (*prompts, shared):
        followed.complete(tokens)
        want |= set(HASHER.hash_prompt(tokens))
    wait_until(lambda: want <= followed.pages(), "the engine's events for every prompt")
    time.sleep(0.5)  # anything else the engine publishes would arrive by now
    assert followed.pages() == want | followed.baseline
    assert len(want) == 1 + 2 + 3 + 1
    assert not followed.stale()


def test_the_hash_parity_canary_passes_for_the_engines_own_configuration(
    followed: Followed,
) -> None:
    result = followed.canary(HASHER)
    assert len(result.page_hashes) == 2
    assert set(result.page_hashes) <= followed.pages()
    assert followed.subscriber.quarantined(followed.engine.name) is None


def test_a_canary_with_another_seed_fails_loudly_and_the_engine_loses_affinity(
    followed: Followed,
) -> None:
    wrong = EngineHasher("sha256", BLOCK, seed="12345")
    with pytest.raises(HashParityError, match="seed='vllm-none-hash'") as err:
        followed.canary(wrong)
    assert "PYTHONHASHSEED unset" in str(err.value)
    assert followed.stale() and followed.pages() == frozenset()
    assert followed.subscriber.quarantined(followed.engine.name) is not None
    # the right configuration proves parity again and gives the engine back its affinity
    followed.canary(HASHER)
    assert not followed.stale()
    assert followed.subscriber.quarantined(followed.engine.name) is None


def test_a_cache_salt_in_the_request_hashes_as_kvmesh_predicts(followed: Followed) -> None:
    tokens = followed.prompt(2)
    followed.complete(tokens, cache_salt="tenant-a")
    salted = set(HASHER.hash_prompt(tokens, EngineExtraKeys(cache_salt="tenant-a")))
    wait_until(lambda: salted <= followed.pages(), "the salted blocks")
    assert not salted & set(HASHER.hash_prompt(tokens))


def test_a_dropped_event_batch_is_healed_from_the_engines_replay_socket(
    followed: Followed,
) -> None:
    healed = counter("kvmesh_engine_event_gaps", engine=followed.engine.name, outcome="healed")
    state = followed.subscriber.stream_state(followed.wid)
    followed.drop.add(state.last_seq + 1)  # the next batch is lost on the wire
    first, second = followed.prompt(2), followed.prompt(1)
    followed.complete(first)
    followed.complete(second)
    want = set(HASHER.hash_prompt(first)) | set(HASHER.hash_prompt(second))
    wait_until(lambda: want <= followed.pages() and not followed.stale(), "replay")
    after = counter("kvmesh_engine_event_gaps", engine=followed.engine.name, outcome="healed")
    assert after == healed + 1


def test_losing_more_batches_than_replay_holds_drops_the_entries_then_follows_afresh(
    followed: Followed,
) -> None:
    uncovered = counter(
        "kvmesh_engine_event_gaps", engine=followed.engine.name, outcome="uncovered"
    )
    lost_from = followed.subscriber.stream_state(followed.wid).last_seq + 1
    followed.drop.update(range(lost_from, lost_from + REPLAY_STEPS + 1))
    kept_before = followed.pages()
    assert kept_before
    for _ in range(4 * REPLAY_STEPS):  # each request publishes a batch; the first few are lost
        if followed.subscriber.stream_state(followed.wid).last_seq > lost_from:
            break
        followed.complete(followed.prompt(1))
        time.sleep(0.2)
    else:
        raise AssertionError("no batch after the lost ones arrived")
    wait_until(lambda: counter("kvmesh_engine_event_gaps", engine=followed.engine.name,
                               outcome="uncovered") == uncovered + 1, "an uncovered gap")  # fmt: skip
    wait_until(lambda: not followed.stale(), "following afresh")
    assert not kept_before & followed.pages()  # a lost batch could have evicted them
    tokens = followed.prompt(2)
    followed.complete(tokens)
    want = set(HASHER.hash_prompt(tokens))
    wait_until(lambda: want <= followed.pages(), "new blocks indexed again")
    assert not followed.stale()


def test_a_restarted_engine_is_a_new_incarnation_with_only_its_new_blocks(
    followed: Followed,
) -> None:
    before = followed.subscriber.stream_state(followed.wid)
    old = followed.pages()
    assert old
    followed.engine.restart()
    tokens = followed.prompt(2)
    followed.complete(tokens)
    want = set(HASHER.hash_prompt(tokens))
    wait_until(lambda: followed.subscriber.stream_state(followed.wid).incarnation
               != before.incarnation, "a new incarnation")  # fmt: skip
    wait_until(lambda: want <= followed.pages() and not followed.stale(), "the new life's blocks")
    assert followed.pages() == want
    assert counter("kvmesh_engine_restarts", engine=followed.engine.name) >= 1


LATE_HISTORY = 2500  # batches the engine publishes before anyone follows it


@pytest.mark.timeout(900)  # 2,700 real completions: minutes on a slow shared machine
def test_a_subscriber_that_joins_after_thousands_of_batches_holds_every_block_again(
    start_engine: StartEngine,
) -> None:
    """A gateway starting beside busy engines: the engine's replay answer for seq 0 passes
    ZMQ's high-water marks and requests keep coming while it is replayed; the index still
    ends up holding every block the engine holds (the cache is large enough that nothing
    is evicted), fresh and with nothing held back."""
    engine = start_engine(EngineSpec(kv_cache_memory_bytes=1024 * 1024 * 1024), name="engine-late")
    rng = random.Random(77)

    def prompt() -> list[int]:
        return [rng.randrange(10, 1700) for _ in range(BLOCK + 1)]

    with httpx.Client() as client:  # one TLS context for all the completions
        want: set[PageHash] = set()
        for _ in range(LATE_HISTORY):  # nobody binds the events endpoint yet: PUB drops them
            tokens = prompt()
            complete(engine, tokens, client)
            want |= set(HASHER.hash_prompt(tokens))
        index = GlobalIndex()
        runner = EngineSubscriberThread(
            EngineSubscriber(index, [EngineEventsEndpoint.of_engine(engine)])
        )
        runner.start()
        followed = Followed(engine, index, runner)
        try:
            for _ in range(200):  # live traffic while the subscriber replays the history
                tokens = prompt()
                complete(engine, tokens, client)
                want |= set(HASHER.hash_prompt(tokens))
            assert followed.subscriber.stream_state(followed.wid).last_seq >= LATE_HISTORY
            wait_until(lambda: followed.pages() == want and not followed.stale(), "every block")
            with followed.subscriber.lock:
                assert index.worker_state(followed.wid).pending_batches == 0
        finally:
            runner.stop()
