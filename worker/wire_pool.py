"""Connections to peers kept for reuse, and a FetchPages call that can be cancelled.

`ChannelPool` keeps idle `WireChannel`s per peer so that a pull costs no
connect or TLS handshake; `FetchCall` runs one call on a pooled channel and
can be cancelled from another thread without touching a channel another call
has taken since.
"""

from __future__ import annotations

import ssl
import threading

import grpc

from kvmesh.config import TransferConfig
from kvmesh.grpc_security import client_tls_material
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.worker.grpc_wire import WireChannel
from kvmesh.worker.h2_frames import ChunkSink, WireStatus


def tls_context(config: TransferConfig) -> ssl.SSLContext | None:
    """The client TLS context for `client_tls_material` (what grpcio's channels use), or None."""
    root, key, cert = client_tls_material(config)
    if root is None and cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if root is not None:
        ctx.load_verify_locations(cadata=root.decode())
    if key is not None and cert is not None and config.tls_cert and config.tls_key:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)  # the files read_pem just read
    ctx.set_alpn_protocols(["h2"])
    return ctx


class ChannelPool:
    """Idle `WireChannel`s to one peer, reused by later calls (thread-safe).

    A channel is taken for one call and given back after it; a broken one is
    closed instead. An idle channel is checked before reuse (`WireChannel.usable`):
    one idle for the keepalive interval or longer is dropped, since the
    server may have closed it with pings unanswered.
    """

    def __init__(self, address: str, config: TransferConfig) -> None:
        self.address = address
        self.config = config
        self._tls = tls_context(config)
        self._idle: list[WireChannel] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> WireChannel:
        """An idle channel that still works, or a new one (it connects on its first call)."""
        max_idle_s = self.config.keepalive_ms / 1000
        while True:
            with self._lock:
                if self._closed:
                    raise WireStatus(
                        grpc.StatusCode.CANCELLED, f"the client for peer {self.address} is closed"
                    )
                channel = self._idle.pop() if self._idle else None
            if channel is None:
                return WireChannel(
                    self.address, self.config, self._tls, self.config.max_message_bytes
                )
            if channel.usable(max_idle_s):
                return channel
            channel.close()

    def give(self, channel: WireChannel) -> None:
        with self._lock:
            if not channel.broken and not self._closed:
                self._idle.append(channel)
                return
        channel.close()

    def close(self) -> None:
        """Close the idle channels; calls under way close theirs when they end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for channel in idle:
            channel.close()


class FetchCall:
    """One FetchPages call on a channel of `pool`; `cancel` may come from any thread.

    Cancelling shuts the call's connection down (the server sees it close and
    releases the stream's pins) and keeps it out of the pool; a call that is
    over is not touched, so a channel already serving another call is safe.
    """

    __slots__ = ("_cancelled", "_channel", "_lock", "_pool")

    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._channel: WireChannel | None = None
        self._cancelled = False

    def run(self, request: pb.FetchRequest, end: float, sink: ChunkSink) -> None:
        """Make the call and feed every chunk to `sink`; returns on status OK, else raises."""
        channel = self._pool.take()
        with self._lock:
            if self._cancelled:
                self._pool.give(channel)
                raise WireStatus(grpc.StatusCode.CANCELLED, "cancelled by the client")
            self._channel = channel
        try:
            channel.call(request, end, sink)
        finally:
            with self._lock:
                self._channel = None
            self._pool.give(channel)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._channel is not None:
                self._channel.cancel()
