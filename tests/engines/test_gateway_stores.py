"""The gateway in front of real engines with kvmesh's connector sees what their stores hold.

Two vLLM engines, each with kvmesh's connector and a store beside it (run
in this process, each publishing its page events, `kvmesh.worker.store_events`),
and ``kvmesh gateway --policy kv_mesh`` as users run it, following both the
engines' events and the stores'. Once engine A's own prefix cache is reset,
its store still holds the prompt's blocks: the gateway must still see them
(as A's store blocks), predict them as a load from A's store, and the
engine's own counters (``vllm:external_prefix_cache_hits``, the answer's
``cached_tokens``) must show that load happened.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

from kvmesh.connector.blocks import sealed_page_bytes
from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.store_launcher import engine_block_nbytes
from kvmesh.engine_launcher import (
    REPO_ROOT,
    EngineSpec,
    VLLMEngine,
    engine_model,
    free_port,
    local_endpoint,
)
from kvmesh.worker.engine_store import EngineStore
from kvmesh.worker.store_events import StoreEventPublisher, publish_store_events
from tests.engines.connector_kit import (
    BLOCK,
    complete,
    digests,
    external_hits,
    prompt_of,
    wait_until,
)


@dataclass
class Front:
    url: str
    a: VLLMEngine
    b: VLLMEngine
    sa: EngineStore
    sb: EngineStore


def reset(engine: VLLMEngine) -> bool:
    """Whether the engine emptied its prefix cache (it refuses while a request holds blocks)."""
    answer = httpx.post(engine.url + "/reset_prefix_cache", timeout=30)
    return answer.status_code == 200 and bool(answer.json().get("success", True))


def health(front: Front) -> dict[str, dict[str, object]]:
    engines: dict[str, dict[str, object]] = httpx.get(front.url + "/health", timeout=10).json()[
        "engines"
    ]
    return engines


@pytest.fixture(scope="module")
def front(start_engine) -> Iterator[Front]:  # type: ignore[no-untyped-def]
    page_bytes = sealed_page_bytes(engine_block_nbytes(engine_model(), BLOCK), BLOCK)
    with ExitStack() as stack:
        stores, flags = [], []
        for name in ("sa", "sb"):
            events = local_endpoint(f"{name}-events")
            replay = local_endpoint(f"{name}-replay")
            store = stack.enter_context(
                EngineStore(page_bytes=page_bytes, block_size=BLOCK, num_pages=128, name=name)
            )
            publisher = stack.enter_context(StoreEventPublisher(events, replay, name=name))
            publish_store_events(store, publisher)
            stores.append(store)
            flags.append(["--store-events", events, "--store-replay", replay])
        sa, sb = stores
        specs = [
            EngineSpec(
                block_size=BLOCK,
                extra_args=(
                    "--enable-prompt-tokens-details",
                    "--kv-transfer-config",
                    connector_config(own.address, own.control_address, peers=[other.address]),
                ),
            )
            for own, other in ((sa, sb), (sb, sa))
        ]
        a = start_engine(specs[0], name="mesh-a")
        b = start_engine(specs[1], name="mesh-b")
        port = free_port()
        cmd = [
            sys.executable, "-m", "kvmesh.app.cli", "gateway", "--policy", "kv_mesh",
            "--tokenizer", str(engine_model()), "--block-size", str(BLOCK),
            "--events-topic", a.spec.topic, "--port", str(port),
            "--health-interval", "0.3", "--request-timeout", "120", "--log-level", "warning",
        ]  # fmt: skip
        for engine, store_flags in ((a, flags[0]), (b, flags[1])):
            cmd += ["--engine", engine.url, "--name", engine.name]
            cmd += [
                "--events",
                str(engine.events_endpoint),
                "--replay",
                str(engine.replay_endpoint),
            ]
            cmd += store_flags
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
        stack.callback(proc.wait, 20)
        stack.callback(proc.terminate)
        f = Front(f"http://127.0.0.1:{port}", a, b, sa, sb)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the gateway exited with {proc.returncode}")
            try:
                engines = health(f)
            except httpx.HTTPError:
                return False
            # each engine's canary prompt was saved into its store: both streams are followed
            return all(
                not e["stale"]
                and int(str(e["events_seq"])) >= 0
                and int(str(e["store_blocks"])) > 0
                for e in engines.values()
            )

        wait_until(ready, "the gateway to follow both engines and both stores", 120.0)
        yield f


def test_blocks_gone_from_the_engines_cache_are_predicted_as_its_store_load_and_loaded(
    front: Front,
) -> None:
    prompt = prompt_of(21)
    complete(front.a, prompt)
    held = len(digests(prompt))
    wait_until(
        lambda: front.sa.service.prefix_length(digests(prompt)) == held,  # type: ignore[arg-type]
        "engine A's saves to land in its store",
    )
    wait_until(lambda: reset(front.a), "engine A to reset its prefix cache (blocks freed)")
    complete(front.a, [5, 6, 7])  # an idle engine publishes its events at its next step
    wait_until(lambda: health(front)[front.a.name]["blocks"] == 0, "A's cache emptied in the index")
    assert int(str(health(front)[front.a.name]["store_blocks"])) >= held

    before = external_hits(front.a)
    body = {"model": front.a.spec.served_model_name, "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(front.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvmesh-engine"] == front.a.name
    assert answer.headers["x-kvmesh-matched-blocks"] == "0"
    assert answer.headers["x-kvmesh-store-blocks"] == str(held)
    loaded = external_hits(front.a) - before
    assert loaded == held * BLOCK  # the engine loaded exactly the blocks predicted
    rid = int(answer.headers["x-kvmesh-decision"])
    records = httpx.get(front.url + "/kvmesh/decisions", params={"since": rid}).json()
    record = records["decisions"][0]
    assert (record["store_blocks"], record["predicted_total"]) == (held, held)
    assert record["realized_blocks"] == held  # cached_tokens: A's own hits and its loads
