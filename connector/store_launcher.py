"""Start and stop the kvmesh store beside an engine as a child process.

The store (`kvmesh.worker.engine_store`) runs in kvmesh's own interpreter,
apart from the engine's venv; this module starts it on free loopback ports,
waits for its ``READY`` line, and stops (SIGTERM) or kills (SIGKILL, as a
crash) it. `engine_block_nbytes` sizes a block from the engine's model
config, so the store's pages fit the engine's blocks; nothing here imports
the worker.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from kvmesh.connector.blocks import sealed_page_bytes
from kvmesh.errors import ConfigError, TransportError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}


def engine_block_nbytes(model_dir: Path, block_size: int, kv_dtype: str | None = None) -> int:
    """Bytes of one KV block of the model in `model_dir` (every layer, K and V).

    ``layers x 2 x block_size x kv_heads x head_dim x dtype bytes``, read from
    its ``config.json`` (`kv_dtype` overrides the model's dtype, as the
    engine's ``--kv-cache-dtype`` does).
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_key_value_heads", config["num_attention_heads"]))
        head_dim = int(
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        )
        dtype = kv_dtype or str(config.get("dtype") or config.get("torch_dtype") or "float32")
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot size a KV block from {model_dir}/config.json: {exc}") from None
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"KV dtype {dtype!r} unknown; choose one of {sorted(DTYPE_BYTES)}")
    return layers * 2 * block_size * heads * head_dim * DTYPE_BYTES[dtype]


class StoreProcess:
    """One engine store process on loopback: `start`, `stop`, `kill`.

    `page_address` (peers and the engine fetch pages there) and
    `control_address` are known after `start`. Its log goes to `log_path`.
    """

    def __init__(
        self,
        *,
        block_nbytes: int,
        block_size: int,
        pages: int = 256,
        peers: Sequence[str] = (),
        hash_algo: str = "sha256",
        seed: str | None = None,
        name: str = "engine-store",
        python: str = sys.executable,
        log_dir: Path | None = None,
        page_delay_s: float = 0.0,
        events: str | None = None,
        events_replay: str | None = None,
        shm: bool = True,
        staging_pages: int | None = None,
    ) -> None:
        self.page_delay_s = page_delay_s  # test hook: every streamed page waits this long
        self.shm = shm  # False: the store keeps no shared-memory arena (gRPC only)
        self.staging_pages = staging_pages
        # where the store publishes its page events for a gateway (kvmesh.worker.store_events)
        self.events = events
        self.events_replay = events_replay
        self.page_bytes = sealed_page_bytes(block_nbytes, block_size)
        self.block_size = block_size
        self.pages = pages
        self.peers = tuple(peers)
        self.hash_algo = hash_algo
        self.seed = seed
        self.name = name
        self.python = python
        root = log_dir or Path(tempfile.mkdtemp(prefix=f"kvmesh-{name}-"))
        self.log_path = root / f"{name}.log"
        self.process: subprocess.Popen[str] | None = None
        self.page_address = ""
        self.control_address = ""
        self._ports = (0, 0)

    def command(self) -> list[str]:
        page_port, control_port = self._ports
        cmd = [
            self.python, "-m", "kvmesh.worker.engine_store",
            "--page-bytes", str(self.page_bytes),
            "--block-size", str(self.block_size),
            "--pages", str(self.pages),
            "--hash-algo", self.hash_algo,
            "--name", self.name,
            "--port", str(page_port),
            "--control-port", str(control_port),
        ]  # fmt: skip
        if self.seed is not None:
            cmd += ["--seed", self.seed]
        if self.page_delay_s:
            cmd += ["--page-delay-s", str(self.page_delay_s)]
        if not self.shm:
            cmd += ["--no-shm"]
        if self.staging_pages is not None:
            cmd += ["--staging-pages", str(self.staging_pages)]
        for peer in self.peers:
            cmd += ["--peer", peer]
        if self.events is not None:
            cmd += ["--events", self.events]
        if self.events_replay is not None:
            cmd += ["--events-replay", self.events_replay]
        return cmd

    def start(self, timeout: float = 60.0) -> StoreProcess:
        """Start the store and wait for READY; `TransportError` with its log tail if it fails."""
        if self.running():
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(
                self.process.stdout.readline() if self.process and self.process.stdout else ""
            ),
            daemon=True,
        )
        reader.start()
        reader.join(timeout)
        words = line[0].split() if line else []
        if len(words) != 3 or words[0] != "READY":
            self.kill()
            raise TransportError(
                f"engine store {self.name} did not start within {timeout:.0f} s:\n{self.log_tail()}"
            )
        self.page_address, self.control_address = words[1], words[2]
        self._ports = (_port(self.page_address), _port(self.control_address))
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._close()

    def kill(self) -> None:
        """SIGKILL at once, as a crash would."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait(10)
        self._close()

    def restart(self, timeout: float = 60.0) -> StoreProcess:
        """Start again on the same ports (empty: a store keeps nothing across a restart)."""
        self.stop()
        return self.start(timeout)

    def _close(self) -> None:
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> StoreProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
