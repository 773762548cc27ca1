"""Where a worker's model and KV pages live, decided on the worker's own node.

``ModelConfig.device`` (``KVMESH_DEVICE``) is one of `DEVICE_KINDS`:

- ``auto``: ``cuda`` when this process sees a GPU, else ``cpu``. The worker
  resolves it, not the driver: Ray places workers on nodes whose GPUs the
  driver's machine may lack (``--worker-gpus`` reserves one per worker, and
  Ray sets ``CUDA_VISIBLE_DEVICES`` so the reserved one is ``cuda:0``);
- ``cpu``;
- ``cuda`` or ``cuda:N``: refused with `DeviceUnavailable` when the process
  sees no GPU (or fewer than N + 1), never silently run on the CPU.

The device then decides the rest, with the same code on both: the KV store
and the model are allocated there (the pool's events name the index's
device tier, ``gpu``, on either: `PoolConfig.medium`) and torch.distributed links pick the
backend that moves its tensors (`kvmesh.worker.dist_group.BACKENDS`: NCCL
for cuda, gloo for cpu).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvmesh.errors import DeviceUnavailable

DEVICE_KINDS: tuple[str, ...] = ("auto", "cpu", "cuda")
"""Registry of the device names a config may give (``cuda:N`` counts as cuda)."""

MEDIA: dict[str, str] = {"cuda": "gpu", "cpu": "cpu"}
"""The medium a device type's pages are reported in (KV events, tiers)."""

SETTING = "model.device (KVMESH_DEVICE)"


def resolve_device(
    requested: str,
    *,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    cuda_count: Callable[[], int] = torch.cuda.device_count,
) -> torch.device:
    """The device `requested` means in this process; raises `DeviceUnavailable` for a GPU
    this process does not see and for a name that is not a device. The CUDA probes are
    arguments so that the choice is tested without a GPU."""
    kind, colon, index = requested.partition(":")
    if kind == "auto" and not colon:
        return torch.device("cuda", 0) if cuda_available() else torch.device("cpu")
    if kind == "cpu" and not colon:
        return torch.device("cpu")
    if kind == "cuda" and (not colon or index.isdigit()):
        if not cuda_available():
            raise DeviceUnavailable(
                f"{SETTING}={requested!r}, but this worker's process sees no CUDA device "
                "(no GPU on its node, a CPU-only torch build, or no GPU reserved for it: "
                "start workers with --worker-gpus 1); use 'auto' or 'cpu'"
            )
        n = int(index) if colon else 0
        if n >= cuda_count():
            raise DeviceUnavailable(
                f"{SETTING}={requested!r}, but this worker's process sees "
                f"{cuda_count()} CUDA device(s) (cuda:0 .. cuda:{cuda_count() - 1})"
            )
        return torch.device("cuda", n)
    raise DeviceUnavailable(
        f"{SETTING}={requested!r} is not a device; choose one of {DEVICE_KINDS} or 'cuda:N'"
    )


def medium_of(device: torch.device) -> str:
    """The medium name a device's pages carry in KV events (``gpu`` for cuda)."""
    return MEDIA.get(device.type, device.type)


__all__ = ["DEVICE_KINDS", "MEDIA", "medium_of", "resolve_device"]
