"""The `kvmesh` command: every subcommand's help, its errors for bad arguments, and happy paths.

Errors a user can act on are one line on stderr with exit status 2, and are
raised before anything heavy starts (these tests run in-process, no Ray).
The happy paths run the real CLI in subprocesses against one cluster that
`kvmesh start` keeps running for the whole module, as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.app.cli import COMMANDS, main
from kvmesh.benchmarks.cli import BENCHES

CLI = [sys.executable, "-m", "kvmesh.app.cli"]
# An explicit --address never sends Ray's token unless asked (Ray's rule); the local
# cluster `kvmesh start` creates uses token authentication when Ray offers it.
ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_DEDUP_LOGS": "0"}


# -- help ---------------------------------------------------------------------------------


def test_the_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert f"usage: kvmesh {name}" in capsys.readouterr().out


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_every_benchmark_has_help(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", bench, "--help"])
    assert exit_.value.code == 0
    assert f"usage: kvmesh bench {bench}" in capsys.readouterr().out


# -- errors: one line, exit 2, nothing started ----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate"], "either a prompt text or --tokens"),
        (["generate", "hi", "--tokens", "1,2"], "not both"),
        (["generate", "--tokens", "1,x"], "--tokens must be integers"),
        (["generate", "hi", "--max-tokens", "-1"], "--max-tokens must be >= 0"),
        (["generate", "hi", "--repeat", "0"], "--repeat must be positive"),
        (["start", "--workers", "0"], "--workers must be positive"),
        (["start", "--num-cpus", "-2"], "--num-cpus must be positive"),
        (["status", "--prefill-workers", "1"], "both --prefill-workers and --decode-workers"),
        (["status", "--num-pages", "0"], "--num-pages must be positive"),
        (["replay", "/nonexistent/trace.jsonl"], "does not exist"),
        (["replay", "bundled", "--time-scale", "-1"], "--time-scale must be >= 0"),
        (["replay", "bundled", "--limit", "0"], "--limit must be positive"),
        (["demo", "--workers", "0"], "--workers must be >= 1"),
        (["demo", "--policies", "kv_aware,nope"], "unknown policies"),
        (["demo", "--num-pages", "1"], "--num-pages must be >= 2"),
        (["simulate", "/nonexistent/trace.jsonl"], "does not exist"),
        (["simulate", "--workers", "0"], "workers"),
    ],
)
def test_bad_arguments_give_one_error_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"kvmesh {argv[0]}: error: ")
    assert message in err[0]


@pytest.mark.parametrize(
    "argv",
    [["nope"], ["generate", "--max-tokens", "many"], ["demo", "--no-such-flag"], ["bench", "x"]],
)
def test_unparseable_arguments_exit_2_naming_the_problem(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


# -- happy paths against one running cluster ----------------------------------------------------


def _kvmesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """`kvmesh start` with 2 workers, running in the background; yields its Ray address."""
    proc = subprocess.Popen(
        [*CLI, "start", "--workers", "2", "--num-pages", "256", "--exit-after", "600"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    found = None
    deadline = time.monotonic() + 180
    assert proc.stdout is not None
    while found is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ray address:" in line:
            found = line.split("Ray address:")[1].strip()
    try:
        if found is None:
            proc.kill()
            pytest.fail("kvmesh start did not come up:\n" + "".join(lines[-30:]))
        yield found
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the normal way to stop it
            try:
                rest, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail("kvmesh start did not stop on Ctrl-C")
            if proc.returncode != 0 or "stopping kvmesh" not in rest:
                pytest.fail(f"kvmesh start ended with {proc.returncode}:\n{rest[-2000:]}")


@pytest.mark.ray
def test_status_prints_a_table_of_the_workers(address: str) -> None:
    res = _kvmesh("status", "--address", address)
    assert res.returncode == 0, res.stderr
    for text in ("worker-0", "worker-1", "pages used", "pages free", "hit ratio"):
        assert text in res.stdout


@pytest.mark.ray
def test_generate_prints_tokens_text_and_timings_and_hits_when_repeated(address: str) -> None:
    prompt = "The quick brown fox jumps over the lazy dog, twice over."  # 56 bytes: 3 pages
    res = _kvmesh("generate", prompt, "--address", address, "--max-tokens", "5", "--repeat", "2")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("tokens: [") == 2
    assert "ttft" in res.stdout and "text:" in res.stdout
    assert "pages hit 3" in res.stdout  # the second run hits the first one's pages


@pytest.mark.ray
def test_generate_takes_token_ids_and_prints_json(address: str) -> None:
    res = _kvmesh("generate", "--tokens", "1,2,3,4", "--address", address, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prompt_tokens"] == 4
    assert len(out["tokens"]) == 16
    assert out["timings"]["ttft_ms"] > 0


@pytest.mark.ray
def test_replay_sends_trace_requests_through_the_cluster(address: str) -> None:
    res = _kvmesh(
        "replay", "bundled", "--address", address, "--limit", "4", "--time-scale", "0", "--json"
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["requests"] == 4 and report["errors"] == 0
    assert report["ttft_p50_ms"] > 0


@pytest.mark.ray
def test_status_json_counts_the_requests_served(address: str) -> None:
    res = _kvmesh("status", "--address", address, "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert len(stats["workers"]) == 2
    assert stats["requests"] >= 7  # the generate and replay tests above
    assert stats["coordinator"]["workers"] == 2


@pytest.mark.ray
def test_demo_compares_policies_on_a_running_cluster(address: str, tmp_path: Path) -> None:
    plot = tmp_path / "report.png"
    res = _kvmesh(
        "demo",
        "--address",
        address,
        "--requests",
        "6",
        "--pages-per-block",
        "1",
        "--json",
        "--plot",
        str(plot),
    )
    assert res.returncode == 0, res.stderr
    reports = [json.loads(line) for line in res.stdout.strip().splitlines()]
    assert [r["policy"] for r in reports] == ["kv_aware", "round_robin"]
    for r in reports:
        assert r["requests"] == 6 and r["errors"] == 0
        for key in ("page_hit_ratio", "pulled_pages", "ttft_mean_ms", "ttft_p99_ms"):
            assert key in r
        assert r["requests_per_s"] > 0
    assert plot.stat().st_size > 0
    assert str(plot) in res.stderr  # says where the report went


def test_simulate_runs_a_small_replay_offline() -> None:
    res = _kvmesh(
        "simulate",
        "bundled",
        "--limit",
        "200",
        "--workers",
        "2",
        "--capacity-pages",
        "300",
        "--policy",
        "round_robin",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["policy"] == "round_robin"


def test_unset_flags_keep_the_environment_and_set_flags_override_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from kvmesh.app.commands import cluster_config, configure_status

    monkeypatch.setenv("KVMESH_POLICY", "round_robin")
    monkeypatch.setenv("KVMESH_ALLOW_REMOTE", "1")
    monkeypatch.setenv("KVMESH_SEED", "cluster-secret")
    parser = argparse.ArgumentParser()
    configure_status(parser)
    from_env = cluster_config(parser.parse_args([]))
    assert from_env.coordinator.policy == "round_robin"
    assert from_env.security.allow_remote is True
    assert from_env.hash.seed == "cluster-secret"
    assert from_env.coordinator.seed == 0  # the routing seed is not the hash seed
    flagged = cluster_config(parser.parse_args(["--policy", "random", "--num-pages", "64"]))
    assert (flagged.coordinator.policy, flagged.pool.num_pages) == ("random", 64)
    monkeypatch.setenv("KVMESH_TRANSPORT", "dist")
    assert cluster_config(parser.parse_args([])).transfer.transport == "dist"
    assert cluster_config(parser.parse_args(["--transport", "grpc"])).transfer.transport == "grpc"
