"""Real vLLM engines for tests, shared by every module under tests/engines/ (and tests/gateway/).

Fixtures (module scope: an engine takes ~25 s to start, so a module starts
its engines once and its tests share them; every engine a module started is
stopped when the module ends, process group included):

``start_engine(spec: EngineSpec | None = None, *, name: str | None = None) -> VLLMEngine``
    Starts one vLLM engine (``kvmesh.engine_launcher.VLLMEngine``) from
    ``.venv-engine`` serving the tiny random Llama in ``.engine-model``, on
    free loopback ports, KV events on (``engine.events_endpoint`` is
    ``tcp://127.0.0.1:P``: the engine's PUB connects, a subscriber binds it;
    ``engine.replay_endpoint`` is the engine's replay ROUTER), and waits
    until ``/health`` answers. ``spec`` sets block size (default 32), hash
    algorithm (``"sha256"``), PYTHONHASHSEED (``seed``), int or digest
    hashes in events, KV cache bytes, replay buffer, extra flags; the
    fixture pins each engine to one core (``cpu_bind``) unless the spec
    names one. At most ``MAX_ENGINES`` (2) run at once: stop one
    (``engine.stop()``) before starting a third. ``engine.url`` is the HTTP
    base, ``engine.spec.served_model_name`` the model name to send,
    ``engine.kill()`` / ``engine.restart()`` simulate a crash / a restart on
    the same ports.

For an engine started here, ``EngineEventsEndpoint.of_engine(engine)``
(``kvmesh.engine_subscriber``) is what an ``EngineSubscriber``
needs to follow its KV events.

Tests skip, with the reason, only when ``.venv-engine`` or the model is
absent; ``test.sh`` runs ``scripts/setup-engine-venv.sh`` first, so CI has them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from kvmesh.engine_launcher import EngineSpec, VLLMEngine, engine_setup_missing

MAX_ENGINES = 2

StartEngine = Callable[..., VLLMEngine]


@pytest.fixture(scope="module")
def start_engine() -> Iterator[StartEngine]:
    missing = engine_setup_missing()
    if missing is not None:
        pytest.skip(missing)
    started: list[VLLMEngine] = []
    cores = os.cpu_count() or 1

    def start(spec: EngineSpec | None = None, *, name: str | None = None) -> VLLMEngine:
        alive = [e for e in started if e.running()]
        if len(alive) >= MAX_ENGINES:
            raise RuntimeError(
                f"{len(alive)} engines already run ({', '.join(e.name for e in alive)}); "
                f"stop one first: this machine fits {MAX_ENGINES}"
            )
        spec = spec or EngineSpec()
        if spec.cpu_bind is None:
            spec = replace(spec, cpu_bind=str(len(started) % cores))
        engine = VLLMEngine(spec, name=name or f"engine-{len(started)}")
        started.append(engine)
        return engine.start()

    try:
        yield start
    finally:
        for engine in started:
            engine.stop()
