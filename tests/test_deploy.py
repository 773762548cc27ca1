"""deploy/: the YAML files parse, and every kvmesh command they name exists with its flags."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.app.cli import COMMANDS, build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
YAMLS = ("ray-cluster.yaml", "kuberay/raycluster.yaml")
TEXTS = (*YAMLS, "README.md", "Dockerfile")
# `kvmesh <subcommand> <args...>` up to the end of a shell command (quote, newline, `&&`).
KVMESH_CALL = re.compile(r"""\bkvmesh ([a-z][^'"`\n&;|\\]*)""")


def _load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def _kvmesh_calls(name: str) -> list[list[str]]:
    text = (DEPLOY / name).read_text()
    if name.endswith(".md"):  # commands live in the fenced code blocks, not in the prose
        text = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.S))
    text = text.replace("\\\n", " ")
    calls = []
    for m in KVMESH_CALL.finditer(text):
        argv = shlex.split(m.group(1), comments=True)
        if argv and argv[0] in COMMANDS:
            calls.append(argv)
    return calls


@pytest.mark.parametrize("name", YAMLS)
def test_deploy_yaml_files_parse(name: str) -> None:
    assert isinstance(_load(name), dict)


def test_ray_cluster_launcher_config_starts_a_head_and_workers() -> None:
    cfg = _load("ray-cluster.yaml")
    assert cfg["cluster_name"] == "kvmesh"
    assert any("--head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])
    assert cfg["provider"]["type"]


def test_kuberay_cluster_has_a_head_and_a_gpu_worker_group() -> None:
    rc = _load("kuberay/raycluster.yaml")
    assert rc["apiVersion"].startswith("ray.io/") and rc["kind"] == "RayCluster"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"]
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    limits = groups[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1


@pytest.mark.parametrize("name", TEXTS)
def test_every_kvmesh_command_named_in_deploy_parses_with_the_real_cli(name: str) -> None:
    calls = _kvmesh_calls(name)
    parser = build_parser()
    for argv in calls:
        parser.parse_args(argv)  # SystemExit (exit 2) on an unknown subcommand or flag


def test_deploy_docs_name_the_start_command_with_an_address() -> None:
    calls = [c for n in TEXTS for c in _kvmesh_calls(n)]
    assert any(c[0] == "start" and "--address" in c for c in calls)


def test_dockerfile_takes_its_base_image_and_torch_index_as_build_args() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert "ARG TORCH_INDEX_URL" in text
    assert "nvidia/cuda" in text  # the CUDA build is documented
    assert re.search(r"pip install \.", text)


# -- the ports the image states, and the settings the deploy files give -----------------------


def _exposed_ports() -> set[int]:
    text = (DEPLOY / "Dockerfile").read_text()
    return {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}


def _kuberay_containers() -> list[dict[str, Any]]:
    rc = _load("kuberay/raycluster.yaml")
    specs = [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
    return [c for spec in specs for c in spec["template"]["spec"]["containers"]]


def _deploy_file_settings() -> Any:
    from kvmesh.settings import file_layer

    return {path: s.value for path, s in file_layer(DEPLOY / "kvmesh.toml").items()}


def test_the_image_exposes_exactly_the_ports_the_deploy_files_use() -> None:
    launcher = _load("ray-cluster.yaml")
    gcs = {
        int(p) for c in launcher["head_start_ray_commands"] for p in re.findall(r"--port=(\d+)", c)
    }
    container_ports = {
        p["containerPort"] for c in _kuberay_containers() for p in c.get("ports", [])
    }
    worker_port = _deploy_file_settings()["transfer.port"]
    assert worker_port > 0  # a fixed port, not "a free one", or it could not be exposed
    assert _exposed_ports() == gcs | container_ports | {worker_port}
    kvmesh_ports = {
        p["containerPort"]
        for c in _kuberay_containers()
        for p in c.get("ports", [])
        if p["name"] == "kvmesh-pages"
    }
    assert kvmesh_ports == {worker_port}


def _manifest_environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as a pod would see it: secrets as stand-in values, the
    config file's mount path as the repository's deploy/kvmesh.toml."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            env[item["name"]] = "secret-" + item["valueFrom"]["secretKeyRef"]["key"] + "-x" * 8
    return env


def test_the_kuberay_environment_and_config_file_reach_the_cluster_config() -> None:
    from kvmesh.settings import load_cluster_config

    head = _kuberay_containers()[0]
    env = _manifest_environment(head)
    mounts = {m["name"]: m["mountPath"] for m in head["volumeMounts"]}
    config_path = Path(env["KVMESH_CONFIG"])
    assert config_path.parent == Path(mounts["kvmesh-config"])
    env["KVMESH_CONFIG"] = str(DEPLOY / config_path.name)  # the ConfigMap holds this file
    cfg = load_cluster_config(env=env)
    from_file = _deploy_file_settings()
    assert cfg.transfer.port == from_file["transfer.port"]
    assert cfg.transfer.host == "0.0.0.0" and cfg.pool.num_pages == from_file["pool.num_pages"]
    assert cfg.security.profile == "production"
    assert cfg.coordinator.policy == env["KVMESH_POLICY"]
    assert (
        cfg.hash.seed == env["KVMESH_SEED"] and cfg.transfer.auth_token == env["KVMESH_AUTH_TOKEN"]
    )
    assert cfg.transfer.tls_ca == "/etc/kvmesh/tls/ca.crt"
    for c in _kuberay_containers():  # every pod mounts the file the variable names
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {str(config_path.parent)}


def test_the_launchers_env_file_reaches_the_cluster_config() -> None:
    from kvmesh.settings import load_cluster_config

    lines = (DEPLOY / "kvmesh.env.example").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert "--env-file /etc/kvmesh/kvmesh.env" in _load("ray-cluster.yaml")["docker"]["run_options"]
    env["KVMESH_CONFIG"] = str(DEPLOY / Path(env["KVMESH_CONFIG"]).name)
    cfg = load_cluster_config(env=env)
    assert cfg.hash.seed == env["KVMESH_SEED"] and cfg.transfer.tls_cert == env["KVMESH_TLS_CERT"]
    assert cfg.transfer.port == _deploy_file_settings()["transfer.port"]


def test_every_kvmesh_variable_the_deploy_files_name_is_one_kvmesh_reads() -> None:
    from kvmesh.config import cluster_settings

    known = {info.env for info in cluster_settings().values()}
    known |= {"KVMESH_CONFIG", "KVMESH_STATE_DIR"}
    named = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            named |= set(re.findall(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert named and not named - known, f"unknown to kvmesh: {sorted(named - known)}"
