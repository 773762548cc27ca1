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
