"""benchmarks/connector_overhead.py without an engine: its prompts, the timing files it reads,
the rows it pools (the engine runs themselves are the benchmark's)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, write_to_textfile

from kvmesh.benchmarks import connector_overhead as bench
from kvmesh.connector.hook_timings import HookTimer
from kvmesh.errors import ConfigError
from kvmesh.metrics import CONNECTOR_PREPARE_ANSWERS


def test_the_shared_workload_repeats_most_of_an_earlier_prompt_whole_blocks() -> None:
    unique = bench.prompts("unique", 8, seed=1)
    shared = bench.prompts("shared", 8, seed=1)
    assert all(600 <= len(t.prompt) <= 1000 for t in unique + shared)
    assert len({t.prompt[: bench.BLOCK] for t in unique}) == 8  # nothing shared
    for later, earlier in zip(shared[4:], shared[:4], strict=True):
        head = len(earlier.prompt) * 7 // 10 // bench.BLOCK * bench.BLOCK
        assert later.prompt[:head] == earlier.prompt[:head]
        assert later.prompt[head : head + bench.BLOCK] != earlier.prompt[head : head + bench.BLOCK]
    assert bench.prompts("shared", 8, seed=1) == shared  # the same run every time


def test_the_hook_timings_an_engine_process_writes_are_read_back(tmp_path: Path) -> None:
    store = "overhead-test:1"
    timer = HookTimer(store)
    with timer.timed("start_load_kv"):
        pass
    with timer.timed("send"):
        spent = time.thread_time() + 0.02
        while time.thread_time() < spent:  # the saver thread busy on the engine's core
            pass
    CONNECTOR_PREPARE_ANSWERS.labels(store, "read").inc(3)
    write_to_textfile(str(tmp_path / "connector-worker-1.prom"), REGISTRY)
    samples = bench.connector_samples(tmp_path)
    assert samples[("kvmesh_connector_hook_seconds_count", "start_load_kv")] >= 1
    assert samples[("kvmesh_connector_hook_cpu_seconds_total", "send")] >= 0.02
    assert samples[("kvmesh_connector_prepare_answers_total", "read")] >= 3
    assert bench.connector_samples(tmp_path / "none") == {}


def test_rows_of_rounds_are_pooled_and_compared_with_no_connector() -> None:
    def row(variant: str, mean: float, requests: int) -> bench.Row:
        zeros = {h: 0.0 for h in bench.HOOKS}
        answers = {a: 0.0 for a in bench.ANSWERS}
        return bench.Row(variant, "unique", requests, 0, mean, mean, mean, 800.0, 0.0,
                         dict(zeros), dict(zeros), answers)  # fmt: skip

    pooled = bench.pooled([row("none", 100, 10), row("both", 150, 10), row("none", 200, 30)])
    by = {r.variant: r for r in pooled}
    assert by["none"].mean_ms == pytest.approx(175.0) and by["none"].requests == 40
    assert by["both"].ratio == pytest.approx(150 / 175)


def test_an_unknown_variant_is_refused_by_name() -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    with pytest.raises(ConfigError, match="--variants 'both,nope'"):
        bench.run(parser.parse_args(["--variants", "both,nope"]))
