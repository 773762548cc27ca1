"""TLS, mutual TLS and bearer-token checks shared by every kvmesh gRPC server.

The worker's page service (`kvmesh.worker.transfer_server`) and the
coordinator's routing API (`kvmesh.coordinator.grpc_api`) serve with the same
credentials and the same token, read from `TransferConfig` (the cluster's one
security section), so the two components meet here, in the base, instead of
importing each other.

A `KVMeshError` travels as its ``grpc_code`` with the class name in the
``kvmesh-error`` trailing metadata (`ERROR_METADATA_KEY`), so a client raises
the same class (`error_from_rpc`).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    ChecksumMismatch,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    KVMeshError,
    MessageTooLarge,
    TransportError,
    Unauthenticated,
    UnknownHash,
)

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
ERROR_METADATA_KEY = "kvmesh-error"


def read_pem(path: str | None, what: str) -> bytes | None:
    """The bytes of a certificate / key file named in config (None: not set)."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path!r}: {exc.strerror}") from None


def client_tls_material(config: TransferConfig) -> tuple[bytes | None, bytes | None, bytes | None]:
    """(root CA, client key, client certificate) for dialing peers; all None: plaintext.

    TLS is on when any of tls_root_ca, tls_ca or tls_cert is set; the client
    presents tls_cert/tls_key (mutual TLS) when both are set.
    """
    root = read_pem(config.tls_root_ca or config.tls_ca, "TLS root CA")
    if root is None and config.tls_cert is None:
        return None, None, None
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("a client certificate needs both tls_cert and tls_key")
    return root, read_pem(config.tls_key, "TLS key"), read_pem(config.tls_cert, "TLS certificate")


def server_credentials(config: TransferConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from `config` (None: plaintext); mutual TLS when `tls_ca` is set."""
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_ca is not None:
            raise ConfigError("tls_ca (mutual TLS) needs tls_cert and tls_key for the server too")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ConfigError("TLS needs both tls_cert and tls_key")
    cert = read_pem(config.tls_cert, "TLS certificate")
    key = read_pem(config.tls_key, "TLS key")
    ca = read_pem(config.tls_ca, "TLS client CA")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(config: TransferConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for dialing a kvmesh server (`client_tls_material`), or None: plaintext."""
    root, key, cert = client_tls_material(config)
    if root is None and cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=root, private_key=key, certificate_chain=cert
    )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose ``authorization`` metadata is not ``Bearer <token>``.

    The health service is exempt: load-balancer and Kubernetes probes carry no
    token, and health says nothing about the cache. Comparison is constant-time.
    """

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_METHOD_PREFIX,)):
        if not token:
            raise ConfigError("auth_token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self._exempt):
            return handler
        got = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(got, self._expected):
            return handler
        reason = "no bearer token" if not got else "wrong bearer token"
        return _deny(
            handler, f"{reason} for {method}: set TransferConfig.auth_token to the cluster's token"
        )


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            message,
            trailing_metadata=((ERROR_METADATA_KEY, "Unauthenticated"),),
        )

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


def _all_errors(cls: type[KVMeshError]) -> dict[str, type[KVMeshError]]:
    out = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        out.update(_all_errors(sub))
    return out


STATUS_ERRORS: dict[grpc.StatusCode, type[KVMeshError]] = {
    grpc.StatusCode.UNAVAILABLE: TransportError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DATA_LOSS: ChecksumMismatch,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.NOT_FOUND: UnknownHash,
}
"""A gRPC status without kvmesh metadata (transport-level failures) -> the error raised."""


def error_from_rpc(err: grpc.RpcError, what: str, address: str) -> KVMeshError:
    """The kvmesh error for a failed call: the server's class if it sent one, else by status.

    The class named in ``kvmesh-error`` is trusted only when its status code
    agrees, so a server cannot make a client raise an arbitrary class.
    """
    code: grpc.StatusCode = err.code()
    details: str = err.details() or ""
    name = None
    for key, value in err.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY:
            name = value if isinstance(value, str) else bytes(value).decode(errors="replace")
    cls = _all_errors(KVMeshError).get(name or "")
    if cls is None or cls.grpc_code != code.name:
        cls = STATUS_ERRORS.get(code, TransportError)
    return cls(f"{what} to {address} failed ({code.name}): {details}")
