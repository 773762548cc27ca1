"""Where an engine runs: the cores a bind names, and the processes an engine is made of."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.engine_launcher import bound_cores, process_tree
from kvmesh.errors import ConfigError


def test_a_bind_names_cores_as_vllm_reads_them() -> None:
    assert bound_cores("0") == {0}
    assert bound_cores("0-3") == {0, 1, 2, 3}
    assert bound_cores("0,2") == {0, 2}
    assert bound_cores("0-1|2-3") == {0, 1, 2, 3}  # one group per rank
    for left_to_vllm in (None, "", "auto", "nobind"):
        assert bound_cores(left_to_vllm) is None


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "0,,1"])
def test_a_bind_that_names_no_cores_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="name cores as"):
        bound_cores(bad)


CHILD = """
import subprocess, sys
if len(sys.argv) > 1:
    subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print("ready", flush=True)
import time
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_process_tree_holds_every_descendant() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD, CHILD],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        tree = process_tree(parent.pid)
        while len(tree) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child has started
            tree = process_tree(parent.pid)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    assert tree[0] == parent.pid and len(tree) == 2
    assert os.getpid() not in tree
