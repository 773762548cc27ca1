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
