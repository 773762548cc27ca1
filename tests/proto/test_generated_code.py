"""The checked-in protobuf/gRPC code is exactly what scripts/gen_proto.py generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen_proto():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    _gen_proto().generate(out)
    return out


@pytest.mark.parametrize("name", ["kvmesh_pb2.py", "kvmesh_pb2_grpc.py", "kvmesh_pb2.pyi"])
def test_checked_in_code_matches_a_fresh_generation(fresh: Path, name: str) -> None:
    checked_in = (ROOT / "proto" / name).read_text()
    assert checked_in == (fresh / name).read_text(), (
        f"proto/{name} is stale: run `python scripts/gen_proto.py` and commit the result"
    )


def test_generated_grpc_module_imports_the_messages_through_the_kvmesh_package(
    fresh: Path,
) -> None:
    text = (fresh / "kvmesh_pb2_grpc.py").read_text()
    assert "from kvmesh.proto import kvmesh_pb2" in text
    assert "\nimport kvmesh_pb2" not in text


def test_the_worker_service_and_page_chunk_are_importable() -> None:
    from kvmesh.proto import kvmesh_pb2, kvmesh_pb2_grpc

    chunk = kvmesh_pb2.PageChunk(page_index=2, offset=8, data=b"abc")
    assert kvmesh_pb2.PageChunk.FromString(chunk.SerializeToString()) == chunk
    assert hasattr(kvmesh_pb2_grpc, "KVWorkerStub")
    assert kvmesh_pb2.DESCRIPTOR.package == "kvmesh.v1"
