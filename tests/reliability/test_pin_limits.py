"""FetchPages cannot hold a worker's pages hostage: pins are bounded in number and in time.

Real parts in one process: a `WorkerActor` (pool, KV store, model; no
coordinator) that caches prompts and answers requests, and real
`TransferServer`s on 127.0.0.1 in front of its page service, each with the
limits a test is about. The attacker is a raw grpcio client that sends
``FetchPages`` and never reads; its channel announces a small HTTP/2 window
(64 KiB, no BDP growth), so a stream stalls a few pages in, with the server's
write waiting on flow control, as it would for any client that stops reading.

Several tests set ``fetch_window_pages=1``: a stalled stream then holds
exactly one pin (the page whose write waits), so the caps are reached at a
known stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes as crypto_hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client import REGISTRY
from reliability_kit import in_process_worker, reference_model, wait_until

from kvmesh.config import ClusterConfig, PoolConfig, TransferConfig
from kvmesh.errors import InvalidSetting, InvariantViolation, PinLimitExceeded
from kvmesh.hashing import PageHasher
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.requests import GenerateRequest, WorkerSpec
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.fetch_limits import PinBudget, fetch_limits
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

pytestmark = pytest.mark.timeout(180)

BASE = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=64))
PAGE = BASE.hash.page_size
USABLE = BASE.pool.num_pages - 1  # page 0 is the null page
QUIET = TransferConfig(fetch_idle_timeout_s=60.0, fetch_stream_timeout_s=120.0)
"""Limits that do not fire during a test unless it lowers them."""
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 64 * 1024), ("grpc.http2.bdp_probe", 0)]
FETCH = "/kvmesh.v1.KVWorker/FetchPages"

_rng = random.Random(12)


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def owner() -> Iterator[WorkerActor]:
    with in_process_worker(WorkerSpec(WorkerId("owner"), BASE)) as worker:
        yield worker


@pytest.fixture(scope="module")
def model() -> Any:
    return reference_model(BASE.model)


def prompt(pages: int) -> tuple[int, ...]:
    return tuple(_rng.randrange(BASE.model.vocab_size) for _ in range(pages * PAGE + 3))


def fill(owner: WorkerActor, prompts: int = 3, pages: int = 18) -> list[PageHash]:
    """Cache `prompts` fresh prompts on `owner`; the hashes of their pages it now holds."""
    out: list[PageHash] = []
    for _ in range(prompts):
        tokens = prompt(pages)
        owner.generate(GenerateRequest(f"fill-{_rng.random()}", tokens, 1))
        out.extend(owner.hasher.hash_prompt(tokens))
    return [h for h, held in zip(out, owner.pages.lookup(out), strict=True) if held]


def pinned(service: PageService) -> int:
    """Page references held on `service`'s pool (the worker holds none while idle)."""
    return sum(service.ref_counts())


def stalled_with(service: PageService, pins: int, timeout_s: float = 10.0) -> bool:
    """Whether the pins on `service` settle at `pins`: the same count for 0.2 s (a running
    stream with a one-page window drops to 0 between pages, a stalled one does not)."""
    end = time.monotonic() + timeout_s
    steady = 0
    while time.monotonic() < end:
        steady = steady + 1 if pinned(service) == pins else 0
        if steady >= 20:
            return True
        time.sleep(0.01)
    return False


def rotated(hashes: Sequence[PageHash], k: int, repeat: int = 20) -> list[PageHash]:
    """`hashes` from position k on, wrapping, `repeat` times: streams that stall on
    different pages."""
    k %= len(hashes)
    return [*hashes[k:], *hashes[:k]] * repeat


def refused(worker: str, reason: str) -> float:
    labels = {"worker": worker, "reason": reason}
    return REGISTRY.get_sample_value("kvmesh_transfer_refused_total", labels) or 0.0


def pinned_gauge(worker: str) -> float | None:
    return REGISTRY.get_sample_value("kvmesh_fetch_pinned_pages", {"worker": worker})


@contextlib.contextmanager
def serving(service: PageService, config: TransferConfig) -> Iterator[ServerThread]:
    server = ServerThread(service, config)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Attacker:
    """A client that asks for pages and never reads them (one channel, many streams)."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None):
        if credentials is None:
            self.channel = grpc.insecure_channel(address, options=SMALL_WINDOW)
        else:
            self.channel = grpc.secure_channel(address, credentials, options=SMALL_WINDOW)
        self._fetch = self.channel.unary_stream(
            FETCH,
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=None,
        )
        self.calls: list[Any] = []

    def fetch(self, page_hashes: Sequence[PageHash], timeout_s: float = 60.0) -> Any:
        call = self._fetch(pb.FetchRequest(page_hashes=page_hashes), timeout=timeout_s)
        self.calls.append(call)
        return call

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self.channel.close()


@contextlib.contextmanager
def attacker(
    address: str, credentials: grpc.ChannelCredentials | None = None
) -> Iterator[Attacker]:
    client = Attacker(address, credentials)
    try:
        yield client
    finally:
        client.close()


@dataclasses.dataclass(frozen=True)
class Outcome:
    messages: int
    code: grpc.StatusCode
    details: str
    error: str | None  # the kvmesh error class the server named


def read_to_end(call: Any) -> Outcome:
    """Read a stream to its end (what a late reader finds): messages and final status."""
    n = 0
    try:
        for _ in call:
            n += 1
    except grpc.RpcError:
        pass
    error = next((v for k, v in call.trailing_metadata() or () if k == "kvmesh-error"), None)
    return Outcome(n, call.code(), call.details() or "", error)


def request_succeeds(owner: WorkerActor, model: Any, pages: int) -> None:
    """A fresh request of `pages` full pages is answered, and right."""
    tokens = prompt(pages)
    result = owner.generate(GenerateRequest(f"victim-{_rng.random()}", tokens, 3))
    assert result.pages_computed == pages + 1
    assert list(result.tokens) == model.generate(list(tokens), 3)


# ---------------------------------------------------------------- time limits


def test_a_stream_that_is_never_read_pins_at_most_one_window_and_requests_get_pages(
    owner: WorkerActor, model: Any
) -> None:
    cached = fill(owner)
    assert len(cached) >= 50
    config = dataclasses.replace(QUIET, fetch_window_pages=8)
    with serving(owner.pages, config) as server, attacker(server.address) as bad:
        bad.fetch(cached * 50)
        assert wait_until(lambda: pinned(owner.pages) > 0, 10)
        # It stalls on flow control within a few pages, holding its window.
        assert max(pinned(owner.pages) for _ in range(200)) <= 8
        # Today's bug: every cached page stayed pinned and this failed with
        # PoolExhausted ("0 of 63 are free") until the attacker left.
        request_succeeds(owner, model, pages=USABLE - 8 - 2)
        assert pinned(owner.pages) <= 8
    assert wait_until(lambda: pinned(owner.pages) == 0, 10)


def test_a_stream_that_is_never_read_is_ended_by_the_idle_timeout_and_releases_its_pins(
    owner: WorkerActor, model: Any
) -> None:
    cached = fill(owner)
    config = dataclasses.replace(QUIET, fetch_idle_timeout_s=1.0)
    with serving(owner.pages, config) as server, attacker(server.address) as bad:
        before = refused(server.server.name, "fetch_idle")
        call = bad.fetch(cached * 50)
        assert wait_until(lambda: pinned(owner.pages) > 0, 10)
        request_succeeds(owner, model, pages=20)
        # The client still never read.
        assert wait_until(lambda: refused(server.server.name, "fetch_idle") == before + 1, 15)
        assert pinned(owner.pages) == 0
        assert pinned_gauge(server.server.name) == 0
        late = read_to_end(call)
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.error == "DeadlineExceeded"
    assert "fetch_idle_timeout_s" in late.details
    assert 0 < late.messages < len(cached) * 50


@pytest.mark.parametrize("reader", ["never", "slowly"])
def test_a_stream_read_slowly_or_never_is_ended_by_the_server_deadline(
    owner: WorkerActor, reader: str
) -> None:
    cached = fill(owner)
    config = dataclasses.replace(QUIET, fetch_stream_timeout_s=1.0)
    with serving(owner.pages, config) as server, attacker(server.address) as bad:
        before = refused(server.server.name, "fetch_deadline")
        # The client's own deadline is far away: only the server's can end the stream.
        call = bad.fetch(cached * 50, timeout_s=30.0)
        if reader == "slowly":
            outcome: list[Outcome] = []

            def read_slowly() -> None:
                try:
                    for _ in call:
                        time.sleep(0.01)
                except grpc.RpcError:
                    pass
                outcome.append(read_to_end(call))

            thread = threading.Thread(target=read_slowly, daemon=True)
            thread.start()
            thread.join(25)
            assert outcome, "the stream was not ended by the server"
            late = outcome[0]
        else:
            assert wait_until(lambda: pinned(owner.pages) > 0, 10)
            name = server.server.name
            assert wait_until(lambda: refused(name, "fetch_deadline") == before + 1, 15)
            assert pinned(owner.pages) == 0
            late = read_to_end(call)
        assert refused(server.server.name, "fetch_deadline") == before + 1
    assert pinned(owner.pages) == 0
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.error == "DeadlineExceeded"
    assert "fetch_stream_timeout_s" in late.details


def test_stopping_the_server_releases_the_pins_of_streams_nobody_reads(
    owner: WorkerActor,
) -> None:
    cached = fill(owner)
    server = ServerThread(owner.pages, QUIET)
    server.start()
    try:
        with attacker(server.address) as bad:
            for k in range(3):
                bad.fetch(rotated(cached, 7 * k))
            assert wait_until(lambda: pinned(owner.pages) >= 3, 10)
            server.stop(grace_s=0.2)
            assert wait_until(lambda: pinned(owner.pages) == 0, 10)
    finally:
        server.stop()


class FailingExport:
    """A real `PageService` whose `export` fails from the `fail_at`-th call on."""

    def __init__(self, service: PageService, fail_at: int) -> None:
        self._service = service
        self._fail_at = fail_at
        self.exports = 0

    def export(self, page_id: Any) -> Any:
        self.exports += 1
        if self.exports >= self._fail_at:
            raise InvariantViolation(f"page {page_id} cannot be exported (test)")
        return self._service.export(page_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)


def test_an_error_mid_stream_is_sent_as_its_kvmesh_error_and_releases_the_pins(
    owner: WorkerActor,
) -> None:
    cached = fill(owner)
    failing = FailingExport(owner.pages, fail_at=3)
    config = dataclasses.replace(QUIET, retries=0)
    with (
        serving(failing, config) as server,  # type: ignore[arg-type]
        SyncPeerClient(server.address, config) as client,
        pytest.raises(InvariantViolation, match="cannot be exported"),
    ):
        client.fetch_pages(cached[:10], streams=1)
    assert wait_until(lambda: pinned(owner.pages) == 0, 10)


# ---------------------------------------------------------------- caps


def test_fetch_pins_never_take_more_than_their_share_of_the_pool_so_requests_get_pages(
    owner: WorkerActor, model: Any
) -> None:
    cached = fill(owner)
    config = dataclasses.replace(
        QUIET,
        fetch_window_pages=1,
        fetch_pin_fraction=0.5,
        fetch_peer_pin_fraction=0.9,  # one peer on loopback: the global cap binds first
        fetch_pin_wait_s=0.3,
    )
    cap = fetch_limits(config, BASE.pool.num_pages).total_pins
    assert cap == USABLE // 2
    with serving(owner.pages, config) as server, attacker(server.address) as bad:
        before = refused(server.server.name, "pin_cap")
        for k in range(cap):
            bad.fetch(rotated(cached, k))
            assert stalled_with(owner.pages, k + 1), pinned(owner.pages)
        over = read_to_end(bad.fetch(rotated(cached, cap), timeout_s=20.0))
        assert over.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert over.error == "PinLimitExceeded"
        assert "fetch_pin_fraction" in over.details and "fetch_pin_wait_s" in over.details
        assert refused(server.server.name, "pin_cap") == before + 1
        assert pinned_gauge(server.server.name) == cap
        held = sum(1 for c in owner.pages.ref_counts() if c)
        assert held <= cap
        # The rest of the pool is there for requests, cached pages evicted as needed.
        request_succeeds(owner, model, pages=USABLE - cap - 2)
        assert pinned(owner.pages) == cap
    assert wait_until(lambda: pinned(owner.pages) == 0, 10)


@dataclasses.dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path

    def credentials(self, ca: Path) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            ca.read_bytes(), self.key.read_bytes(), self.cert.read_bytes()
        )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(folder: Path, names: Sequence[str]) -> tuple[Path, dict[str, Issued]]:
    """A throwaway CA and a certificate per name (the server's, "server", for 127.0.0.1)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pin-limits-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, crypto_hashes.SHA256())
    )
    ca_path = folder / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    issued: dict[str, Issued] = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if name == "server":
            loopback = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            builder = builder.add_extension(x509.SubjectAlternativeName([loopback]), critical=False)
        cert = builder.sign(ca_key, crypto_hashes.SHA256())
        issued[name] = Issued(folder / f"{name}.pem", folder / f"{name}.key")
        issued[name].cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued[name].key.write_bytes(_pem_key(key))
    return ca_path, issued


def test_a_peer_over_its_pin_cap_is_refused_while_another_peer_pulls(
    owner: WorkerActor, tmp_path: Path
) -> None:
    cached = fill(owner)
    ca, certs = make_pki(tmp_path, ["server", "attacker", "worker-b"])
    config = dataclasses.replace(
        QUIET,
        tls_cert=str(certs["server"].cert),
        tls_key=str(certs["server"].key),
        tls_ca=str(ca),  # mutual TLS: a peer is its certificate
        fetch_window_pages=1,
        fetch_peer_pin_fraction=0.05,
        fetch_pin_wait_s=0.3,
    )
    cap = fetch_limits(config, BASE.pool.num_pages).peer_pins
    assert cap == 3

    def client_config(name: str) -> TransferConfig:
        return TransferConfig(
            deadline_s=30.0,
            retries=0,
            tls_root_ca=str(ca),
            tls_cert=str(certs[name].cert),
            tls_key=str(certs[name].key),
        )

    with (
        serving(owner.pages, config) as server,
        attacker(server.address, certs["attacker"].credentials(ca)) as bad,
    ):
        before = refused(server.server.name, "pin_cap")
        for k in range(cap):
            bad.fetch(rotated(cached, 5 * k))
            assert stalled_with(owner.pages, k + 1), pinned(owner.pages)
        over = read_to_end(bad.fetch(rotated(cached, 17), timeout_s=20.0))
        assert over.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert over.error == "PinLimitExceeded"
        assert "cert:attacker" in over.details and "fetch_peer_pin_fraction" in over.details
        assert refused(server.server.name, "pin_cap") == before + 1
        # kvmesh's own client raises the server's error, so a pull computes instead.
        with (
            SyncPeerClient(server.address, client_config("attacker")) as same_peer,
            pytest.raises(PinLimitExceeded, match="fetch_peer_pin_fraction"),
        ):
            same_peer.fetch_pages(cached[:4])
        # Another peer is not held back by the attacker's streams.
        wanted = cached[:12]
        with SyncPeerClient(server.address, client_config("worker-b")) as client:
            result = client.fetch_pages(wanted)
        assert [p.page_hash for p in result.pages] == wanted
        assert pinned(owner.pages) == cap
    assert wait_until(lambda: pinned(owner.pages) == 0, 10)


# ---------------------------------------------------------------- normal clients


PULLERS = {kind: TransferConfig() for kind in ("a", "b", "c")}
"""Three workers pulling at once (one fetch engine; 2 streams each)."""


@pytest.fixture(scope="module")
def pullers() -> Iterator[dict[str, WorkerActor]]:
    with contextlib.ExitStack() as stack:
        made: dict[str, WorkerActor] = {}
        for kind, transfer in PULLERS.items():
            transfer = dataclasses.replace(transfer, fetch_streams=2, deadline_s=60.0)
            config = dataclasses.replace(BASE, transfer=transfer)
            spec = WorkerSpec(WorkerId(f"puller-{kind}"), config)
            made[kind] = stack.enter_context(in_process_worker(spec))
        yield made


def test_pulls_of_several_workers_at_once_share_tight_caps_and_all_succeed(
    owner: WorkerActor, pullers: dict[str, WorkerActor], model: Any
) -> None:
    pages = 12
    config = dataclasses.replace(
        QUIET, fetch_window_pages=2, fetch_peer_pin_fraction=0.07, fetch_pin_wait_s=30.0
    )
    assert fetch_limits(config, BASE.pool.num_pages).peer_pins == 4  # 3 pullers x 2 streams
    prompts = {kind: prompt(pages) for kind in pullers}
    for kind, tokens in prompts.items():
        owner.generate(GenerateRequest(f"own-{kind}", tokens, 1))
        assert owner.pages.prefix_length(owner.hasher.hash_prompt(tokens)) == pages
    results: dict[str, Any] = {}
    with serving(owner.pages, config) as server:
        before = refused(server.server.name, "pin_cap")

        def pull(kind: str) -> None:
            request = GenerateRequest(
                f"pull-{kind}",
                prompts[kind],
                3,
                promised_pull=pages,
                peer_address=server.address,
            )
            results[kind] = pullers[kind].generate(request)

        threads = [threading.Thread(target=pull, args=(kind,)) for kind in pullers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert refused(server.server.name, "pin_cap") == before
    for kind, result in results.items():
        assert (kind, result.pull_error, result.pages_pulled) == (kind, None, pages)
        assert list(result.tokens) == model.generate(list(prompts[kind]), 3)
    assert len(results) == len(pullers)
    assert pinned(owner.pages) == 0


# ---------------------------------------------------------------- the parts


def test_a_fetched_prefix_is_released_head_last_as_a_request_would_be() -> None:
    pool = PagePool(32, page_size=PAGE)
    service = PageService(pool, KVStore(32, 1, 1, 8, PAGE), PageHasher(PAGE))
    tokens = list(range(12 * PAGE))
    keys = service.hasher.hash_prompt(tokens)
    pages = pool.get_new_pages(len(keys))
    pool.cache_full_pages(pages, keys, 0, len(keys), tokens)
    pool.free_pages(pages)  # head first: the head would be evicted first
    config = dataclasses.replace(QUIET, fetch_window_pages=4)
    with serving(service, config) as server, SyncPeerClient(server.address) as client:
        assert len(client.fetch_pages(keys, streams=1).pages) == len(keys)
    order = [p.page_hash for p in pool.free_queue.get_all_free_pages() if p.page_hash]
    assert order == list(reversed(keys))  # evicted tail first
    assert pinned(service) == 0


def test_the_pin_budget_grants_what_fits_under_both_caps() -> None:
    budget = PinBudget(total=10, per_peer=6)
    assert budget.take("a", 4) == 4
    assert budget.take("a", 4) == 2  # a's cap
    assert budget.take("a", 1) == 0
    assert budget.take("b", 8) == 4  # the total's rest
    assert budget.take("c", 1) == 0
    budget.give("a", 3)
    assert (budget.held, budget.held_by("a"), budget.held_by("b")) == (7, 3, 4)
    assert budget.take("c", 5) == 3
    with pytest.raises(InvariantViolation):
        budget.give("b", 5)  # more than b holds


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fetch_stream_timeout_s", 0.0),
        ("fetch_idle_timeout_s", -1.0),
        ("fetch_window_pages", 0),
        ("fetch_pin_fraction", 1.0),
        ("fetch_peer_pin_fraction", 0.0),
        ("fetch_peer_pin_fraction", 1.5),
        ("fetch_pin_wait_s", -0.5),
    ],
)
def test_impossible_fetch_limits_are_refused_naming_the_setting(field: str, value: Any) -> None:
    with pytest.raises(InvalidSetting, match=f"TransferConfig.{field}"):
        dataclasses.replace(TransferConfig(), **{field: value})


def test_the_caps_are_shares_of_the_usable_pages_and_never_zero() -> None:
    config = TransferConfig(fetch_pin_fraction=0.5, fetch_peer_pin_fraction=0.25)
    limits = fetch_limits(config, 513)
    assert (limits.total_pins, limits.peer_pins) == (256, 128)
    assert (fetch_limits(config, 2).total_pins, fetch_limits(config, 2).peer_pins) == (1, 1)
