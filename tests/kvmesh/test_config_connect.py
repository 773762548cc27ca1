"""How long joining a running cluster waits for its GCS port is a setting
(`ClusterConfig.connect_timeout_s`, ``KVMESH_CONNECT_TIMEOUT_S``), checked like any other,
and it is the wait a join really gets (`kvmesh.ray_address.reachable`).

"A cluster that never answers" is a real loopback socket whose accept queue is full: the
kernel drops further SYNs, so a connect to it waits out its whole timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig
from kvmesh.errors import ClusterUnreachable, InvalidSetting
from kvmesh.settings import load_cluster_config

KVMESH_BIN = str(Path(sys.executable).parent / "kvmesh")


@pytest.fixture
def silent_address() -> Iterator[str]:
    """HOST:PORT of a listening socket that answers no new connection (accept queue full)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    address = server.getsockname()
    held: list[socket.socket] = []
    try:
        for _ in range(64):
            try:
                held.append(socket.create_connection(address, timeout=0.2))
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel answers connections beyond the accept queue")
        yield f"{address[0]}:{address[1]}"
    finally:
        for s in held:
            s.close()
        server.close()


def test_the_connect_timeout_is_five_seconds_unless_a_variable_file_or_code_says_otherwise(
    tmp_path: Path,
) -> None:
    assert load_cluster_config(env={}).connect_timeout_s == 5.0
    assert load_cluster_config(env={"KVMESH_CONNECT_TIMEOUT_S": "0.5"}).connect_timeout_s == 0.5
    config = tmp_path / "cluster.toml"
    config.write_text("connect_timeout_s = 2\n")
    assert load_cluster_config(config_file=config, env={}).connect_timeout_s == 2
    explicit = load_cluster_config(
        {"connect_timeout_s": 1.5}, env={"KVMESH_CONNECT_TIMEOUT_S": "9"}
    )
    assert explicit.connect_timeout_s == 1.5


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0", "must be positive"),
        ("-1", "must be positive"),
        ("inf", "must be a finite number"),
        ("nan", "must be a finite number"),
        ("soon", "is not a number"),
    ],
)
def test_a_connect_timeout_that_is_not_a_positive_number_is_refused_naming_the_variable(
    text: str, reason: str
) -> None:
    with pytest.raises(InvalidSetting) as caught:
        load_cluster_config(env={"KVMESH_CONNECT_TIMEOUT_S": text})
    assert str(caught.value).startswith(f"KVMESH_CONNECT_TIMEOUT_S={text!r}: {reason}")
    assert "ClusterConfig.connect_timeout_s" in str(caught.value)


def test_a_config_built_in_code_with_no_connect_timeout_is_refused() -> None:
    with pytest.raises(InvalidSetting, match=r"ClusterConfig.connect_timeout_s=0.0: must be pos"):
        ClusterConfig(connect_timeout_s=0.0)


def test_a_join_waits_the_configured_timeout_for_a_cluster_that_never_answers(
    silent_address: str,
) -> None:
    cfg = load_cluster_config({"connect_timeout_s": 0.3}, env={})
    with pytest.raises(ClusterUnreachable) as caught:
        KVMesh.join_ray(silent_address, cfg, "--address")
    assert str(caught.value).startswith(
        f"no Ray cluster answers at --address={silent_address}: no answer within 0.3s"
    )


def test_the_cli_takes_the_connect_timeout_from_the_environment(silent_address: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.pop("RAY_ADDRESS", None)
    env["KVMESH_CONNECT_TIMEOUT_S"] = "0.4"
    res = subprocess.run(
        [KVMESH_BIN, "status", "--address", silent_address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    [line] = res.stderr.splitlines()
    assert line.startswith(
        f"kvmesh status: error: no Ray cluster answers at --address={silent_address}: "
        "no answer within 0.4s"
    )
