"""The components install as `kvmesh.*` only, editable and as a wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("worker", "coordinator", "client", "gateway", "app", "proto", "benchmarks")

PROBE = f"""
import importlib.util, json, kvmesh, kvmesh.worker, kvmesh.coordinator, kvmesh.client, kvmesh.proto
import kvmesh.gateway.app
bare = {{}}
for name in {COMPONENTS!r}:
    spec = importlib.util.find_spec(name)
    bare[name] = None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))
print(json.dumps({{"kvmesh": kvmesh.__file__, "worker": kvmesh.worker.__file__,
                  "gateway": kvmesh.gateway.app.__file__, "bare": bare}}))
"""


def _probe(env: dict[str, str] | None, cwd: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def _not_ours(bare: dict[str, str | None], roots: list[Path]) -> dict[str, str]:
    """Bare names that resolve to our components (another distribution's `proto` is fine)."""
    return {
        name: origin
        for name, origin in bare.items()
        if origin is not None and any(origin.startswith(str(r / name)) for r in roots)
    }


def test_editable_install_imports_components_under_kvmesh_only(tmp_path: Path) -> None:
    result = _probe(None, tmp_path)
    assert Path(str(result["worker"])).resolve().is_relative_to(ROOT)
    assert Path(str(result["gateway"])).resolve() == ROOT / "gateway" / "app.py"
    assert _not_ours(result["bare"], [ROOT]) == {}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(ROOT),
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("kvmesh-*.whl")
    return whl


def test_wheel_holds_only_the_kvmesh_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvmesh", next(t for t in tops if t.endswith(".dist-info"))}
    for comp in COMPONENTS:
        assert f"kvmesh/{comp}/__init__.py" in names
    assert "kvmesh/data/conversation_trace.jsonl.gz" in names
    assert "kvmesh/proto/kvmesh.proto" in names


def test_wheel_install_imports_components_under_kvmesh_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    result = _probe({"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, tmp_path)
    assert Path(str(result["worker"])).resolve().is_relative_to(target)
    assert Path(str(result["gateway"])).resolve().is_relative_to(target)
    assert _not_ours(result["bare"], [ROOT, target]) == {}  # type: ignore[arg-type]
