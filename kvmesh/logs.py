"""One logging configuration for every kvmesh process, as text or JSON, with request ids.

`configure_logging` installs one handler on the ``kvmesh`` logger (every
module logs under it: ``kvmesh.worker.actor``, ``kvmesh.coordinator...``),
replacing the one it installed before, so the CLI, the gateway and the Ray
actors log the same way. `LogSettings.from_env` reads ``KVMESH_LOG_FORMAT``
(``text``, the default, or ``json``: one object per line, for a log
shipper) and ``KVMESH_LOG_LEVEL`` (default ``WARNING``); a bad value is an
`InvalidSetting` naming the variable, which the CLI prints as one line.

Request ids. A request's id is made once, by the client (`KVMesh.generate`),
and travels with it: the coordinator's ``route(request_id=...)``, the
worker's ``GenerateRequest.request_id``. Each of them serves the request
inside `request_scope`, which puts the id on every log record made meanwhile
(``request_id``; ``-`` outside a request) and on every `KVMeshError` that
leaves the scope (`KVMeshError.request_id`, and a note that tracebacks
print), so a failure seen by the caller can be found in every process's
log. The id lives in a `contextvars.ContextVar`: per thread and per
asyncio task, never shared by two requests served at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from kvmesh.errors import InvalidSetting, KVMeshError

LOG_FORMATS: tuple[str, ...] = ("text", "json")
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT_VARIABLE = "KVMESH_LOG_FORMAT"
LEVEL_VARIABLE = "KVMESH_LOG_LEVEL"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
NO_REQUEST = "-"

_request_id: ContextVar[str | None] = ContextVar("kvmesh_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request this thread or task is serving now (None: none)."""
    return _request_id.get()


@contextlib.contextmanager
def request_scope(request_id: str | None) -> Iterator[None]:
    """Serve one request: its id is on every log record made inside and on every
    `KVMeshError` that leaves (see the module docstring). An empty id changes nothing."""
    if not request_id:
        yield
        return
    token = _request_id.set(request_id)
    try:
        yield
    except KVMeshError as exc:
        exc.for_request(request_id)
        raise
    finally:
        _request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every record as ``request_id`` (``-`` outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = current_request_id() or NO_REQUEST
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, request_id,
    process, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "process": record.process,
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class LogSettings:
    """How kvmesh logs: `format` one of `LOG_FORMATS`, `level` one of `LOG_LEVELS`."""

    format: str = "text"
    level: str = "WARNING"  # quiet unless asked, as Python's own default

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise InvalidSetting(
                f"log format {self.format!r}", f"choose one of {', '.join(LOG_FORMATS)}"
            )
        if self.level not in LOG_LEVELS:
            raise InvalidSetting(
                f"log level {self.level!r}", f"choose one of {', '.join(LOG_LEVELS)}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LogSettings:
        """``KVMESH_LOG_FORMAT`` and ``KVMESH_LOG_LEVEL`` of `env` (default: this process's);
        a bad value is an `InvalidSetting` naming the variable."""
        env = os.environ if env is None else env
        fmt = env.get(FORMAT_VARIABLE, "text").strip().lower() or "text"
        level = env.get(LEVEL_VARIABLE, "WARNING").strip().upper() or "WARNING"
        if fmt not in LOG_FORMATS:
            raise InvalidSetting(f"{FORMAT_VARIABLE}={fmt!r}", f"choose one of {LOG_FORMATS}")
        if level not in LOG_LEVELS:
            raise InvalidSetting(f"{LEVEL_VARIABLE}={level!r}", f"choose one of {LOG_LEVELS}")
        return cls(fmt, level)


class _KVMeshHandler(logging.StreamHandler):
    """The handler `configure_logging` installs (recognised to be replaced, never doubled).

    Without a stream of its own it writes to ``sys.stderr`` as it is at each record, as
    Python's last-resort handler does, so a replaced stderr (a test's capture, a daemon's
    redirect) never leaves it writing to a closed file.
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream or sys.stderr)
        self._follows_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follows_stderr:
            self.stream = sys.stderr
        super().emit(record)


def configure_logging(
    settings: LogSettings | None = None, *, stream: IO[str] | None = None
) -> logging.Handler:
    """Log kvmesh's records to `stream` (default: stderr) as `settings` say (default: from
    the environment). Replaces a handler this function installed before. Records still
    propagate, as any library's do: an application that configures the root logger
    itself needs no call here (or sees them twice). Returns the handler."""
    settings = settings or LogSettings.from_env()
    logger = logging.getLogger("kvmesh")
    for old in [h for h in logger.handlers if isinstance(h, _KVMeshHandler)]:
        logger.removeHandler(old)
    handler = _KVMeshHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        JsonFormatter() if settings.format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logger.addHandler(handler)
    logger.setLevel(settings.level)
    return handler


__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "LogSettings",
    "RequestIdFilter",
    "configure_logging",
    "current_request_id",
    "request_scope",
]
