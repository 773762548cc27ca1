#!/usr/bin/env python3
"""Regenerate kvmesh's protobuf and gRPC code from proto/kvmesh.proto.

    python scripts/gen_proto.py            # writes proto/kvmesh_pb2.py, _pb2_grpc.py, _pb2.pyi
    python scripts/gen_proto.py --out DIR  # writes the same three files into DIR

The .proto is compiled under its package path ``kvmesh/proto/kvmesh.proto``,
so protoc itself emits ``from kvmesh.proto import kvmesh_pb2`` in the gRPC
module (no bare ``import kvmesh_pb2`` to patch) and the descriptor's file name
cannot clash with another ``kvmesh.proto`` in the process. The output depends
only on the .proto and the grpcio-tools version.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "kvmesh.proto"
OUTPUTS = ("kvmesh_pb2.py", "kvmesh_pb2_grpc.py", "kvmesh_pb2.pyi")


def generate(out_dir: Path, proto: Path = PROTO) -> list[Path]:
    """Compile `proto` and write the generated files into `out_dir`; returns their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        gen = Path(tmp) / "gen"
        (src / "kvmesh" / "proto").mkdir(parents=True)
        gen.mkdir()
        shutil.copyfile(proto, src / "kvmesh" / "proto" / "kvmesh.proto")
        well_known = str(resources.files("grpc_tools") / "_proto")
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{src}",
                f"-I{well_known}",
                f"--python_out={gen}",
                f"--pyi_out={gen}",
                f"--grpc_python_out={gen}",
                "kvmesh/proto/kvmesh.proto",
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed with exit status {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            target = out_dir / name
            shutil.copyfile(gen / "kvmesh" / "proto" / name, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO.parent, help="output directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
