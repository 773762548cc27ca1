"""The embedded-cluster launcher's refusals, without starting Ray.

Starting real workers through it is pinned by the client's tests
(tests/integration/test_end_to_end.py, tests/security/test_settings.py).
"""

from __future__ import annotations

import pytest

from kvmesh.app.launch import _start_error, start_workers
from kvmesh.config import ClusterConfig
from kvmesh.errors import ConfigError, DeadlineExceeded, NoWorkers


def test_an_empty_plan_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="no workers to start"):
        start_workers(
            [], ClusterConfig(), coordinator=None, num_cpus=1, num_gpus=0, max_concurrency=1
        )


def test_a_worker_that_failed_with_a_kvmesh_error_comes_back_as_that_class() -> None:
    text = (
        "RayActorError: the actor died in __init__\n"
        "Traceback (most recent call last):\n"
        "kvmesh.errors.DeadlineExceeded: first\n"
        "kvmesh.errors.ConfigError: device 'cuda' needs CUDA on this node\n"
    )
    error = _start_error(RuntimeError(text))
    assert type(error) is ConfigError
    assert str(error) == "a worker could not start: device 'cuda' needs CUDA on this node"
    assert not isinstance(error, DeadlineExceeded)


def test_a_worker_that_failed_otherwise_is_no_workers_with_its_last_line() -> None:
    error = _start_error(RuntimeError("the actor died\n  OSError: out of file handles\n\n"))
    assert isinstance(error, NoWorkers)
    assert error.args == ("a worker could not start:   OSError: out of file handles",)
