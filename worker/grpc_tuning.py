"""gRPC channel and server arguments of a `TransferConfig`, and the opt-in allocator tuning.

The same HTTP/2 and TCP arguments go to servers and clients alike
(`grpc_tuning_options`; 0 leaves gRPC's default), impossible values are
refused before anything starts. What each setting measured on the benchmark
machine is in docs/ and the issue notes, not here.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError

log = logging.getLogger(__name__)


MIN_FRAME_BYTES = 16 * 1024
MAX_FRAME_BYTES = 16 * 1024 * 1024 - 1
"""HTTP/2's bounds on SETTINGS_MAX_FRAME_SIZE (RFC 9113 section 6.5.2)."""

GRPC_TUNING: dict[str, str] = {
    "grpc_frame_bytes": "grpc.http2.max_frame_size",
    "grpc_window_bytes": "grpc.http2.lookahead_bytes",
    "grpc_write_buffer_bytes": "grpc.http2.write_buffer_size",
    "grpc_read_chunk_bytes": "grpc.experimental.tcp_read_chunk_size",
    "grpc_min_read_chunk_bytes": "grpc.experimental.tcp_min_read_chunk_size",
    "grpc_max_read_chunk_bytes": "grpc.experimental.tcp_max_read_chunk_size",
    "grpc_socket_buffer_bytes": "grpc.tcp_receive_buffer_size",
}
"""`TransferConfig` field -> the gRPC channel argument it sets (0 leaves gRPC's default)."""


def grpc_tuning_options(config: TransferConfig) -> list[tuple[str, int]]:
    """The HTTP/2 and TCP channel arguments of `config`, for servers and clients alike.

    Raises `ConfigError` for a negative size or a frame size HTTP/2 does not allow.
    """
    out: list[tuple[str, int]] = []
    for field, arg in GRPC_TUNING.items():
        value = getattr(config, field)
        if value < 0:
            raise ConfigError(
                f"TransferConfig.{field} must be >= 0 (0: gRPC's default), got {value}"
            )
        if value:
            out.append((arg, value))
    frame = config.grpc_frame_bytes
    if frame and not MIN_FRAME_BYTES <= frame <= MAX_FRAME_BYTES:
        raise ConfigError(
            f"TransferConfig.grpc_frame_bytes must be 0 or {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES} "
            f"(HTTP/2's frame size bounds), got {frame}"
        )
    if not config.grpc_bdp_probe:
        out.append(("grpc.http2.bdp_probe", 0))
    return out


MALLOC_TUNING: dict[int, int] = {
    -1: 32 * 1024 * 1024,  # M_TRIM_THRESHOLD: free memory kept at a heap's top before trimming
    -2: 8 * 1024 * 1024,  # M_TOP_PAD: extra bytes asked for whenever a heap grows
    -3: 32 * 1024 * 1024,  # M_MMAP_THRESHOLD: blocks below this come from the heaps, not mmap
}
"""glibc `mallopt` parameter -> value that `tune_malloc` sets."""

_malloc_tuned = False


def tune_malloc(config: TransferConfig) -> bool:
    """Apply `MALLOC_TUNING` to this process when `config.grpc_malloc_tune`; True if in force.

    Why: every message gRPC receives or sends is a fresh multi-MiB buffer
    (gRPC's read slices, the joined message, our encoded chunk). glibc trims
    freed memory at the top of a heap back to the kernel, so the next buffer
    is page-faulted and zeroed again: 60k-150k minor faults and 0.2-0.3 s of
    CPU per GiB received, mostly in gRPC's reads. Keeping it mapped removes
    that (measured: ~0.8 instead of 1.0-1.1 s of receiver CPU per GiB, +15-20%
    GB/s). It is process-wide (each heap keeps up to the trim threshold of
    freed memory), hence opt-in; the same as starting the process with
    ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` / ``MALLOC_MMAP_THRESHOLD_``.
    Not glibc (no ``mallopt``): nothing is changed and False is returned.
    """
    global _malloc_tuned
    if not config.grpc_malloc_tune:
        return _malloc_tuned
    if _malloc_tuned:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.warning("grpc_malloc_tune: this C library has no mallopt; left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in MALLOC_TUNING.items())
    _malloc_tuned = ok
    if not ok:
        log.warning("grpc_malloc_tune: mallopt refused a setting; the allocator is partly tuned")
    return ok


def _both_ends(config: TransferConfig) -> list[tuple[str, Any]]:
    """Message bounds and keepalive, the same for servers and clients."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(config: TransferConfig) -> list[tuple[str, Any]]:
    """The transfer server's arguments: `_both_ends`, `grpc_tuning_options`."""
    return [
        *_both_ends(config),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1, config.keepalive_ms // 2)),
        ("grpc.so_reuseport", 0),
        *grpc_tuning_options(config),
    ]


def channel_options(config: TransferConfig) -> list[tuple[str, Any]]:
    """A client channel's arguments: `_both_ends`, gRPC's own retries off (the client's
    `RetryPolicy` is the one policy), `grpc_tuning_options`, the TLS name override."""
    options = [*_both_ends(config), ("grpc.enable_retries", 0), *grpc_tuning_options(config)]
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return options
