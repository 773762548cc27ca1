"""The errors kvmesh raises.

Every failure a caller can act on is a `KVMeshError` subclass that carries a
message saying what to do and maps to exactly one gRPC status code (kept as a
string name so that the shared base never imports grpc). Expected outcomes
(a cache miss, a full pool in `allocate_slots`) are typed results instead.
"""

from __future__ import annotations

from typing import ClassVar


class KVMeshError(Exception):
    """Base of every kvmesh error; `grpc_code` is the status it travels as.

    `request_id`: the request it failed (None: no request), set as it leaves the
    request's scope (`kvmesh.logs.request_scope`) so the caller can find that
    request in every process's log; it survives Ray's pickling (instance state).
    """

    grpc_code: ClassVar[str] = "INTERNAL"
    request_id: str | None = None

    def for_request(self, request_id: str) -> KVMeshError:
        """Tag this error with the request it failed (the first tag wins); returns it."""
        if self.request_id is None:
            self.request_id = request_id
            self.add_note(f"kvmesh request id: {request_id}")
        return self


class ConfigError(KVMeshError):
    """A configuration value or CLI flag is invalid."""

    grpc_code = "INVALID_ARGUMENT"


class InvalidSetting(ConfigError):
    """One setting has a bad value. `setting` is the name the user set it by (a variable,
    a flag or a field, with the value), `fields` the config fields (``TransferConfig.port``)
    the refusal is about, `reason` what is wrong, so a loader can name its own source."""

    def __init__(self, setting: str, reason: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(f"{setting}: {reason}")
        self.setting = setting
        self.reason = reason
        self.fields = fields

    def __reduce__(self) -> tuple[type[InvalidSetting], tuple[str, str, tuple[str, ...]]]:
        # Ray sends errors between processes by pickling: rebuild from all three parts.
        return (type(self), (self.setting, self.reason, self.fields))


class DeviceUnavailable(ConfigError):
    """The device a worker was configured for (``KVMESH_DEVICE``) is not in its process: a
    GPU asked for where none is visible. Refused before anything is allocated."""

    grpc_code = "FAILED_PRECONDITION"


class InvalidInput(KVMeshError):
    """An argument has the wrong type, range or size."""

    grpc_code = "INVALID_ARGUMENT"


class PageFormatError(InvalidInput):
    """A page's bytes, dtype or shape do not match the receiving KV store."""


class HashMismatch(InvalidInput):
    """A page's token ids do not hash to the page hash it claims."""


class ChecksumMismatch(KVMeshError):
    """A page's bytes do not match their checksum (corrupted in transit)."""

    grpc_code = "DATA_LOSS"


class DiskPageCorrupt(ChecksumMismatch):
    """A page file of the disk tier is corrupted or truncated; it is deleted, never served.

    `reason`: "corrupt" or "truncated" (the label it is counted under)."""

    def __init__(self, message: str, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


class EventDecodeError(InvalidInput):
    """A KV event batch could not be decoded or has fields of the wrong type."""


class UnknownHash(KVMeshError):
    """A page hash is not held where it was asked for."""

    grpc_code = "NOT_FOUND"


class PoolExhausted(KVMeshError):
    """The page pool cannot hold the pages asked for, even after eviction."""

    grpc_code = "RESOURCE_EXHAUSTED"


class PagesInUse(KVMeshError):
    """An operation that needs idle pages (e.g. a prefix-cache reset) met held ones."""

    grpc_code = "FAILED_PRECONDITION"


class InvariantViolation(KVMeshError):
    """Internal state broke an invariant; the message carries the bad state."""

    grpc_code = "INTERNAL"


class UnknownWorker(KVMeshError):
    """A worker id is not registered with the coordinator."""

    grpc_code = "NOT_FOUND"


class StaleWorker(KVMeshError):
    """A worker's events have a gap; it must resend a full snapshot."""

    grpc_code = "FAILED_PRECONDITION"


class NoWorkers(KVMeshError):
    """No worker is available to serve a request."""

    grpc_code = "UNAVAILABLE"


class TransportError(KVMeshError):
    """A peer could not be reached or broke off a transfer."""

    grpc_code = "UNAVAILABLE"


class ArenaUnavailable(KVMeshError):
    """A store's shared-memory arena cannot be used from here (another host, a store that
    restarted, a staging lease another client took): pages move over gRPC instead."""

    grpc_code = "FAILED_PRECONDITION"


class DeadlineExceeded(TransportError):
    """A remote call did not finish within its deadline."""

    grpc_code = "DEADLINE_EXCEEDED"


class MessageTooLarge(TransportError):
    """A message exceeded a peer's size limit (max_message_bytes / chunk_bytes disagree)."""

    grpc_code = "RESOURCE_EXHAUSTED"


class PinLimitExceeded(TransportError):
    """A peer's transfers already hold the pinned pages their cap allows; retry later."""

    grpc_code = "RESOURCE_EXHAUSTED"


class WorkerDied(TransportError):
    """The worker serving a request died before answering."""


class RequestCancelled(KVMeshError):
    """The caller gave up on a request (cancelled it, or its process went away); the worker
    stopped its work at the next prefill chunk or decode step and released its pages."""

    grpc_code = "CANCELLED"


class RequestExpired(RequestCancelled):
    """A request's deadline passed before its answer was ready (waiting for a compute slot
    or computing); the worker stopped it as if cancelled. Raise `request_timeout_s` for
    longer answers, or send fewer requests at once."""

    grpc_code = "DEADLINE_EXCEEDED"


class Unauthenticated(KVMeshError):
    """A call carried no credentials or wrong ones."""

    grpc_code = "UNAUTHENTICATED"


class PermissionDenied(KVMeshError):
    """The caller is authenticated but may not do this (e.g. another tenant's pages)."""

    grpc_code = "PERMISSION_DENIED"


class UnknownModel(InvalidInput):
    """A request names a model the engines behind the gateway do not serve."""

    grpc_code = "NOT_FOUND"


class HashParityError(KVMeshError):
    """kvmesh hashes a prompt differently from an engine (algorithm, seed, block size or hash
    form differ): the engine's events would never match, so it gets no cache affinity."""

    grpc_code = "FAILED_PRECONDITION"


class ClusterUnreachable(KVMeshError):
    """No kvmesh cluster answers where the caller looked (an address, ``RAY_ADDRESS``, or
    the one `kvmesh start` recorded): nothing was started in its place."""

    grpc_code = "UNAVAILABLE"


class ClusterAlreadyRunning(KVMeshError):
    """`kvmesh start` found a kvmesh cluster already running in its namespace."""

    grpc_code = "ALREADY_EXISTS"


class MovedAPI(KVMeshError):
    """A call kvmesh offers elsewhere now; the message names the one to use instead (a
    clear break, not a silent one, where keeping the old spelling would tie layers)."""

    grpc_code = "UNIMPLEMENTED"
