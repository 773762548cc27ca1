"""The deploy files put Ray's metrics endpoint (every actor's ray_kvmesh_*) on one port,
stated alike by the launcher, the KubeRay manifest and the image."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def launcher_ports() -> set[int]:
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    commands = [*launcher["head_start_ray_commands"], *launcher["worker_start_ray_commands"]]
    starts = [c for c in commands if "ray start" in c]
    ports = [re.findall(r"--metrics-export-port=(\d+)", c) for c in starts]
    assert all(len(p) == 1 for p in ports), f"a ray start without its metrics port: {starts}"
    return {int(p[0]) for p in ports}


def manifest_ports() -> list[set[int]]:
    rc: Any = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    specs = [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
    return [
        {p["containerPort"] for p in c.get("ports", []) if p["name"] == "metrics"}
        for spec in specs
        for c in spec["template"]["spec"]["containers"]
    ]


def test_every_node_serves_its_metrics_on_the_one_port_the_image_exposes() -> None:
    (port,) = launcher_ports()
    assert all(ports == {port} for ports in manifest_ports())
    exposed = re.findall(r"^EXPOSE (.+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert str(port) in " ".join(exposed).split()
