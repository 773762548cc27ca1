"""FetchPages read straight off the socket into the KV store, over reused HTTP/2 connections.

Why a reader of our own: grpcio hands every received message to Python as a
fresh ``bytes`` (two copies) and `h2` hands DATA payloads over after three
copies and a hex ``repr`` of every frame, then the page is copied once more
into the KV tensor; on a machine where sender and receiver share the cores
those copies are the bound (measured in the issue 14 note). This reader
speaks the same call to the same standard grpc server, hands the stream of
DATA bytes to `kvmesh.worker.chunk_reader` (which parses each ``PageChunk``'s
small fields as they arrive) and ``recv_into``'s the page bytes straight
into the destination the caller names: per byte, the kernel's copy and the
caller's checksum.

Scope, on purpose small: unary-stream calls, one at a time per connection
(`WireChannel`, kept for reuse by `kvmesh.worker.wire_pool`); plaintext or TLS
(ALPN ``h2``, mutual TLS), the bearer token, ``grpc-timeout`` and a socket
deadline; HTTP/2 flow control (windows opened wide, topped up as consumed;
the request sent within the server's frame size and windows), SETTINGS / PING
acknowledgements, padding, CONTINUATION, GOAWAY, RST_STREAM and gRPC status
trailers (with the server's ``kvmesh-error``). Header blocks are coded by
`hpack` (python-hyper). Failures raise `WireStatus` (a `grpc.RpcError`, so
callers translate and retry it as grpcio's): a lost connection is
``UNAVAILABLE``, the deadline ``DEADLINE_EXCEEDED``, `WireChannel.cancel`
``CANCELLED``; a connection that failed or was cancelled is never reused.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
import time
import urllib.parse

import grpc
import hpack

from kvmesh.config import TransferConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.worker import h2_frames as h2
from kvmesh.worker.chunk_reader import read_chunk_message
from kvmesh.worker.h2_frames import ChunkSink, WireStatus

READ_BUFFER_BYTES = 1 << 20
"""The largest frame payload other than DATA the reader takes (SETTINGS, headers, GOAWAY)."""
READ_AHEAD_BYTES = 8 * 1024
"""Bytes one ``recv`` for frame headers and small fields may take beyond what is needed.

Whatever page data the buffer takes is copied once more on its way to the
page; reading ahead a little covers a frame header, the message prefix and a
chunk's small fields in one ``recv`` while most page bytes bypass the buffer.
"""
WINDOW_TOP_UP = 1 << 30
"""Consumed DATA bytes after which both windows are topped up again."""


class WireChannel:
    """One HTTP/2 connection to a peer's transfer server, one FetchPages call at a time.

    Calls on it get stream ids 1, 3, 5, ...; the HPACK tables, the read buffer
    and the connection's flow-control windows carry over from call to call.
    A call that ends with any gRPC status leaves the connection reusable; one
    that fails below gRPC (socket error, deadline, bad framing, `cancel`)
    marks it `broken`, and it is closed.
    """

    def __init__(
        self,
        address: str,
        config: TransferConfig,
        tls: ssl.SSLContext | None,
        max_message_bytes: int,
    ) -> None:
        self.address = address
        self.config = config
        self._tls = tls
        self._max_message = max_message_bytes
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self.broken = False
        self.idle_since = time.monotonic()
        self._buf = bytearray(READ_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self._next_stream = 1
        self._conn_consumed = 0
        self._going_away = False
        self._end_time = 0.0
        # What the server accepts from us (the request message): RFC 9113 sections 4.2, 6.9
        self._send_frame = h2.DEFAULT_FRAME
        self._send_initial = h2.DEFAULT_WINDOW
        self._send_conn = h2.DEFAULT_WINDOW
        self._new_stream(0)

    def _new_stream(self, stream: int) -> None:
        """The per-call state, for `stream` (0: between calls)."""
        self._stream = stream
        self._frame_left = 0  # DATA payload bytes of the current frame not yet read
        self._pad_left = 0  # its padding, skipped after the payload
        self._frame_ends = False  # the current DATA frame carries END_STREAM
        self._ended = False
        self._stream_consumed = 0
        self._headers: list[tuple[str, str]] = []
        self._trailers: list[tuple[str, str]] | None = None
        self._send_stream = self._send_initial

    # ------------------------------------------------------------ lifecycle

    def cancel(self) -> None:
        """Abort the call from any thread: the connection is shut down (and never reused)."""
        with self._lock:
            self._cancelled = True
            self.broken = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing to abort
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            self.broken = True
        if sock is not None:
            sock.close()

    def fail(self, code: grpc.StatusCode, details: str) -> WireStatus:
        """The error a failed call raises; the connection is never reused after it."""
        self.broken = True
        if self._cancelled:
            return WireStatus(grpc.StatusCode.CANCELLED, "cancelled by the client")
        return WireStatus(code, details)

    def _connect(self, timeout: float) -> socket.socket:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        except TimeoutError:
            raise self.fail(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"connecting to {self.address} timed out"
            ) from None
        except (OSError, ValueError) as exc:
            raise self.fail(
                grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.address}: {exc}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            name = self.config.tls_server_name or host
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=name)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise self.fail(
                    grpc.StatusCode.UNAVAILABLE, f"TLS handshake with {self.address} failed: {exc}"
                ) from None
        return sock

    def _open(self, timeout: float) -> socket.socket:
        """Connect and send the connection preface: our SETTINGS and connection window."""
        sock = self._connect(timeout)
        with self._lock:
            if self._cancelled:
                sock.close()
                raise self.fail(grpc.StatusCode.CANCELLED, "cancelled")
            self._sock = sock
        settings = struct.pack(
            ">HIHIHI",
            h2.SETTINGS_ENABLE_PUSH,
            0,
            h2.SETTINGS_INITIAL_WINDOW_SIZE,
            h2.MAX_WINDOW,
            h2.SETTINGS_MAX_FRAME_SIZE,
            h2.MAX_FRAME,
        )
        increment = struct.pack(">I", h2.MAX_WINDOW - h2.DEFAULT_WINDOW)
        sock.sendall(
            h2.PREFACE
            + h2.frame(h2.SETTINGS, 0, 0, settings)
            + settings
            + h2.frame(h2.WINDOW_UPDATE, 0, 0, increment)
            + increment
        )
        return sock

    def usable(self, max_idle_s: float) -> bool:
        """Whether this idle connection can take another call: not broken or going away,
        used within `max_idle_s`, and what the server sent meanwhile (PINGs, SETTINGS,
        window updates) handled; a GOAWAY, a close or anything else makes it unusable."""
        sock = self._sock
        if self.broken or self._going_away or sock is None:
            return False
        if time.monotonic() - self.idle_since >= max_idle_s:
            return False
        try:
            while select.select([sock], [], [], 0)[0]:
                if self._start:
                    kept = self._end - self._start
                    self._view[:kept] = self._view[self._start : self._end]
                    self._start, self._end = 0, kept
                got = sock.recv_into(self._view[self._end :])
                if got == 0:
                    return False
                self._end += got
                while self._end - self._start >= 9:
                    length = int.from_bytes(self._view[self._start : self._start + 3], "big")
                    kind, flags = self._buf[self._start + 3], self._buf[self._start + 4]
                    if kind in (
                        h2.DATA,
                        h2.HEADERS,
                        h2.CONTINUATION,
                        h2.PUSH_PROMISE,
                        h2.GOAWAY,
                        h2.RST_STREAM,
                    ):
                        return False  # nothing a call between calls should see
                    if self._end - self._start < 9 + length:
                        break
                    _, kind, flags, stream = self._frame_header()
                    self._control(kind, flags, stream, self._payload(length))
        except (OSError, ssl.SSLError, WireStatus):
            return False
        return not self.broken and not self._going_away

    # ------------------------------------------------------------ the call

    def call(self, request: pb.FetchRequest, end: float, sink: ChunkSink) -> None:
        """Make one FetchPages call and feed every chunk to `sink`; returns on status OK,
        else raises (`WireStatus`); `end` is the deadline on the monotonic clock."""
        self._end_time = end
        try:
            sock = self._sock
            if sock is None:
                sock = self._open(self._remaining())
            if self._next_stream > h2.MAX_STREAM_ID:
                raise self.fail(grpc.StatusCode.UNAVAILABLE, "connection out of stream ids")
            self._new_stream(self._next_stream)
            self._next_stream += 2
            self._send_request(sock, request, self._remaining())
            while read_chunk_message(self, sink, self._max_message):
                pass
            self._finish()
        except TimeoutError:
            raise self.fail(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply from {self.address} in time"
            ) from None
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            raise self.fail(
                grpc.StatusCode.UNAVAILABLE, f"connection to {self.address} lost: {exc}"
            ) from None
        except WireStatus:
            raise
        except BaseException:
            self.broken = True  # e.g. the sink refused a page mid-message
            raise
        finally:
            self._new_stream(0)
            self.idle_since = time.monotonic()

    def _send_request(self, sock: socket.socket, request: pb.FetchRequest, timeout: float) -> None:
        headers = [
            (":method", "POST"),
            (":scheme", "https" if self._tls is not None else "http"),
            (":path", h2.FETCH_PATH),
            (":authority", self.config.tls_server_name or self.address),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
            ("user-agent", "kvmesh-wire"),
            ("grpc-timeout", h2.timeout_header(timeout)),
        ]
        if self.config.auth_token:
            headers.append(("authorization", f"Bearer {self.config.auth_token}"))
        block = self._encoder.encode(headers)
        body = request.SerializeToString()
        message = b"\x00" + struct.pack(">I", len(body)) + body
        stream = self._stream
        out = [h2.frame(h2.HEADERS, h2.END_HEADERS, stream, block), block]
        # The message goes in DATA frames no larger than the server accepts and within its
        # flow-control windows: a large request (hundreds of hashes) waits for its SETTINGS
        # and WINDOW_UPDATEs rather than break the connection (FRAME_SIZE_ERROR).
        pos = 0
        while pos < len(message):
            n = min(len(message) - pos, self._send_frame, self._send_conn, self._send_stream)
            if n <= 0:
                sock.sendall(b"".join(out))
                out = []
                self._await_window()
                if self._ended:  # the server answered without the rest (e.g. refused the call)
                    return
                continue
            part = message[pos : pos + n]
            pos += n
            self._send_conn -= n
            self._send_stream -= n
            out += (
                h2.frame(h2.DATA, h2.END_STREAM if pos == len(message) else 0, stream, part),
                part,
            )
        sock.sendall(b"".join(out))

    def _await_window(self) -> None:
        """Handle the server's frames until it lets us send more of the request."""
        while min(self._send_frame, self._send_conn, self._send_stream) <= 0 and not self._ended:
            length, kind, flags, stream = self._frame_header()
            if kind == h2.DATA:
                raise self.fail(grpc.StatusCode.INTERNAL, "DATA before the request was sent")
            self._control(kind, flags, stream, self._payload(length))

    def _finish(self) -> None:
        trailers = self._trailers if self._trailers is not None else self._headers
        status = dict(trailers).get("grpc-status")
        if status is None:
            raise self.fail(
                grpc.StatusCode.UNKNOWN,
                f"{self.address} ended FetchPages without a gRPC status "
                f"(HTTP status {dict(self._headers).get(':status', '?')})",
            )
        code = h2.STATUS_BY_VALUE.get(int(status), grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            details = urllib.parse.unquote(dict(trailers).get("grpc-message", ""))
            raise WireStatus(code, details, [(k, v) for k, v in trailers if not k.startswith(":")])

    # ------------------------------------------------------------ the DataStream of chunk_reader

    def read_bytes(self, n: int) -> bytes:
        """Exactly `n` DATA bytes inside a message (small fields: copied out of the buffer)."""
        if n <= self._frame_left and n <= self._end - self._start:  # the common case
            out = bytes(self._view[self._start : self._start + n])
            self._start += n
            self._frame_left -= n
            if self._frame_left == 0:
                self._skip(self._pad_left)
                self._pad_left = 0
                self._ended = self._ended or self._frame_ends
            return out
        slow = bytearray(n)
        self.read_into(memoryview(slow))
        return bytes(slow)

    def read_into(self, dst: memoryview, *, at_boundary: bool = False) -> bool:
        """Fill `dst` with the stream's DATA bytes; False if the stream ended first (only at
        a message boundary: elsewhere that is an error)."""
        pos, n = 0, len(dst)
        sock = self._sock
        while pos < n:
            if self._frame_left == 0 and not self._next_data_frame():
                if pos or not at_boundary:
                    raise self.fail(
                        grpc.StatusCode.INTERNAL,
                        f"{self.address} ended the stream inside a message",
                    )
                return False
            take = min(n - pos, self._frame_left)
            have = self._end - self._start
            if have:
                k = min(take, have)
                dst[pos : pos + k] = self._view[self._start : self._start + k]
                self._start += k
            else:  # straight from the socket into the destination
                if sock is None:
                    raise self.fail(grpc.StatusCode.CANCELLED, "cancelled")
                sock.settimeout(self._remaining())
                k = sock.recv_into(dst[pos : pos + take])
                if k == 0:
                    raise ConnectionResetError("the peer closed the connection")
            pos += k
            self._frame_left -= k
            if self._frame_left == 0:
                self._skip(self._pad_left)
                self._pad_left = 0
                if self._frame_ends:
                    self._ended = True
        return True

    # ------------------------------------------------------------ HTTP/2

    def _remaining(self) -> float:
        left = self._end_time - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def _fill(self, n: int) -> None:
        """At least `n` bytes in the read buffer."""
        if self._end - self._start >= n:
            return
        if n > READ_BUFFER_BYTES:
            raise self.fail(grpc.StatusCode.INTERNAL, f"a {n}-byte frame is over the read buffer")
        if self._start:
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        sock = self._sock
        if sock is None:
            raise self.fail(grpc.StatusCode.CANCELLED, "cancelled")
        while self._end - self._start < n:
            sock.settimeout(self._remaining())
            want = max(n - (self._end - self._start), READ_AHEAD_BYTES)
            got = sock.recv_into(self._view[self._end : self._end + want])
            if got == 0:
                raise ConnectionResetError("the peer closed the connection")
            self._end += got

    def _skip(self, n: int) -> None:
        while n:
            self._fill(1)
            k = min(n, self._end - self._start)
            self._start += k
            n -= k

    def _payload(self, n: int) -> bytes:
        self._fill(n)
        out = bytes(self._view[self._start : self._start + n])
        self._start += n
        return out

    def _frame_header(self) -> tuple[int, int, int, int]:
        """The next frame's (payload length, type, flags, stream id)."""
        self._fill(9)
        head = self._view[self._start : self._start + 9]
        self._start += 9
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        return int.from_bytes(head[:3], "big"), head[3], head[4], stream

    def _next_data_frame(self) -> bool:
        """Handle frames until a DATA frame with payload on our stream; False at its end."""
        while not self._ended:
            length, kind, flags, stream = self._frame_header()
            if kind == h2.DATA:
                pad = 0
                if flags & h2.PADDED:
                    pad = self._payload(1)[0]
                    length -= 1 + pad
                    if length < 0:
                        raise self.fail(grpc.StatusCode.INTERNAL, "DATA padding over its length")
                self._account(length + pad + (1 if flags & h2.PADDED else 0))
                if stream != self._stream:
                    raise self.fail(grpc.StatusCode.INTERNAL, f"DATA on unknown stream {stream}")
                self._frame_left, self._pad_left = length, pad
                self._frame_ends = bool(flags & h2.END_STREAM)
                if length:
                    return True
                self._skip(pad)
                self._pad_left = 0
                if self._frame_ends:
                    self._ended = True
                continue
            payload = self._payload(length)
            self._control(kind, flags, stream, payload)
        return False

    def _account(self, n: int) -> None:
        """Flow control: give the server back what it sent, in large steps."""
        self._conn_consumed += n
        self._stream_consumed += n
        out = b""
        if self._conn_consumed >= WINDOW_TOP_UP:
            inc = struct.pack(">I", self._conn_consumed)
            self._conn_consumed = 0
            out += h2.frame(h2.WINDOW_UPDATE, 0, 0, inc) + inc
        if self._stream_consumed >= WINDOW_TOP_UP:
            inc = struct.pack(">I", self._stream_consumed)
            self._stream_consumed = 0
            out += h2.frame(h2.WINDOW_UPDATE, 0, self._stream, inc) + inc
        if out and self._sock is not None:
            self._sock.sendall(out)

    def _control(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise self.fail(grpc.StatusCode.CANCELLED, "cancelled")
        if kind == h2.SETTINGS and not flags & h2.ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == h2.SETTINGS_INITIAL_WINDOW_SIZE:
                    self._send_stream += value - self._send_initial
                    self._send_initial = value
                elif key == h2.SETTINGS_MAX_FRAME_SIZE:
                    self._send_frame = value
            sock.sendall(h2.frame(h2.SETTINGS, h2.ACK, 0))
        elif kind == h2.WINDOW_UPDATE and len(payload) >= 4:
            inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if stream == 0:
                self._send_conn += inc
            elif stream == self._stream:
                self._send_stream += inc
        elif kind == h2.PING and not flags & h2.ACK:
            sock.sendall(h2.frame(h2.PING, h2.ACK, 0, payload) + payload)
        elif kind == h2.HEADERS:
            self._header_block(flags, stream, payload)
        elif kind == h2.RST_STREAM and stream == self._stream and stream:
            code = int.from_bytes(payload[:4], "big") if len(payload) >= 4 else 0
            raise self.fail(
                grpc.StatusCode.CANCELLED if code == 8 else grpc.StatusCode.UNAVAILABLE,
                f"{self.address} reset the stream (HTTP/2 error {code})",
            )
        elif kind == h2.GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF if len(payload) >= 4 else 0
            self._going_away = True  # no new call on this connection
            if last < self._stream:
                raise self.fail(grpc.StatusCode.UNAVAILABLE, f"{self.address} is going away")
        elif kind == h2.PUSH_PROMISE:
            raise self.fail(grpc.StatusCode.INTERNAL, "server push was refused in SETTINGS")
        # PRIORITY, unknown types: nothing to do for a reader

    def _header_block(self, flags: int, stream: int, payload: bytes) -> None:
        if flags & h2.PADDED:
            pad = payload[0]
            payload = payload[1 : len(payload) - pad]
        if flags & h2.PRIORITY_FLAG:
            payload = payload[5:]
        block = payload
        while not flags & h2.END_HEADERS:  # CONTINUATION frames follow directly
            self._fill(9)
            head = bytes(self._view[self._start : self._start + 9])
            self._start += 9
            if head[3] != h2.CONTINUATION:
                raise self.fail(grpc.StatusCode.INTERNAL, "header block without CONTINUATION")
            flags = (flags & h2.END_STREAM) | head[4]
            block += self._payload(int.from_bytes(head[:3], "big"))
        try:
            fields = [(str(k), str(v)) for k, v in self._decoder.decode(block)]
        except hpack.HPACKError as exc:
            raise self.fail(grpc.StatusCode.INTERNAL, f"bad header block: {exc}") from None
        if stream != self._stream or not stream:
            return
        if not self._headers:
            self._headers = fields
            if dict(fields).get(":status", "200") != "200":
                raise self.fail(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.address} answered HTTP {dict(fields).get(':status')}",
                )
        else:
            self._trailers = fields
        if flags & h2.END_STREAM:
            self._ended = True
