"""A coordinator's gRPC routing API served on loopback from a test's own event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordinator.grpc_api import CoordinatorAPIServer, LocalBackend


class Loop:
    """An event loop in a thread, where the API server runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Served:
    """`core` behind a `CoordinatorAPIServer` on a free loopback port."""

    def __init__(self, loop: Loop, core: Any, security: TransferConfig, **cfg: Any) -> None:
        self.core = core
        self.loop = loop
        self.server = CoordinatorAPIServer(
            LocalBackend(core), CoordinatorConfig(api_port=0, **cfg), security
        )
        self.port = loop.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.run(self.server.stop(0))
