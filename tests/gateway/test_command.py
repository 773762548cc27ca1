"""`kvmesh gateway`'s flags: what they build, and one clear line for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.app.cli import build_parser, main
from kvmesh.engine_subscriber import EngineSubscriber
from kvmesh.gateway.command import build_gateway, describe
from kvmesh.gateway.routing import HistoryRouter, IndexRouter

ENGINES = ["--engine", "http://127.0.0.1:8001", "--engine", "http://127.0.0.1:8002"]
EVENTS = ["--events", "tcp://127.0.0.1:5557", "--events", "tcp://127.0.0.1:5567"]


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["gateway", *argv])


def test_flags_build_engines_in_order_with_their_event_sockets(tokenizer_dir: Path) -> None:
    args = parse(
        *ENGINES, *EVENTS, "--replay", "tcp://127.0.0.1:5558", "--replay", "tcp://127.0.0.1:5568",
        "--tokenizer", str(tokenizer_dir), "--block-size", "32", "--hash-seed", "7",
    )  # fmt: skip
    gateway = build_gateway(args)
    targets = gateway.config.engines
    assert [(t.name, t.url, t.events, t.replay) for t in targets] == [
        ("engine-0", "http://127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        ("engine-1", "http://127.0.0.1:8002", "tcp://127.0.0.1:5567", "tcp://127.0.0.1:5568"),
    ]
    assert isinstance(gateway.router, IndexRouter) and gateway.router.name == "kv_aware"
    assert len(gateway.sources) == 1  # one subscriber follows both engines
    assert gateway.verify is not None  # the hash-parity canary, when an engine is up
    assert (gateway.hasher.block_size, gateway.hasher.seed) == (32, "7")
    line = describe(gateway, "127.0.0.1", 8000)
    assert "engine-1=http://127.0.0.1:8002 (events tcp://127.0.0.1:5567)" in line
    assert "policy kv_aware" in line and "blocks of 32" in line


def test_events_connect_follows_engines_that_bind_so_replicas_can_share_them(
    tokenizer_dir: Path,
) -> None:
    """An engine publishing on ``tcp://*:PORT`` binds: every gateway replica connects to it.
    By default a tcp:// endpoint is bound here, which one gateway alone can do."""
    by_default = build_gateway(parse(*ENGINES, *EVENTS, "--tokenizer", str(tokenizer_dir)))
    subscriber = by_default.sources[0]
    assert isinstance(subscriber, EngineSubscriber)
    assert [s.bind for s in subscriber.endpoint("engine-0").streams()] == [True]
    args = parse(*ENGINES, *EVENTS, "--events-connect", "--tokenizer", str(tokenizer_dir))
    subscriber = build_gateway(args).sources[0]
    assert isinstance(subscriber, EngineSubscriber)
    for name in ("engine-0", "engine-1"):
        assert subscriber.endpoint(name).mode == "connect"
        assert [s.bind for s in subscriber.endpoint(name).streams()] == [False]


def test_approx_prefix_follows_no_events(tokenizer_dir: Path) -> None:
    args = parse(*ENGINES, *EVENTS, "--tokenizer", str(tokenizer_dir), "--policy", "approx_prefix")
    gateway = build_gateway(args)
    assert isinstance(gateway.router, HistoryRouter)
    assert gateway.sources == []
    assert gateway.verify is None


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--events", "tcp://127.0.0.1:5557"], "--events was given 1 times for 2 --engine"),
        (["--policy", "fastest"], "unknown routing policy 'fastest'"),
        (["--block-size", "0"], "argument --block-size: must be a positive integer"),
        (["--hash-algo", "md5"], "unknown engine hash algorithm 'md5'"),
        (["--hash-algo", "xxhash"], "PYTHONHASHSEED"),
        (["--host", "0.0.0.0"], "refusing to bind 0.0.0.0"),
        (["--request-timeout", "0"], "argument --request-timeout: must be a positive number"),
        (["--name", "a", "--name", "a"], "engine names must be unique"),
        (
            ["--events", "tcp://*:5557", "--events", "tcp://*:5567"],
            "give kvmesh its reachable address (tcp://HOST:PORT) with mode='connect' "
            "(kvmesh gateway: --events-connect)",
        ),
    ],
)
def test_bad_flags_are_one_clear_line_and_exit_2(
    tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    try:
        code = main(["gateway", *ENGINES, "--tokenizer", str(tokenizer_dir), *extra])
    except SystemExit as usage:  # a flag's range (kvmesh.arguments): argparse's usage line
        code = int(usage.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert words in err
    assert len(err.strip().splitlines()) == 1


def test_a_folder_without_a_tokenizer_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gateway", *ENGINES, "--tokenizer", str(tmp_path)]) == 2
    assert "no tokenizer at" in capsys.readouterr().err
