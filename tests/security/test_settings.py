"""One set of settings for every entry point: the CLI, the Python API and the actors.

`kvmesh.app.connect()` reads ``KVMESH_*`` exactly as the `kvmesh` command does
(`kvmesh.settings.load_cluster_config`): the production profile refuses from
Python with the CLI's error, before Ray starts; a bad value is one error
naming its variable (from the CLI: one line, exit 2); the seed, token and
policy set in the environment reach the client, the coordinator actor and the
worker actors (seen through the actors and on the wire). Bad LoRA ids are
`InvalidInput`, never msgpack's `OverflowError`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from kvmesh.app import connect
from kvmesh.app.cli import main
from kvmesh.client import KVMesh
from kvmesh.config import ClusterConfig, TransferConfig
from kvmesh.errors import ConfigError, InvalidInput, InvalidSetting, Unauthenticated
from kvmesh.hashing import MAX_LORA_ID, ExtraKeys, PageHasher
from kvmesh.requests import GenerateRequest
from kvmesh.worker.transfer_client import SyncPeerClient

KVMESH_BIN = str(Path(sys.executable).parent / "kvmesh")
SEED = "per-cluster-seed-from-the-environment"
TOKEN = "t0k3n-from-the-environment-32-ch"


def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVMESH_* or RAY_AUTH_MODE from the shell that runs the tests."""
    for name in list(os.environ):
        if name.startswith("KVMESH_") or name in ("RAY_AUTH_MODE", "RAY_ADDRESS"):
            monkeypatch.delenv(name)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean environment, and no Ray left running by another module in this process."""
    _clean_environment(monkeypatch)
    if ray.is_initialized():
        ray.shutdown()
    return monkeypatch


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed `kvmesh` command, with this process's (monkeypatched) environment."""
    return subprocess.run(
        [KVMESH_BIN, *args], env=dict(os.environ), capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------ the production profile


def test_connect_under_the_production_profile_refuses_as_the_cli_does(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("KVMESH_PROFILE", "production")
    clean_env.setenv("KVMESH_AUTH_TOKEN", "short")
    clean_env.setenv("KVMESH_SEED", SEED)
    with pytest.raises(ConfigError, match="production profile refuses") as refused:
        connect(num_workers=1)
    assert not ray.is_initialized()
    message = str(refused.value)
    for missing in ("RAY_AUTH_MODE", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_AUTH_TOKEN"):
        assert missing in message
    assert "seed is the built-in default" not in message  # KVMESH_SEED was read

    res = _cli("status")
    assert res.returncode == 2
    assert res.stderr == f"kvmesh status: error: {message}\n"


def test_a_config_built_in_code_cannot_lower_the_production_profile(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("KVMESH_PROFILE", "production")
    with pytest.raises(ConfigError, match="KVMESH_PROFILE=production is set"):
        connect(num_workers=1, config=ClusterConfig())
    assert not ray.is_initialized()


# ------------------------------------------------------------------ bad settings

BAD_SETTINGS = [
    ("KVMESH_POLICY", "fastest", "unknown routing policy 'fastest'"),
    ("KVMESH_ALGO", "md5", "unknown page hash 'md5'"),
    ("KVMESH_TRANSPORT", "carrier-pigeon", "unknown transport 'carrier-pigeon'"),
    ("KVMESH_MAX_MESSAGE_BYTES", "-1", "must be positive"),
    ("KVMESH_MAX_MESSAGE_BYTES", "1000", "too small"),
    ("KVMESH_MAX_MESSAGE_BYTES", "64MiB", "is not an integer"),
    ("KVMESH_TEMPERATURE", "warm", "is not a number"),
    ("KVMESH_PROFILE", "prod", "unknown security profile 'prod'"),
    ("KVMESH_DEVICE", "tpu", "unknown device 'tpu'"),
    ("KVMESH_NUM_PAGES", "1", "null page"),
    ("KVMESH_ALLOW_REMOTE", "maybe", "true or false"),
]


@pytest.mark.parametrize(("variable", "value", "reason"), BAD_SETTINGS)
def test_a_bad_setting_is_one_error_naming_it_before_ray_starts(
    clean_env: pytest.MonkeyPatch, variable: str, value: str, reason: str
) -> None:
    clean_env.setenv(variable, value)
    with pytest.raises(InvalidSetting) as bad:
        connect(num_workers=1)
    assert not ray.is_initialized()
    message = str(bad.value)
    assert message.startswith(f"{variable}={value!r}: ")
    assert reason in message
    assert "\n" not in message


@pytest.mark.parametrize(("variable", "value", "reason"), BAD_SETTINGS)
def test_the_cli_gives_a_bad_setting_as_one_line_and_exit_2(
    clean_env: pytest.MonkeyPatch, variable: str, value: str, reason: str
) -> None:
    clean_env.setenv(variable, value)
    res = _cli("status")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"kvmesh status: error: {variable}={value!r}: ")
    assert reason in lines[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["status", "--policy", "fastest"], "--policy='fastest'"),
        (["start", "--transport", "carrier-pigeon"], "--transport='carrier-pigeon'"),
        (["generate", "hi", "--profile", "prod"], "--profile='prod'"),
    ],
)
def test_a_bad_cluster_flag_is_named_like_a_variable(
    clean_env: pytest.MonkeyPatch, argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvmesh {argv[0]}: error: {named}: ")
    assert not ray.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_the_workers_node_lacks_is_one_error_not_a_ray_traceback(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # Only the worker's node knows whether it has CUDA: the worker refuses, and its
    # error reaches the caller (and the CLI, which prints it) as one kvmesh error line.
    clean_env.setenv("KVMESH_DEVICE", "cuda")
    with pytest.raises(ConfigError, match=r"a worker could not start: .*CUDA") as bad:
        connect(num_workers=1, worker_num_cpus=0.5)
    assert "\n" not in str(bad.value)
    assert not ray.is_initialized()


# ------------------------------------------------- the environment reaches every actor


@pytest.fixture(scope="module")
def env_mesh(fresh_cluster: Callable[..., Any]) -> Iterator[KVMesh]:
    """One worker, started with the seed, token, policy, model seed and pool from KVMESH_*.

    The variables are unset again once `connect` returns: what the cluster uses
    afterwards is what it read then.
    """
    with pytest.MonkeyPatch.context() as mp:
        _clean_environment(mp)
        for name, value in {
            "KVMESH_SEED": SEED,
            "KVMESH_AUTH_TOKEN": TOKEN,
            "KVMESH_POLICY": "round_robin",
            "KVMESH_MODEL_SEED": "7",
            "KVMESH_NUM_PAGES": "64",
            "KVMESH_NUM_WORKERS": "1",
        }.items():
            mp.setenv(name, value)
        mesh = fresh_cluster(worker_num_cpus=0.5)
    yield mesh


def _actor_config(actor: Any) -> ClusterConfig:
    return ray.get(actor.__ray_call__.remote(lambda self: self.config), timeout=60)


def test_the_environment_reaches_the_client_and_the_actors(env_mesh: KVMesh) -> None:
    client = env_mesh.config
    assert (client.hash.seed, client.transfer.auth_token) == (SEED, TOKEN)
    assert (client.coordinator.policy, client.model.seed, client.pool.num_pages) == (
        "round_robin",
        7,
        64,
    )
    assert env_mesh.stats().policy == "round_robin"
    [worker] = env_mesh.workers()
    assert worker["worker_id"] == "worker-0"  # KVMESH_NUM_WORKERS=1
    seen = _actor_config(env_mesh.worker("worker-0"))
    assert (seen.hash.seed, seen.transfer.auth_token, seen.model.seed) == (SEED, TOKEN, 7)
    assert seen.pool.num_pages == 64
    coordinator = ray.get_actor(
        client.coordinator.actor_name, namespace=client.coordinator.namespace
    )
    assert (
        ray.get(coordinator.__ray_call__.remote(lambda self: self.config.policy)) == "round_robin"
    )


def test_the_workers_hash_with_the_seed_and_serve_only_with_the_token(env_mesh: KVMesh) -> None:
    tokens = [(i * 7 + 3) % 256 for i in range(3 * 16 + 1)]
    hashes = PageHasher(16, SEED).hash_prompt(tokens)
    assert env_mesh.hashes(tokens) == hashes
    first = env_mesh.generate(tokens, max_tokens=1)
    again = env_mesh.generate(tokens, max_tokens=1)
    assert first.pages_hit_local == 0
    # the coordinator promised the pages because the worker announced the seeded hashes
    assert again.promised_local == again.pages_hit_local == 3
    address = env_mesh.workers()[0]["address"]
    with SyncPeerClient(address, TransferConfig(auth_token=TOKEN)) as peer:
        assert peer.lookup(hashes) == [True, True, True]
    with SyncPeerClient(address, TransferConfig()) as outsider, pytest.raises(Unauthenticated):
        outsider.lookup(hashes)


# ---------------------------------------------------------------------- LoRA ids

BAD_LORA_IDS = [2**70, MAX_LORA_ID + 1, -1, "3", 1.5, True]


@pytest.mark.parametrize("lora_id", BAD_LORA_IDS)
def test_a_lora_id_that_cannot_travel_is_invalid_input(lora_id: Any) -> None:
    with pytest.raises(InvalidInput, match="lora_id"):
        ExtraKeys(lora_id=lora_id)
    assert ExtraKeys(lora_id=MAX_LORA_ID).for_page(0, 16) == (MAX_LORA_ID, (), None)


@pytest.mark.parametrize("lora_id", BAD_LORA_IDS)
def test_the_client_refuses_a_bad_lora_id_and_keeps_serving(env_mesh: KVMesh, lora_id: Any) -> None:
    prompt = list(range(40))
    for call in (env_mesh.hashes, env_mesh.route, env_mesh.generate):
        with pytest.raises(InvalidInput, match="lora_id"):
            call(prompt, lora_id=lora_id)
    assert len(env_mesh.generate(prompt, max_tokens=1, lora_id=MAX_LORA_ID).tokens) == 1


def test_a_worker_refuses_a_request_with_an_overflowing_lora_id(env_mesh: KVMesh) -> None:
    request = GenerateRequest("lora-overflow", tuple(range(40)), 1, lora_id=2**70)
    with pytest.raises(InvalidInput, match="lora_id"):
        ray.get(env_mesh.worker("worker-0").generate.remote(request), timeout=120)
