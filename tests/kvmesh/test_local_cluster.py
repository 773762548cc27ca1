"""The record `kvmesh start` leaves for other commands: found while its process lives,
gone (and removed) once that process is, never another start's removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvmesh.app.local_cluster import (
    RecordedCluster,
    read_record,
    record_path,
    remove_record,
    state_dir,
    write_record,
)


def _env(tmp_path: Path) -> dict[str, str]:
    return {"KVMESH_STATE_DIR": str(tmp_path)}


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def test_the_state_directory_is_the_variable_else_the_xdg_cache_else_home(tmp_path: Path) -> None:
    assert state_dir({"KVMESH_STATE_DIR": str(tmp_path)}) == tmp_path
    assert state_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "kvmesh"
    assert state_dir({}) == Path.home() / ".cache" / "kvmesh"


def test_a_record_of_a_live_process_is_found_per_namespace(tmp_path: Path) -> None:
    env = _env(tmp_path)
    mine = RecordedCluster("127.0.0.1:6379", "kvmesh", os.getpid())
    path = write_record(mine, env)
    assert path == record_path("kvmesh", env) == tmp_path / "cluster-kvmesh.json"
    assert read_record("kvmesh", env) == mine
    assert read_record("other", env) is None


def test_a_record_whose_process_is_gone_is_stale_and_removed(tmp_path: Path) -> None:
    env = _env(tmp_path)
    path = write_record(RecordedCluster("127.0.0.1:6379", "kvmesh", _dead_pid()), env)
    assert read_record("kvmesh", env) is None
    assert not path.exists()


def test_an_unreadable_record_counts_as_nothing_running(tmp_path: Path) -> None:
    env = _env(tmp_path)
    record_path("kvmesh", env).write_text("{not json")
    assert read_record("kvmesh", env) is None
    assert not record_path("kvmesh", env).exists()


def test_a_stopping_start_removes_only_its_own_record(tmp_path: Path) -> None:
    env = _env(tmp_path)
    first = RecordedCluster("127.0.0.1:1", "kvmesh", os.getpid())
    second = RecordedCluster("127.0.0.1:2", "kvmesh", os.getppid())
    write_record(second, env)
    remove_record(first, env)  # not first's any more: left alone
    assert read_record("kvmesh", env) == second
    remove_record(second, env)
    assert read_record("kvmesh", env) is None
