"""`kvmesh.app.connect`: the Python API's way in, found in the app, imported on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvmesh.app


def test_the_app_package_names_connect_and_nothing_it_does_not_have() -> None:
    assert "connect" in kvmesh.app.__all__
    with pytest.raises(AttributeError, match=r"'kvmesh\.app' has no attribute 'start'"):
        _ = kvmesh.app.start


def test_connect_is_the_embedded_launcher_and_loads_ray_only_when_asked_for() -> None:
    # A fresh interpreter: this one may have imported Ray and the launcher already.
    code = (
        "import sys\n"
        "import kvmesh.app, kvmesh.app.cli\n"
        "print('ray' in sys.modules, 'kvmesh.app.embedded' in sys.modules)\n"
        "from kvmesh.app import connect\n"
        "from kvmesh.app.embedded import connect as launcher\n"
        "print(connect is launcher, 'ray' in sys.modules)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["False", "False", "True", "True"]
