"""The coordinator's gRPC routing API on loopback, over a real `Coordinator` (no Ray)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from api_kit import Loop, Served
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.client.routing_client import RoutingClient
from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.grpc_api import SERVICE_NAME, CoordinatorAPIServer, LocalBackend
from kvmesh.coordinator.policies import WorkerLoad
from kvmesh.coordinator.service import Coordinator
from kvmesh.coordinator.shards import ShardedCoordinator
from kvmesh.errors import (
    ConfigError,
    DeadlineExceeded,
    EventDecodeError,
    InvalidInput,
    NoWorkers,
    TransportError,
    Unauthenticated,
    UnknownWorker,
)
from kvmesh.events import PagesStored, encode_batch, make_batch
from kvmesh.hashing import PageHasher
from kvmesh.types import PageHash, WorkerId

TOKEN = "routing-token"
HASHER = PageHasher(4)


def prompt(n: int, tag: int) -> list[PageHash]:
    return HASHER.hash_prompt([tag * 1000 + i for i in range(n * 4)])


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def populated(core: Any) -> Any:
    for i in range(3):
        wid = WorkerId(f"w{i}")
        core.register_worker(WorkerRegistration(wid, f"10.0.0.{i}:5000", 100, "inc"))
        events = [PagesStored(tuple(prompt(4 + i, 7)), None, (), 4)]
        core.report(WorkerReport(wid, [encode_batch(make_batch(events, wid, "inc", 0))]))
    return core


@pytest.fixture
def served(loop: Loop) -> Iterator[Served]:
    s = Served(loop, populated(Coordinator(clock=lambda: 0.0)), TransferConfig(auth_token=TOKEN))
    yield s
    s.stop()


def state(core: Coordinator) -> tuple[Any, ...]:
    """What a call could change: the registry and the index."""
    return (
        [(i.worker_id, i.address, i.incarnation, i.load, i.draining) for i in core.workers()],
        core.snapshot_index(),
    )


def test_route_answers_the_coordinators_decision_with_the_workers_addresses(
    served: Served,
) -> None:
    with RoutingClient(served.address, TransferConfig(auth_token=TOKEN)) as client:
        got = client.route(
            RouteQuery(prompt(6, 7), 24, page_size=4, allow_pull=True, request_id="r1")
        )
    want = served.core.route(
        RouteQuery(prompt(6, 7), 24, page_size=4, allow_pull=True, request_id="r1")
    )
    assert (got.worker_id, got.matched_pages, got.peer_worker_id, got.peer_pages) == (
        want.worker_id,
        want.local_pages,
        want.peer_id,
        want.peer_pages,
    )
    assert got.worker_address == f"10.0.0.{got.worker_id[-1]}:5000"
    assert got.router == served.address


def test_register_report_and_stats_reach_the_index(served: Served) -> None:
    with RoutingClient(served.address, TransferConfig(auth_token=TOKEN)) as client:
        assert (
            client.register(WorkerRegistration("engine-a", "http://engine-a:8000", 500, "boot-1"))
            is True
        )
        stored = [PagesStored(tuple(prompt(9, 3)), None, (), 4)]
        batch = make_batch(stored, WorkerId("engine-a"), "boot-1", 0)
        resync, results = client.report(
            WorkerReport(
                "engine-a", [encode_batch(batch)], WorkerLoad(WorkerId("engine-a"), 64, 0, 400, 500)
            )
        )
        assert (resync, results) == (False, ["applied"])
        assert served.core.match(prompt(9, 3)).pages["engine-a"] == 9
        assert served.core.registry_info(WorkerId("engine-a")).load.active_prefill_tokens == 64
        assert client.stats()["workers"] == 4.0
        assert client.health().serving


def test_a_missing_or_wrong_token_is_refused_and_changes_nothing(served: Served) -> None:
    before = state(served.core)
    for security in (TransferConfig(), TransferConfig(auth_token="not-the-token")):
        with RoutingClient(served.address, security) as client:
            with pytest.raises(Unauthenticated, match="bearer token"):
                client.route(RouteQuery(prompt(3, 7), 12, page_size=4))
            with pytest.raises(Unauthenticated):
                client.register(WorkerRegistration("intruder", "x:1", 10, "i"))
            with pytest.raises(Unauthenticated):
                client.stats()
    assert state(served.core) == before
    assert served.core.stats().routes == 0


def test_health_probes_need_no_token(served: Served) -> None:
    with grpc.insecure_channel(served.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_bad_requests_get_the_kvmesh_error_and_change_nothing(served: Served) -> None:
    before = state(served.core)
    with RoutingClient(served.address, TransferConfig(auth_token=TOKEN)) as client:
        with pytest.raises(InvalidInput, match="1-64 bytes"):
            client.route(RouteQuery([PageHash(b"x" * 65)], 16))
        with pytest.raises(InvalidInput, match="role"):
            client.route(RouteQuery(prompt(2, 7), 8, role="janitor"))
        with pytest.raises(InvalidInput, match="unknown policy"):
            client.route(RouteQuery(prompt(2, 7), 8, policy="fastest"))
        with pytest.raises(UnknownWorker):
            client.report(WorkerReport("nobody", []))
        with pytest.raises(EventDecodeError):
            client.report(WorkerReport("w0", [b"\x93garbage"]))
        with pytest.raises(InvalidInput, match="worker_id"):
            client.register(WorkerRegistration("", "a:1", 1, "i"))
    assert state(served.core) == before


def test_no_workers_travels_as_unavailable_and_the_client_raises_no_workers(loop: Loop) -> None:
    s = Served(loop, Coordinator(), TransferConfig())
    try:
        with RoutingClient(s.address) as client, pytest.raises(NoWorkers):
            client.route(RouteQuery(prompt(2, 1), 8))
    finally:
        s.stop()


class SlowBackend(LocalBackend):
    async def stats(self) -> dict[str, Any]:
        await asyncio.sleep(5)
        return {}


def test_a_call_past_the_servers_deadline_is_deadline_exceeded(loop: Loop) -> None:
    server = CoordinatorAPIServer(
        SlowBackend(Coordinator()), CoordinatorConfig(api_port=0, api_deadline_s=0.2)
    )
    port = loop.run(server.start())
    try:
        with RoutingClient(f"127.0.0.1:{port}") as client, pytest.raises(DeadlineExceeded):
            client.stats()
    finally:
        loop.run(server.stop(0))


def test_the_client_fails_over_to_the_next_router(served: Served) -> None:
    dead = "127.0.0.1:1"  # nothing listens there
    with RoutingClient([dead, served.address], TransferConfig(auth_token=TOKEN)) as client:
        got = client.route(RouteQuery(prompt(4, 7), 16, page_size=4))
        assert got.router == served.address
    with RoutingClient([dead], TransferConfig(), deadline_s=1) as c, pytest.raises(TransportError):
        c.stats()


def test_a_sharded_coordinator_serves_the_same_api(loop: Loop) -> None:
    core = populated(ShardedCoordinator(CoordinatorConfig(index_shards=3), clock=lambda: 0.0))
    s = Served(loop, core, TransferConfig())
    try:
        with RoutingClient(s.address) as client:
            got = client.route(RouteQuery(prompt(6, 7), 24, page_size=4))
            assert (got.worker_id, got.matched_pages) == ("w2", 6)
            assert client.health().shards == 3
    finally:
        s.stop()


def test_a_client_refuses_an_empty_address_list() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        RoutingClient([])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from(["Route", "Register", "Report", "Stats", "Health"]),
    body=st.binary(max_size=300),
)
def test_fuzzed_messages_change_nothing(served: Served, method: str, body: bytes) -> None:
    """Arbitrary bytes for every method: an answer or a clean error, and the index unchanged.

    (Register is the one call meant to change the registry: bytes that parse
    as a complete registration may add a worker, so only its refusals are
    checked to change nothing.)
    """
    before = state(served.core)
    with grpc.insecure_channel(served.address) as ch:
        call = ch.unary_unary(f"/{SERVICE_NAME}/{method}")
        try:
            call(body, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
            refused = False
        except grpc.RpcError as err:
            assert err.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.UNAVAILABLE,
            ), err
            refused = True
    if method != "Register" or refused:
        after = state(served.core)
        if method == "Report":  # a Report may carry a load for a known worker
            assert after[1] == before[1]
        else:
            assert after == before


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "router")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "router.pem", folder / "router.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_mutual_tls_serves_a_client_with_a_certificate_and_refuses_plaintext(
    loop: Loop, tmp_path: Path
) -> None:
    cert, key = _self_signed(tmp_path)
    tls = TransferConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=str(cert), auth_token=TOKEN)
    s = Served(loop, populated(Coordinator(clock=lambda: 0.0)), tls)
    try:
        with RoutingClient(s.address, tls) as client:
            assert client.route(RouteQuery(prompt(4, 7), 16, page_size=4)).matched_pages == 4
        plain = TransferConfig(auth_token=TOKEN)
        no_cert = TransferConfig(tls_root_ca=str(cert), auth_token=TOKEN)
        for security in (plain, no_cert):
            with (
                RoutingClient(s.address, security, deadline_s=2) as c,
                pytest.raises(TransportError),
            ):
                c.stats()
    finally:
        s.stop()


def test_the_dev_profile_keeps_the_routing_api_on_loopback_unless_remote_is_allowed() -> None:
    from kvmesh.config import ClusterConfig, SecurityConfig
    from kvmesh.security import check_cluster

    remote = CoordinatorConfig(api_port=7070, api_host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0"):
        check_cluster(ClusterConfig(coordinator=remote), env={})
    check_cluster(
        ClusterConfig(coordinator=remote, security=SecurityConfig(allow_remote=True)), env={}
    )
    check_cluster(ClusterConfig(coordinator=CoordinatorConfig(api_port=7070)), env={})
