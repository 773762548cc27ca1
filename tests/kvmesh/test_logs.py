"""kvmesh's one logging configuration: text or JSON, request ids on records and on errors."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.errors import InvalidInput, InvalidSetting, KVMeshError, NoWorkers
from kvmesh.logs import (
    LogSettings,
    configure_logging,
    current_request_id,
    request_scope,
)

log = logging.getLogger("kvmesh.tests.logs")


@pytest.fixture()
def stream() -> Iterator[io.StringIO]:
    """kvmesh's logger writing into a string; put back as it was afterwards."""
    logger = logging.getLogger("kvmesh")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    out = io.StringIO()
    yield out
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_text_lines_show_the_request_id_inside_a_request_and_a_dash_outside(
    stream: io.StringIO,
) -> None:
    configure_logging(LogSettings("text", "INFO"), stream=stream)
    log.info("before")
    with request_scope("req-7"):
        log.info("serving")
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("INFO kvmesh.tests.logs [-] before")
    assert lines[1].endswith("INFO kvmesh.tests.logs [req-7] serving")


def test_json_lines_are_one_object_each_with_the_request_and_the_exception(
    stream: io.StringIO,
) -> None:
    configure_logging(LogSettings("json", "INFO"), stream=stream)
    with request_scope("req-8"):
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed %d", 3)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("level", "logger", "message", "request_id")} == {
        "level": "ERROR",
        "logger": "kvmesh.tests.logs",
        "message": "failed 3",
        "request_id": "req-8",
    }
    assert "ValueError: boom" in record["exception"]
    assert record["time"].endswith("+00:00")


def test_configuring_again_replaces_the_handler_instead_of_doubling_lines(
    stream: io.StringIO,
) -> None:
    configure_logging(LogSettings("text", "INFO"), stream=io.StringIO())
    configure_logging(LogSettings("json", "WARNING"), stream=stream)
    log.info("hidden below the level")
    log.warning("once")
    assert [json.loads(line)["message"] for line in stream.getvalue().splitlines()] == ["once"]


def test_the_environment_selects_format_and_level() -> None:
    env = {"KVMESH_LOG_FORMAT": "JSON", "KVMESH_LOG_LEVEL": "debug"}
    assert LogSettings.from_env(env) == LogSettings("json", "DEBUG")
    assert LogSettings.from_env({}) == LogSettings("text", "WARNING")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KVMESH_LOG_FORMAT": "xml"}, "KVMESH_LOG_FORMAT='xml'"),
        ({"KVMESH_LOG_LEVEL": "loud"}, "KVMESH_LOG_LEVEL='LOUD'"),
    ],
)
def test_a_bad_variable_is_refused_naming_it_and_the_choices(env: dict[str, str], named: str) -> None:
    with pytest.raises(InvalidSetting, match="choose one of") as bad:
        LogSettings.from_env(env)
    assert bad.value.setting == named


def test_an_error_leaving_a_request_carries_its_id_in_attribute_and_note() -> None:
    with pytest.raises(NoWorkers) as caught, request_scope("req-9"):
        raise NoWorkers("no worker serves role 'decode'")
    assert caught.value.request_id == "req-9"
    assert "kvmesh request id: req-9" in caught.value.__notes__
    assert str(caught.value) == "no worker serves role 'decode'"  # the message stays as it was


def test_the_innermost_request_tags_first_and_an_outer_scope_keeps_it() -> None:
    with pytest.raises(KVMeshError) as caught, request_scope("outer"), request_scope("inner"):
        raise InvalidInput("bad")
    assert caught.value.request_id == "inner"
    assert caught.value.__notes__ == ["kvmesh request id: inner"]


def test_other_errors_and_empty_ids_are_left_alone() -> None:
    with pytest.raises(ValueError) as caught, request_scope("req-10"):
        raise ValueError("not ours")
    assert not hasattr(caught.value, "request_id")
    with pytest.raises(InvalidInput) as untagged, request_scope(""):
        raise InvalidInput("no request")
    assert untagged.value.request_id is None
    assert current_request_id() is None


def test_the_request_id_survives_the_pickling_ray_sends_errors_with() -> None:
    err = InvalidInput("bad prompt").for_request("req-11")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.request_id, back.__notes__) == (
        InvalidInput,
        "req-11",
        ["kvmesh request id: req-11"],
    )


def test_requests_served_at_once_on_one_loop_keep_their_own_ids() -> None:
    seen: dict[str, list[str | None]] = {}

    async def serve(request_id: str) -> None:
        with request_scope(request_id):
            for _ in range(3):
                seen.setdefault(request_id, []).append(current_request_id())
                await asyncio.sleep(0)

    async def both() -> None:
        await asyncio.gather(serve("a"), serve("b"))

    asyncio.run(both())
    assert seen == {"a": ["a"] * 3, "b": ["b"] * 3}


def test_the_cli_refuses_a_bad_log_format_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stream: io.StringIO
) -> None:
    from kvmesh.app.cli import main

    monkeypatch.setenv("KVMESH_LOG_FORMAT", "xml")
    assert main(["config", "--table", "--output", "/dev/null"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvmesh config: error: KVMESH_LOG_FORMAT='xml': choose one of")


def test_the_gateway_logs_through_the_same_configuration_and_refuses_a_bad_level(
    capsys: pytest.CaptureFixture[str], stream: io.StringIO, tmp_path: Path
) -> None:
    from kvmesh.app.cli import main

    # refused while configuring its logs, before its tokenizer (none in tmp_path) is read
    flags = ["--engine", "http://127.0.0.1:8001", "--tokenizer", str(tmp_path)]
    assert main(["gateway", *flags, "--log-level", "loud"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvmesh gateway: error: log level 'LOUD': choose one of")


def test_records_still_reach_the_applications_own_handlers(
    stream: io.StringIO, caplog: pytest.LogCaptureFixture
) -> None:
    configure_logging(LogSettings("text", "WARNING"), stream=stream)
    with caplog.at_level(logging.WARNING):
        log.warning("seen by both")
    assert "seen by both" in stream.getvalue()
    assert [r.getMessage() for r in caplog.records] == ["seen by both"]


def test_without_a_stream_it_writes_to_stderr_as_it_is_now(
    stream: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure_logging(LogSettings("text", "WARNING"))
    later = io.StringIO()
    monkeypatch.setattr("sys.stderr", later)  # stderr replaced after configuring
    log.warning("to the stderr of now")
    assert "to the stderr of now" in later.getvalue()
