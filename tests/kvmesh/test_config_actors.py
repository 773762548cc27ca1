"""The config file and the environment reach the Ray actors, and the model's settings act.

`kvmesh.app.connect()` reads ``KVMESH_CONFIG`` and ``KVMESH_*`` where it runs; the
actors never read their own node's environment, they are handed the config
(tests/security/test_settings.py pins the same for the security settings).
Here: a file sets the model seed, the policy and the pool, a variable wins
over the file for one of them, and the worker's model really is the seeded
one on the configured device, while the coordinator routes with the file's
policy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

from kvmesh.client import KVMesh
from kvmesh.config import ModelConfig
from kvmesh.worker.model import TinyTransformer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def file_mesh(
    fresh_cluster: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KVMesh]:
    path = tmp_path_factory.mktemp("config") / "cluster.toml"
    path.write_text(
        'num_workers = 1\n[model]\nseed = 7\n[coordinator]\npolicy = "round_robin"\n'
        "[pool]\nnum_pages = 64\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("KVMESH_") or name == "RAY_ADDRESS":
                mp.delenv(name)
        mp.setenv("KVMESH_CONFIG", str(path))
        mp.setenv("KVMESH_NUM_PAGES", "48")  # the environment wins over the file
        mp.setenv("KVMESH_DEVICE", DEVICE)
        mesh = fresh_cluster(worker_num_cpus=0.5)
    yield mesh


def _worker_view(mesh: KVMesh) -> tuple[Any, float, str, str]:
    def look(self: Any) -> tuple[Any, float, str, str]:
        embed = float(self.model.embed.float().sum())
        return self.config, embed, self.model.device.type, self.store.device.type

    return ray.get(mesh.worker("worker-0").__ray_call__.remote(look), timeout=60)


@pytest.mark.ray
def test_the_file_and_the_environment_reach_the_client_and_the_worker(file_mesh: KVMesh) -> None:
    assert [w["worker_id"] for w in file_mesh.workers()] == ["worker-0"]  # the file's count
    seen, _, _, _ = _worker_view(file_mesh)
    for cfg in (file_mesh.config, seen):
        assert (cfg.model.seed, cfg.coordinator.policy) == (7, "round_robin")
        assert cfg.pool.num_pages == 48
        assert cfg.model.device == DEVICE


@pytest.mark.ray
def test_the_coordinator_actor_routes_with_the_files_policy(file_mesh: KVMesh) -> None:
    coordinator = ray.get_actor(
        file_mesh.config.coordinator.actor_name, namespace=file_mesh.config.coordinator.namespace
    )
    policy = ray.get(coordinator.__ray_call__.remote(lambda self: self.config.policy), timeout=60)
    assert policy == "round_robin"


@pytest.mark.ray
def test_the_model_seed_and_device_take_effect_in_the_worker(file_mesh: KVMesh) -> None:
    _, embed, model_device, store_device = _worker_view(file_mesh)
    seeded = float(TinyTransformer(ModelConfig(seed=7)).embed.sum())
    default = float(TinyTransformer(ModelConfig()).embed.sum())
    assert embed == pytest.approx(seeded) and embed != pytest.approx(default)
    assert (model_device, store_device) == (DEVICE, DEVICE)
    # and the tokens are the seeded model's: what a local model with seed 7 answers
    prompt = list(range(1, 40))
    served = file_mesh.generate(prompt, max_tokens=4).tokens
    assert list(served) == TinyTransformer(ModelConfig(seed=7)).generate(prompt, 4)
