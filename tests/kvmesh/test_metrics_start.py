"""`kvmesh start --metrics-port`: the cluster it creates serves every actor's metrics there.

The command runs as an operator runs it (its own process, Ctrl-C to stop);
the test scrapes the port and parses it with prometheus-client's parser.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

CLI = [sys.executable, "-m", "kvmesh.app.cli"]
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_") and k != "RAY_ADDRESS"},
    "RAY_AUTH_MODE": "token",
    "KVMESH_STATE_DIR": tempfile.mkdtemp(prefix="kvmesh-test-metrics-start-"),
    "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_error_line(*args: str) -> str:
    res = subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    return line


def test_a_port_past_65535_is_refused_before_anything_starts() -> None:
    line = one_error_line("start", "--metrics-port", "70000", "--exit-after", "1")
    assert line == "kvmesh start: error: --metrics-port must be a TCP port (1..65535), got 70000"


def test_a_running_clusters_port_is_not_ours_to_set() -> None:
    line = one_error_line("start", "--address", "127.0.0.1:1", "--metrics-port", "9100")
    assert "ray start --metrics-export-port" in line


@pytest.fixture(scope="module")
def started() -> Iterator[tuple[int, list[str]]]:
    """`kvmesh start --metrics-port P` with one worker; yields P and what it printed."""
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "start", "--workers", "1", "--metrics-port", str(port), "--exit-after", "300"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any("Ray address:" in ln for ln in lines):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    try:
        if not any("Ray address:" in ln for ln in lines):
            pytest.fail("kvmesh start did not come up:\n" + "".join(lines[-30:]))
        yield port, lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_start_serves_the_actors_metrics_on_its_metrics_port(
    started: tuple[int, list[str]],
) -> None:
    port, printed = started
    assert any(f":{port}/metrics" in line and "metrics (Prometheus)" in line for line in printed)
    wanted = {"ray_kvmesh_workers", "ray_kvmesh_pool_pages"}
    seen: dict[str, list[float]] = {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not wanted <= set(seen):
        time.sleep(1.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        seen = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in wanted and (
                    s.name != "ray_kvmesh_workers" or s.labels["state"] == "all"
                ):
                    seen.setdefault(s.name, []).append(s.value)
    assert seen.get("ray_kvmesh_workers") == [1.0]
    assert len(seen.get("ray_kvmesh_pool_pages", [])) == 3  # used, free, cached of its one worker
