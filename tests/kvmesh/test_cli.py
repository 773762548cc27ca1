"""The `kvmesh` command: every subcommand's help, its errors for bad arguments, and happy paths.

Errors a user can act on are one line on stderr with exit status 2, and are
raised before anything heavy starts (these tests run in-process, no Ray).
The happy paths run the real CLI in subprocesses against one cluster that
`kvmesh start` keeps running for the whole module, as a user would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

import kvmesh.arguments
from kvmesh.app.cli import COMMANDS, build_parser, main
from kvmesh.benchmarks.cli import BENCHES

CLI = [sys.executable, "-m", "kvmesh.app.cli"]
# An explicit --address never sends Ray's token unless asked (Ray's rule); the local
# cluster `kvmesh start` creates uses token authentication when Ray offers it. The
# module's cluster records itself in a state directory of its own (not ~/.cache/kvmesh,
# which other kvmesh processes on this machine may use), and nothing from the shell's
# KVMESH_* or RAY_ADDRESS leaks in.
STATE_DIR = tempfile.mkdtemp(prefix="kvmesh-test-cli-")
# the module's cluster takes its pool size from a config file: the file reaches the workers
CONFIG_FILE = str(Path(tempfile.mkdtemp(prefix="kvmesh-test-cli-config-")) / "cluster.yaml")
Path(CONFIG_FILE).write_text("pool:\n  num_pages: 256\n")
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_") and k != "RAY_ADDRESS"},
    "RAY_AUTH_MODE": "token",
    "RAY_DEDUP_LOGS": "0",
    "KVMESH_STATE_DIR": STATE_DIR,
}


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
        (["generate", ""], "the prompt is empty"),
        (["generate", "--tokens", "1,256"], "--tokens must be in [0, 256) for this model, got 256"),
        (["start", "--prefill-workers", "1"], "both --prefill-workers and --decode-workers"),
        (["replay", "/nonexistent/trace.jsonl"], "does not exist"),
        (["demo", "--policies", "kv_aware,nope"], "unknown policies"),
        (["demo", "--num-pages", "1"], "--num-pages must be >= 2"),
        (["simulate", "/nonexistent/trace.jsonl"], "does not exist"),
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
    assert not ray.is_initialized()  # refused before anything started


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["generate", "hi", "--max-tokens", "-1"],
            "argument --max-tokens: must be an integer >= 0",
        ),
        (["generate", "hi", "--repeat", "0"], "argument --repeat: must be a positive integer"),
        (["start", "--workers", "0"], "argument --workers: must be a positive integer, got '0'"),
        (["start", "--num-cpus", "-2"], "argument --num-cpus: must be a positive number"),
        (["start", "--worker-gpus", "nan"], "argument --worker-gpus: must be a finite number"),
        (["start", "--num-pages", "0"], "argument --num-pages: must be a positive integer"),
        (
            ["replay", "bundled", "--time-scale", "-1"],
            "argument --time-scale: must be a number >= 0",
        ),
        (["replay", "bundled", "--limit", "0"], "argument --limit: must be a positive integer"),
        (["generate", "--max-tokens", "many"], "argument --max-tokens: must be an integer"),
        (["bench", "router", "--workers", "0"], "argument --workers: "),
        (["bench", "router", "--routes", "0"], "argument --routes: must be a positive integer"),
        (["bench", "router", "--pages", "-5"], "argument --pages: must be a positive integer"),
        (["bench", "pool", "--limit", "0"], "argument --limit: must be a positive integer"),
        (["bench", "load", "--clients", "0"], "argument --clients: must be a positive integer"),
        (["bench", "transfer", "--rounds", "0"], "argument --rounds: must be a positive integer"),
        (["bench", "engines", "--requests", "-1"], "argument --requests: must be a positive"),
        (["demo", "--workers", "0"], "argument --workers: must be a positive integer"),
        (["simulate", "--workers", "0"], "argument --workers: must be a positive integer"),
        (["simulate", "--temperature", "-1"], "argument --temperature: must be a number >= 0"),
        (["gateway", "--port", "70000"], "argument --port: must be a TCP port in 0..65535"),
    ],
)
def test_a_bad_flag_value_is_one_usage_line_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    command = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    assert err[0].startswith(f"kvmesh {command}: error: {message}")
    assert err[0].endswith(f"(see kvmesh {command} --help)")


def _numeric_flags(
    parser: argparse.ArgumentParser, command: str = "kvmesh"
) -> Iterator[tuple[str, str, Any]]:
    """(command, flag, type) of every flag of every command and benchmark that takes a number."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric_flags(sub, f"{command} {name}")
        elif action.type is not None and action.option_strings:
            yield command, action.option_strings[-1], action.type


def test_every_numeric_flag_of_every_command_is_checked_by_one_shared_type() -> None:
    shared = {getattr(kvmesh.arguments, name) for name in kvmesh.arguments.__all__}
    flags = list(_numeric_flags(build_parser()))
    bare = [(c, f) for c, f, t in flags if t in (int, float)]
    assert not bare, f"give these a type from kvmesh.arguments (range checked): {bare}"
    assert sum(t in shared for _, _, t in flags) > 50


@pytest.mark.parametrize(
    "argv",
    [["nope"], ["demo", "--no-such-flag"], ["bench", "x"], ["status", "--workers", "2"]],
)
def test_unparseable_arguments_exit_2_naming_the_problem(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


# -- happy paths against one running cluster ----------------------------------------------------


def _kvmesh(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _one_error_line(res: subprocess.CompletedProcess[str], command: str) -> str:
    """The one line a refused command printed (exit 2, no traceback, no Ray noise)."""
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith(f"kvmesh {command}: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """`kvmesh start` with 2 workers, running in the background; yields its Ray address."""
    proc = subprocess.Popen(
        [*CLI, "start", "--workers", "2", "--config", CONFIG_FILE, "--exit-after", "600"],
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
        if list(Path(STATE_DIR).iterdir()):
            pytest.fail(f"kvmesh start left its record behind: {list(Path(STATE_DIR).iterdir())}")


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


# -- the lifecycle: commands find the running cluster, never start a throwaway one ------------


@pytest.mark.ray
def test_status_without_an_address_uses_the_cluster_kvmesh_start_recorded(address: str) -> None:
    res = _kvmesh("status", "--json")
    assert res.returncode == 0, res.stderr
    workers = json.loads(res.stdout)["workers"]
    assert {w["worker_id"] for w in workers} == {"worker-0", "worker-1"}
    # `kvmesh start --config` gave the workers the file's pool: 256 pages, page 0 the null page
    assert {w["pages_used"] + w["pages_free"] for w in workers} == {255}
    [record] = Path(STATE_DIR).iterdir()
    assert json.loads(record.read_text())["address"] == address


@pytest.mark.ray
def test_a_second_kvmesh_start_refuses_while_one_runs(address: str) -> None:
    line = _one_error_line(_kvmesh("start", "--workers", "1", "--exit-after", "1"), "start")
    assert f"a kvmesh cluster already runs here: Ray at {address}" in line
    assert "kvmesh start --join" in line


@pytest.mark.ray
def test_start_on_a_cluster_where_kvmesh_runs_refuses_unless_asked_to_join(address: str) -> None:
    refused = _kvmesh("start", "--address", address, "--exit-after", "1")
    line = _one_error_line(refused, "start")
    assert "kvmesh already runs in namespace 'kvmesh'" in line and "2 workers registered" in line
    joined = _kvmesh("start", "--address", address, "--join", "--exit-after", "1")
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert "worker-0" in joined.stdout and "worker-1" in joined.stdout
    # joining created no worker and stopped none of the running cluster's
    stats = json.loads(_kvmesh("status", "--json").stdout)
    assert sorted(w["worker_id"] for w in stats["workers"]) == ["worker-0", "worker-1"]


@pytest.mark.ray
def test_ray_address_is_honoured_by_the_cli_and_the_python_api(address: str) -> None:
    res = _kvmesh(
        "status", "--json", env={"RAY_ADDRESS": address, "KVMESH_STATE_DIR": "/nonexistent"}
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(json.loads(res.stdout)["workers"]) == 2
    code = (
        "from kvmesh.app import connect\n"
        "with connect() as mesh:\n"
        "    print(sorted(w['worker_id'] for w in mesh.workers()), mesh.ray_address)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        env={**ENV, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["['worker-0',", "'worker-1']", address]


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

    from kvmesh.app.commands import cluster_config, configure_start

    monkeypatch.setenv("KVMESH_POLICY", "round_robin")
    monkeypatch.setenv("KVMESH_ALLOW_REMOTE", "1")
    monkeypatch.setenv("KVMESH_SEED", "cluster-secret")
    parser = argparse.ArgumentParser()
    configure_start(parser)
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


# -- nothing running: one line, exit 2, within the connect timeout -----------------------------


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_commands_with_no_cluster_recorded_or_given_fail_and_start_nothing(
    tmp_path: Path,
) -> None:
    env = {"KVMESH_STATE_DIR": str(tmp_path)}
    for argv in (["status"], ["generate", "hi"], ["replay", "bundled", "--limit", "1"]):
        line = _one_error_line(_kvmesh(*argv, env=env, timeout=60), argv[0])
        assert "no kvmesh cluster is running here" in line
        assert "kvmesh start" in line and "--address" in line and "RAY_ADDRESS" in line
    assert not list(tmp_path.iterdir())  # nothing was started, so nothing recorded


def test_an_address_where_nothing_listens_fails_in_one_line(tmp_path: Path) -> None:
    where = f"127.0.0.1:{_closed_port()}"
    env = {"KVMESH_STATE_DIR": str(tmp_path)}
    line = _one_error_line(_kvmesh("status", "--address", where, env=env, timeout=60), "status")
    assert f"no Ray cluster answers at --address={where}" in line
    res = _kvmesh("generate", "hi", env={**env, "RAY_ADDRESS": where}, timeout=60)
    assert f"no Ray cluster answers at RAY_ADDRESS={where}" in _one_error_line(res, "generate")
    line = _one_error_line(_kvmesh("status", "--address", "nowhere", env=env), "status")
    assert "a Ray address is HOST:PORT" in line


def test_the_python_api_honours_ray_address_and_fails_fast_when_nothing_answers() -> None:
    where = f"127.0.0.1:{_closed_port()}"
    code = (
        "from kvmesh.app import connect\n"
        "from kvmesh.errors import ClusterUnreachable\n"
        "import ray\n"
        "try:\n"
        "    connect(num_workers=1)\n"
        "except ClusterUnreachable as exc:\n"
        "    print('refused:', exc, ray.is_initialized())\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        env={**ENV, "RAY_ADDRESS": where},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith(f"refused: no Ray cluster answers at RAY_ADDRESS={where}")
    assert res.stdout.strip().endswith("False")  # Ray was never initialised


def test_attaching_where_ray_runs_without_kvmesh_is_refused_and_creates_nothing() -> None:
    code = (
        "import ray\n"
        "from kvmesh.client import KVMesh\n"
        "from kvmesh.errors import ClusterUnreachable\n"
        "ray.init(num_cpus=1, include_dashboard=False, namespace='kvmesh')\n"
        "try:\n"
        "    KVMesh.attach()\n"
        "except ClusterUnreachable as exc:\n"
        "    print('refused:', exc)\n"
        "print('actors:', len(ray.util.list_named_actors(all_namespaces=True)))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stderr[-3000:]
    refused, actors = res.stdout.strip().splitlines()[-2:]
    assert refused.startswith("refused: Ray runs at ") and "but kvmesh does not" in refused
    assert "kvmesh start --address" in refused
    assert actors == "actors: 0"
