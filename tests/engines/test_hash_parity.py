"""Hash parity with vLLM: kvmesh's EngineHasher against vLLM's own hashing code and live engines.

The first test runs vLLM's request block hasher (in .venv-engine, no engine
started) on random prompts with every algorithm, seeds, LoRA, multimodal
inputs and cache salts, and compares digest by digest. The others start two
engines at once: one on `sha256_cbor` publishing 32-byte digests, one on
`sha256` with a PYTHONHASHSEED publishing ints, and run the canary on each,
with the right configuration (it passes) and a wrong one (it fails loudly).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.engine_canary import CanaryResult, run_hash_parity_canary
from kvmesh.engine_hash import (
    ENGINE_HASH_ALGORITHMS,
    EngineExtraKeys,
    EngineHasher,
    MultimodalInput,
)
from kvmesh.engine_launcher import (
    EngineSpec,
    VLLMEngine,
    bound_cores,
    engine_python,
    engine_setup_missing,
    process_tree,
)
from kvmesh.engine_subscriber import (
    EngineEventsEndpoint,
    EngineSubscriber,
    EngineSubscriberThread,
)
from kvmesh.errors import HashParityError
from kvmesh.types import WorkerId

StartEngine = Callable[..., VLLMEngine]
BOUND_S = 60.0
SEED = "4242"
VLLM_HASHER = Path(__file__).with_name("vllm_block_hashes.py")


def random_cases(rng: random.Random, n: int) -> list[dict[str, Any]]:
    cases = []
    for i in range(n):
        algo = sorted(ENGINE_HASH_ALGORITHMS)[i % len(ENGINE_HASH_ALGORITHMS)]
        needs_seed = ENGINE_HASH_ALGORITHMS[algo].needs_seed
        size = rng.choice([1, 4, 16, 32])
        tokens = [rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 5 * size + 3))]
        case: dict[str, Any] = {
            "algo": algo,
            "seed": rng.choice([None, "0", "12345", "séed"]) if not needs_seed else "99",
            "block_size": size,
            "tokens": tokens,
        }
        if rng.random() < 0.4:
            case["salt"] = rng.choice(["tenant-a", "ü", "x" * 40])
        if rng.random() < 0.4:
            case["lora"] = [rng.choice(["sql", "chat"]), rng.choice(["/a/sql", "/b"])]
        if tokens and rng.random() < 0.5:
            offset, mm = 0, []
            while offset < len(tokens) and len(mm) < 3:
                offset += rng.randrange(0, 2 * size + 1)
                length = rng.randrange(1, 2 * size + 2)
                mm.append([f"img-{len(mm)}-{rng.randrange(99)}", offset, length])
                offset += length
            case["mm"] = mm
        cases.append(case)
    return cases


def kvmesh_digests(case: dict[str, Any]) -> list[str]:
    lora = case.get("lora")
    extra = EngineExtraKeys(
        lora_name=None if lora is None else lora[0],
        lora_path=None if lora is None else lora[1],
        cache_salt=case.get("salt"),
        multimodal=tuple(MultimodalInput(*m) for m in case.get("mm", [])),
    )
    hasher = EngineHasher(case["algo"], case["block_size"], case["seed"], int_hashes=False)
    return [d.hex() for d in hasher.hash_blocks(case["tokens"], extra).digests]


def test_kvmesh_hashes_every_block_as_vllms_own_code_does() -> None:
    missing = engine_setup_missing()
    if missing is not None:
        pytest.skip(missing)
    cases = random_cases(random.Random(20261124), 120)
    out = subprocess.run(
        [str(engine_python()), str(VLLM_HASHER)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    vllm = json.loads(out.stdout)
    assert len(vllm) == len(cases)
    for case, theirs in zip(cases, vllm, strict=True):
        assert kvmesh_digests(case) == theirs, case
    assert sum(len(d) for d in vllm) > 200  # the cases hash real blocks, not only empty prompts


class TwoEngines:
    def __init__(self, cbor: VLLMEngine, seeded: VLLMEngine) -> None:
        self.cbor, self.seeded = cbor, seeded
        self.index = GlobalIndex()
        self.runner = EngineSubscriberThread(
            EngineSubscriber(
                self.index,
                [EngineEventsEndpoint.of_engine(cbor), EngineEventsEndpoint.of_engine(seeded)],
            )
        )

    def canary(self, engine: VLLMEngine, hasher: EngineHasher) -> CanaryResult:
        return self.runner.call(
            run_hash_parity_canary(
                self.runner.subscriber, engine.name, engine.url, hasher, timeout_s=BOUND_S
            )
        )

    def stale(self, engine: VLLMEngine) -> bool:
        with self.runner.subscriber.lock:
            return self.index.is_stale(WorkerId(engine.name))

    def pages(self, engine: VLLMEngine) -> frozenset[bytes]:
        with self.runner.subscriber.lock:
            if engine.name not in self.index.workers():
                return frozenset()
            return self.index.worker_pages(WorkerId(engine.name))


@pytest.fixture(scope="module")
def engines(start_engine: StartEngine) -> Iterator[TwoEngines]:
    cbor = start_engine(EngineSpec(hash_algo="sha256_cbor", int_hashes=False), name="engine-cbor")
    seeded = start_engine(EngineSpec(seed=SEED), name="engine-seeded")
    pair = TwoEngines(cbor, seeded)
    pair.runner.start()
    try:
        yield pair
    finally:
        pair.runner.stop()


CBOR = EngineHasher("sha256_cbor", 32, None, int_hashes=False)
SEEDED = EngineHasher("sha256", 32, SEED)


def eventually(check: Callable[[], bool], what: str, bound_s: float = 30.0) -> None:
    """The canary sees a batch as it arrives; after a gap (a first batch the just-connected
    publisher dropped) the index takes it once replay has healed: poll, bounded."""
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_each_engine_runs_whole_on_its_own_core(engines: TwoEngines) -> None:
    """Its API server, engine core and model runner, not only the model's threads."""
    for engine in (engines.cbor, engines.seeded):
        assert engine.process is not None
        cores = bound_cores(engine.spec.cpu_bind)
        assert cores is not None  # the fixture binds each engine to one core
        tree = process_tree(engine.process.pid)
        named = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in tree}
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= named
        assert all(os.sched_getaffinity(pid) == cores for pid in tree)


def test_the_canary_passes_on_sha256_cbor_with_digest_hashes(engines: TwoEngines) -> None:
    result = engines.canary(engines.cbor, CBOR)
    assert [len(h) for h in result.page_hashes] == [32, 32]
    eventually(
        lambda: set(result.page_hashes) <= engines.pages(engines.cbor), "the canary's blocks"
    )


def test_the_canary_passes_with_the_engines_pythonhashseed(engines: TwoEngines) -> None:
    result = engines.canary(engines.seeded, SEEDED)
    eventually(
        lambda: (
            set(result.page_hashes) <= engines.pages(engines.seeded)
            and not engines.stale(engines.seeded)
        ),
        "the canary's blocks, fresh",
    )


def test_a_digest_engines_index_holds_exactly_its_blocks(engines: TwoEngines) -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(10, 1700) for _ in range(3 * 32 + 5)]
    response = httpx.post(
        f"{engines.cbor.url}/v1/completions",
        json={"model": engines.cbor.spec.served_model_name, "prompt": tokens, "max_tokens": 1},
        timeout=BOUND_S,
    )
    assert response.status_code == 200, response.text
    want = set(CBOR.hash_prompt(tokens))
    deadline = time.monotonic() + BOUND_S
    while not want <= engines.pages(engines.cbor):
        assert time.monotonic() < deadline, "the engine's events never arrived"
        time.sleep(0.05)
    assert not want & engines.pages(engines.seeded)  # the other engine never saw this prompt


def test_the_canary_fails_loudly_when_kvmesh_misses_the_engines_seed(engines: TwoEngines) -> None:
    with pytest.raises(HashParityError, match="another PYTHONHASHSEED"):
        engines.canary(engines.seeded, EngineHasher("sha256", 32, seed=None))
    assert engines.stale(engines.seeded) and engines.pages(engines.seeded) == frozenset()
    assert not engines.stale(engines.cbor)  # the other engine keeps its affinity
    engines.canary(engines.seeded, SEEDED)
    assert not engines.stale(engines.seeded)


def test_the_canary_names_the_engines_algorithm_when_kvmesh_uses_another(
    engines: TwoEngines,
) -> None:
    with pytest.raises(HashParityError, match=r"algo='sha256_cbor'.*int_hashes=False"):
        engines.canary(engines.cbor, EngineHasher("sha256", 32, int_hashes=True))
    assert engines.stale(engines.cbor)
    engines.canary(engines.cbor, CBOR)
    assert not engines.stale(engines.cbor)


def test_the_canary_refuses_a_block_size_the_engine_does_not_use(engines: TwoEngines) -> None:
    with pytest.raises(HashParityError, match="blocks of 32 tokens, kvmesh hashes blocks of 16"):
        engines.canary(engines.seeded, EngineHasher("sha256", 16, SEED))
    engines.canary(engines.seeded, SEEDED)
