"""The local cluster `kvmesh start` runs, recorded so that other commands find it.

`kvmesh start` (embedded) writes ``cluster-<namespace>.json`` (its Ray
address, namespace and process id) under the state directory and removes it
when it stops; `kvmesh status | generate | replay` without ``--address`` or
``RAY_ADDRESS`` connect to the cluster recorded there, and a second `kvmesh
start` refuses while it runs. A record whose process is gone (killed, the
machine rebooted) is stale: it is removed and counts as nothing running.

The state directory is ``KVMESH_STATE_DIR`` when set, else
``$XDG_CACHE_HOME/kvmesh``, else ``~/.cache/kvmesh``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_DIR_VARIABLE = "KVMESH_STATE_DIR"


@dataclass(frozen=True, slots=True)
class RecordedCluster:
    """A cluster `kvmesh start` recorded: where Ray answers, its namespace, who runs it."""

    address: str
    namespace: str
    pid: int


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where records live (see the module doc for the order)."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_VARIABLE):
        return Path(env[STATE_DIR_VARIABLE])
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvmesh"


def record_path(namespace: str, env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / f"cluster-{namespace}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def read_record(namespace: str, env: Mapping[str, str] | None = None) -> RecordedCluster | None:
    """The live cluster recorded for `namespace`, or None (a stale or unreadable record is
    removed: it names a process that is gone, so nothing it names can answer)."""
    path = record_path(namespace, env)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        found = RecordedCluster(str(data["address"]), str(data["namespace"]), int(data["pid"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found is None or not _alive(found.pid):
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return found


def write_record(cluster: RecordedCluster, env: Mapping[str, str] | None = None) -> Path:
    """Record `cluster` for its namespace (atomically: a reader sees the old or the new file)."""
    path = record_path(cluster.namespace, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(cluster)), encoding="utf-8")
    tmp.replace(path)
    return path


def remove_record(cluster: RecordedCluster, env: Mapping[str, str] | None = None) -> None:
    """Remove the record of `cluster` if it is still the one there (never another start's)."""
    path = record_path(cluster.namespace, env)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text(encoding="utf-8")).get("pid") == cluster.pid:
            path.unlink()


__all__ = [
    "STATE_DIR_VARIABLE",
    "RecordedCluster",
    "read_record",
    "record_path",
    "remove_record",
    "state_dir",
    "write_record",
]
