"""pytest process exit for kvmesh's test suite.

Native threads that outlive the tests (gRPC's, gloo's, Ray's core worker)
have crashed CPython's interpreter teardown with SIGSEGV *after* a run had
already reported all tests passed, turning a green run into exit code 139.
Once every other plugin has finished, the process ends with pytest's own
exit status, without that teardown. Test outcomes and the exit code are
pytest's, unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _status and not hasattr(sys, "pypy_version_info"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])


@pytest.fixture(scope="module")
def fresh_cluster() -> Iterator[Callable[..., Any]]:
    """Start a `KVMesh` on a clean embedded Ray cluster: ``fresh_cluster(**connect_kwargs)``.

    A module that needs a whole cluster of its own asks for it here; Ray
    another module left running is shut down first, and every mesh started
    is closed when the module ends (closing the one that started Ray stops it).
    """
    import ray

    from kvmesh.app import connect

    started: list[Any] = []

    def start(**kwargs: Any) -> Any:
        if not started and ray.is_initialized():
            ray.shutdown()
        try:
            mesh = connect(**kwargs)
        except Exception as exc:
            # Ray's own start-up (GCS + raylet within 30 s) has timed out on a loaded
            # 2-core machine right after another module's cluster went down: once more.
            if started or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
            mesh = connect(**kwargs)
        started.append(mesh)
        return mesh

    try:
        yield start
    finally:
        for mesh in reversed(started):
            mesh.close()
