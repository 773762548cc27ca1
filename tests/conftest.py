"""Fixtures shared by the modules that run a real embedded cluster.

A module that uses `mesh` sets `CONFIG` (a `ClusterConfig`) and may set
`MESH_OPTIONS` (extra `KVMesh.connect` keywords, e.g. ``num_workers``); it
gets one fresh cluster for the whole module. `model` is the same model the
workers run, for from-scratch reference answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest) -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from kvmesh.client import KVMesh

    if ray.is_initialized():  # another module left Ray running: start from a clean cluster
        ray.shutdown()
    options = {"num_workers": 3, "num_cpus": 4, **getattr(request.module, "MESH_OPTIONS", {})}
    m = KVMesh.connect(config=request.module.CONFIG, **options)
    try:
        yield m
    finally:
        m.close()  # stops Ray, and with it any worker the module started itself


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    from kvmesh.worker.model import TinyTransformer

    return TinyTransformer(request.module.CONFIG.model)
