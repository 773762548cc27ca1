"""Nothing in the package unpickles, torch.loads, evals or execs anything.

Ruff's `S` rules catch these too (`S301` pickle, `S307` eval, `S102` exec,
`S614` torch.load); this scan is the backstop that also covers files ruff
excludes and `importlib`/`getattr` spellings of the same calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("kvmesh", "worker", "coordinator", "client", "gateway", "proto", "benchmarks")
GENERATED = {"kvmesh_pb2.py", "kvmesh_pb2_grpc.py"}

BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_ATTRS = {("torch", "load"), ("numpy", "load"), ("np", "load"), ("yaml", "load")}
# Writing pickles is how vLLM names its blocks (kvmesh.engine_hash reproduces it); only
# the writing half of the module may be used, and only as `pickle.<name>`.
SERIALIZE_ONLY = {"pickle": {"dumps", "HIGHEST_PROTOCOL", "DEFAULT_PROTOCOL"}}


def _python_files() -> list[Path]:
    files: list[Path] = []
    for d in PACKAGE_DIRS:
        base = ROOT / d
        for path in base.rglob("*.py"):
            # kvmesh/<component> are symlinks to the component folders scanned on their own.
            if d == "kvmesh" and path.relative_to(base).parts[0] in PACKAGE_DIRS:
                continue
            if path.name not in GENERATED:
                files.append(path)
    return files


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[str] = []
    allowed_uses = _serialize_only_uses(tree)
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [
                f"{where} imports {a.name}"
                for a in node.names
                if a.name.split(".")[0] in BANNED_MODULES
                and not (a.asname is None and allowed_uses.get(a.name))
            ]
        elif isinstance(node, ast.Name) and node.id in SERIALIZE_ONLY:
            if node.id in allowed_uses and id(node) not in allowed_uses[node.id]:
                found.append(f"{where} uses {node.id} beyond {sorted(SERIALIZE_ONLY[node.id])}")
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES
        ):
            found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in BANNED_CALLS:
                found.append(f"{where} calls {fn.id}()")
            elif (
                isinstance(fn, ast.Attribute)
                and isinstance(fn.value, ast.Name)
                and (fn.value.id, fn.attr) in BANNED_ATTRS
            ):
                found.append(f"{where} calls {fn.value.id}.{fn.attr}()")
    return found


def _serialize_only_uses(tree: ast.AST) -> dict[str, set[int]]:
    """For each serialize-only module the file imports: the ids of its `Name` nodes that are
    the base of an allowed attribute (every other use is a violation)."""
    uses: dict[str, set[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in SERIALIZE_ONLY and a.asname is None:
                    uses.setdefault(a.name, set())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in uses
            and node.attr in SERIALIZE_ONLY[node.value.id]
        ):
            uses[node.value.id].add(id(node.value))
    return uses


def test_the_scan_sees_the_whole_package() -> None:
    names = {p.name for p in _python_files()}
    assert {"hashing.py", "events.py", "cli.py"} <= names


def test_the_scanner_catches_what_it_bans(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("import pickle\nimport torch\nx = eval('1')\ntorch.load('f')\n")
    assert len(_violations(bad)) == 3


def test_writing_a_pickle_to_hash_it_is_allowed_but_nothing_that_reads_one(
    tmp_path: Path,
) -> None:
    ok = tmp_path / "hashes.py"
    ok.write_text("import pickle\nh = pickle.dumps((1, 2), protocol=pickle.HIGHEST_PROTOCOL)\n")
    assert _violations(ok) == []
    for body in (
        "import pickle\npickle.loads(b'')\n",
        "import pickle\nf = getattr(pickle, 'loads')\n",
        "import pickle as p\np.dumps(1)\n",
        "from pickle import dumps\n",
        "import pickle\nx = pickle\n",
    ):
        bad = tmp_path / "probe.py"
        bad.write_text(body)
        assert _violations(bad), body


def test_no_unsafe_deserialization_anywhere_in_the_package() -> None:
    problems = [v for path in _python_files() for v in _violations(path)]
    assert problems == []
