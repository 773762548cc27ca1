"""KVMESH_DEVICE: where a worker's model and KV pages live, resolved on the worker's node.

The choice is tested with the CUDA probes injected (this machine has no GPU);
the CPU path runs for real, and the same worker on a GPU machine runs the
GPU path (the test marked for it), with the same code and another device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.config import ClusterConfig, ModelConfig
from kvmesh.errors import ConfigError, DeviceUnavailable
from kvmesh.events import PagesStored
from kvmesh.requests import WorkerSpec
from kvmesh.settings import load_cluster_config
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.devices import DEVICE_KINDS, medium_of, resolve_device
from kvmesh.worker.dist_group import BACKENDS
from kvmesh.worker.model import TinyTransformer
from tests.worker.worker_kit import BASE, Prompts

HAS_CUDA = torch.cuda.is_available()


def with_gpus(n: int) -> dict[str, object]:
    return {"cuda_available": lambda: n > 0, "cuda_count": lambda: n}


def test_auto_is_cuda_where_the_process_sees_a_gpu_and_cpu_elsewhere() -> None:
    assert resolve_device("auto", **with_gpus(1)) == torch.device("cuda", 0)  # type: ignore[arg-type]
    assert resolve_device("cuda", **with_gpus(1)) == torch.device("cuda", 0)  # type: ignore[arg-type]
    assert resolve_device("auto", **with_gpus(0)) == torch.device("cpu")  # type: ignore[arg-type]


def test_cpu_stays_cpu_even_where_a_gpu_is_seen() -> None:
    assert resolve_device("cpu", **with_gpus(2)) == torch.device("cpu")  # type: ignore[arg-type]


def test_a_numbered_gpu_is_that_gpu_when_the_process_sees_it() -> None:
    assert resolve_device("cuda:1", **with_gpus(2)) == torch.device("cuda", 1)  # type: ignore[arg-type]


def test_cuda_where_none_is_seen_is_refused_naming_the_setting_and_the_way_out() -> None:
    with pytest.raises(DeviceUnavailable, match=r"KVMESH_DEVICE.*'cuda'.*sees no CUDA.*'auto'"):
        resolve_device("cuda", **with_gpus(0))  # type: ignore[arg-type]


def test_a_gpu_number_past_the_ones_seen_is_refused_with_the_ones_there_are() -> None:
    with pytest.raises(DeviceUnavailable, match=r"sees 2 CUDA device\(s\) \(cuda:0 \.\. cuda:1\)"):
        resolve_device("cuda:2", **with_gpus(2))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "auto:0", "cpu:1", ""])
def test_a_name_that_is_no_device_is_refused_with_the_choices(name: str) -> None:
    with pytest.raises(DeviceUnavailable, match=r"is not a device; choose one of"):
        resolve_device(name, **with_gpus(1))  # type: ignore[arg-type]


def test_device_unavailable_is_a_config_error() -> None:
    assert issubclass(DeviceUnavailable, ConfigError)


def test_a_gpus_pages_are_reported_in_the_gpu_medium() -> None:
    assert medium_of(torch.device("cuda", 0)) == "gpu"
    assert medium_of(torch.device("cpu")) == "cpu"


def test_the_default_is_auto_and_the_environment_selects_the_device() -> None:
    assert ModelConfig().device == "auto"
    assert set(DEVICE_KINDS) == {"auto", "cpu", "cuda"}
    for value in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_cluster_config(env={"KVMESH_DEVICE": value}).model.device == value


def test_an_unknown_device_in_the_environment_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVMESH_DEVICE"):
        load_cluster_config(env={"KVMESH_DEVICE": "tpu"})


def test_the_model_resolves_auto_on_its_own_process() -> None:
    model = TinyTransformer(ModelConfig(device="auto"))
    assert model.device.type == ("cuda" if HAS_CUDA else "cpu")


def worker_on(device: str) -> WorkerActor:
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, device=device))
    return WorkerActor(WorkerSpec(WorkerId(f"dev-{device}"), cfg))


def served_medium(worker: WorkerActor) -> set[str]:
    prompts = Prompts(11)
    worker.generate(prompts.request(prompts.prompt(2), 1))
    stored = [e for e in worker.pool.snapshot_events() if isinstance(e, PagesStored)]
    return {e.medium for e in stored if e.medium is not None}


@pytest.mark.skipif(HAS_CUDA, reason="the CPU path: needs a machine without CUDA")
def test_on_a_cpu_machine_auto_puts_model_and_pages_on_the_cpu_and_links_use_gloo() -> None:
    worker = worker_on("auto")
    try:
        assert worker.config.model.device == "cpu"
        assert worker.store.device.type == worker.model.device.type == "cpu"
        assert BACKENDS[worker.store.device.type] == "gloo"
        assert served_medium(worker) == {"gpu"}  # the device tier, whatever the device
    finally:
        worker.shutdown()


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_a_worker_asked_for_cuda_without_one_refuses_before_it_serves() -> None:
    with pytest.raises(DeviceUnavailable, match="sees no CUDA"):
        worker_on("cuda")


@pytest.mark.skipif(not HAS_CUDA, reason="the GPU path: needs CUDA")
def test_on_a_gpu_machine_auto_puts_model_and_pages_on_the_gpu_and_links_use_nccl() -> None:
    worker = worker_on("auto")
    try:
        assert worker.config.model.device == "cuda:0"
        assert worker.store.kv.is_cuda and worker.model.device.type == "cuda"
        assert BACKENDS[worker.store.device.type] == "nccl"
        assert served_medium(worker) == {"gpu"}
    finally:
        worker.shutdown()


def test_the_cluster_default_reaches_the_worker_as_auto() -> None:
    assert ClusterConfig().model.device == "auto"
