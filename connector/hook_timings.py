"""Wall time of the connector's vLLM hooks, and a file a benchmark reads them from.

CPU profiles of a busy engine (py-spy) count samples on a CPU, not time spent
waiting for the store, a lock or a core; what a request waits for is wall time
inside each hook. `HookTimer` records it in ``kvmesh_connector_hook_seconds``
(`kvmesh.metrics`), and the CPU time of the thread that ran it in
``kvmesh_connector_hook_cpu_seconds`` (what the connector itself takes from
the engine's pinned core, waits left out), in whichever of the engine's
processes runs the hook (the scheduler's engine core, the worker). vLLM serves only its API server's
registry on ``/metrics``, so when ``KVMESH_CONNECTOR_TIMINGS`` names a folder
each process also writes its registry there every `WRITE_EVERY_S`, as
Prometheus text (prometheus-client's ``write_to_textfile``), for
``python -m benchmarks.connector_overhead`` to read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import REGISTRY, write_to_textfile

from kvmesh.metrics import CONNECTOR_HOOK_CPU_SECONDS, CONNECTOR_HOOK_SECONDS, MetricChild

TIMINGS_ENV = "KVMESH_CONNECTOR_TIMINGS"
WRITE_EVERY_S = 0.5
HOOKS = (
    "get_num_new_matched_tokens",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_save",
    "send",
    "prepare",
    "pull",
)


class HookTimer:
    """Observes each hook's wall time and its thread's CPU time under the engine's store label."""

    def __init__(self, store: str) -> None:
        self._children: dict[str, tuple[MetricChild, MetricChild]] = {
            hook: (
                CONNECTOR_HOOK_SECONDS.labels(store, hook),
                CONNECTOR_HOOK_CPU_SECONDS.labels(store, hook),
            )
            for hook in HOOKS
        }

    @contextmanager
    def timed(self, hook: str) -> Iterator[None]:
        wall, cpu = self._children[hook]
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            cpu.inc(time.thread_time() - start_cpu)
            wall.observe(time.perf_counter() - start)


_writer: threading.Thread | None = None
_writer_lock = threading.Lock()


def write_timings_if_asked(role: str) -> Path | None:
    """Start (once per process) the thread that writes this process's metrics into the folder
    ``KVMESH_CONNECTOR_TIMINGS`` names; the file it writes, or None when the variable is unset."""
    global _writer
    folder = os.environ.get(TIMINGS_ENV)
    if not folder:
        return None
    path = Path(folder) / f"connector-{role}-{os.getpid()}.prom"
    with _writer_lock:
        if _writer is None:
            Path(folder).mkdir(parents=True, exist_ok=True)

            def write() -> None:
                while True:
                    write_to_textfile(str(path), REGISTRY)
                    time.sleep(WRITE_EVERY_S)

            _writer = threading.Thread(target=write, name="kvmesh-timings", daemon=True)
            _writer.start()
    return path
