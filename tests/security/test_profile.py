"""The production profile refuses weak setups; the dev profile binds loopback only.

The last tests start real gRPC servers from configs the profile accepted and
show that what it accepted really refuses plaintext, tokenless and foreign
clients, so that passing the check means something on the wire.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.config import (
    ClusterConfig,
    HashConfig,
    SecurityConfig,
    TransferConfig,
    from_env,
)
from kvmesh.errors import ConfigError, TransportError, Unauthenticated
from kvmesh.hashing import PageHasher
from kvmesh.security import PROFILES, check_bind_address, check_cluster, check_profile, is_loopback
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

TOKEN = "t0k3n-of-the-cluster-32-chars-xx"
RAY_ON = {"RAY_AUTH_MODE": "token"}


# -------------------------------------------------------------- certificates


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_ca(folder: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{name}-ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def issue(
    folder: Path, ca: tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate], cn: str
) -> tuple[Path, Path]:
    _, ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{cn}.pem", folder / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("profile-pki")
    ca = make_ca(folder, "cluster")
    other = make_ca(folder, "intruder")
    server_cert, server_key = issue(folder, ca, "worker")
    client_cert, client_key = issue(folder, ca, "peer")
    foreign_cert, foreign_key = issue(folder, other, "stranger")
    return {
        "ca": str(ca[0]),
        "server_cert": str(server_cert),
        "server_key": str(server_key),
        "client_cert": str(client_cert),
        "client_key": str(client_key),
        "foreign_cert": str(foreign_cert),
        "foreign_key": str(foreign_key),
    }


def production_transfer(pki: dict[str, str], **changes: object) -> TransferConfig:
    cfg = TransferConfig(
        host="127.0.0.1",
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        tls_ca=pki["ca"],
        auth_token=TOKEN,
        deadline_s=5.0,
        retries=0,
    )
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def refusal(profile: str, transfer: TransferConfig, env: dict[str, str], **kw: object) -> str:
    with pytest.raises(ConfigError) as err:
        check_profile(profile, transfer, env, **kw)  # type: ignore[arg-type]
    return str(err.value)


# ------------------------------------------------------------------ production


def test_production_accepts_ray_token_auth_mutual_tls_and_a_bearer_token(
    pki: dict[str, str],
) -> None:
    check_profile("production", production_transfer(pki), RAY_ON)
    check_profile("production", production_transfer(pki), {"RAY_AUTH_MODE": " Token "})


@pytest.mark.parametrize("mode", [None, "disabled", "", "tokens"])
def test_production_refuses_without_ray_token_authentication(
    pki: dict[str, str], mode: str | None
) -> None:
    env = {} if mode is None else {"RAY_AUTH_MODE": mode}
    message = refusal("production", production_transfer(pki), env)
    assert "RAY_AUTH_MODE=token" in message
    assert "TLS" not in message and "bearer" not in message  # only what is missing


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"tls_cert": None}, ["KVMESH_TLS_CERT"]),
        ({"tls_key": None}, ["KVMESH_TLS_KEY"]),
        ({"tls_cert": None, "tls_key": None, "tls_ca": None}, ["KVMESH_TLS_CERT", "KVMESH_TLS_CA"]),
        ({"tls_ca": None}, ["KVMESH_TLS_CA"]),
        ({"tls_cert": "/nonexistent/cert.pem"}, ["/nonexistent/cert.pem"]),
    ],
)
def test_production_refuses_without_tls_and_names_what_to_set(
    pki: dict[str, str], changes: dict[str, object], names: list[str]
) -> None:
    message = refusal("production", production_transfer(pki, **changes), RAY_ON)
    for name in names:
        assert name in message


def test_server_only_tls_is_accepted_only_when_mutual_tls_is_waived(pki: dict[str, str]) -> None:
    server_only = production_transfer(pki, tls_ca=None)
    assert "require_mtls" in refusal("production", server_only, RAY_ON)
    check_profile("production", server_only, RAY_ON, require_mtls=False)


@pytest.mark.parametrize("token", [None, "", "short-token"])
def test_production_refuses_without_a_strong_bearer_token(
    pki: dict[str, str], token: str | None
) -> None:
    message = refusal("production", production_transfer(pki, auth_token=token), RAY_ON)
    assert "KVMESH_AUTH_TOKEN" in message and "16" in message


def test_every_missing_piece_is_listed_in_one_refusal() -> None:
    message = refusal("production", TransferConfig(), {})
    for name in ("RAY_AUTH_MODE", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA"):
        assert name in message
    assert "KVMESH_AUTH_TOKEN" in message


def test_production_refuses_the_default_seed_and_a_fast_hash(pki: dict[str, str]) -> None:
    transfer = production_transfer(pki)
    assert "HashConfig.seed" in refusal("production", transfer, RAY_ON, hashing=HashConfig())
    weak = HashConfig(seed="s3cret-cluster-seed", algo="xxh3_128")
    assert "sha256" in refusal("production", transfer, RAY_ON, hashing=weak)
    check_profile("production", transfer, RAY_ON, hashing=HashConfig(seed="s3cret-cluster-seed"))


def test_production_refuses_the_unauthenticated_dist_transport(pki: dict[str, str]) -> None:
    message = refusal("production", production_transfer(pki, transport="dist"), RAY_ON)
    assert "KVMESH_TRANSPORT=grpc" in message
    assert "TLS certificate" not in message  # only what is wrong


def test_production_binds_wherever_it_is_told(pki: dict[str, str]) -> None:
    check_profile("production", production_transfer(pki, host="0.0.0.0"), RAY_ON)


def test_the_cluster_check_reads_the_security_section(pki: dict[str, str]) -> None:
    cfg = ClusterConfig(
        hash=HashConfig(seed="per-cluster-secret"),
        transfer=production_transfer(pki),
        security=SecurityConfig(profile="production"),
    )
    check_cluster(cfg, RAY_ON)
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE"):
        check_cluster(cfg, {})
    with pytest.raises(ConfigError, match=r"HashConfig\.seed"):
        check_cluster(dataclasses.replace(cfg, hash=HashConfig()), RAY_ON)


def test_the_profile_can_be_chosen_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_PROFILE", "production")
    monkeypatch.setenv("KVMESH_ALLOW_REMOTE", "1")
    sec = from_env(SecurityConfig)
    assert (sec.profile, sec.allow_remote, sec.require_mtls) == ("production", True, True)


def test_an_unknown_profile_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"dev.*production"):
        check_profile("prod", TransferConfig(), {})
    assert set(PROFILES) == {"dev", "production"}


# ------------------------------------------------------------------------ dev


def test_dev_is_the_default_and_allows_plaintext_on_loopback() -> None:
    assert SecurityConfig().profile == "dev" and not SecurityConfig().allow_remote
    assert TransferConfig().host == "127.0.0.1"
    check_profile("dev", TransferConfig(), {})
    check_cluster(ClusterConfig(), {})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.0.2.10", "example.com", "10.0.0.1"])
def test_dev_refuses_non_loopback_binds_unless_allowed(host: str) -> None:
    with pytest.raises(ConfigError, match="KVMESH_ALLOW_REMOTE"):
        check_profile("dev", TransferConfig(host=host), {})
    check_profile("dev", TransferConfig(host=host), {}, allow_remote=True)
    with pytest.raises(ConfigError):
        check_bind_address(host, allow_remote=False)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_addresses_are_always_allowed(host: str) -> None:
    assert is_loopback(host)
    check_bind_address(host, allow_remote=False)


def test_the_default_worker_server_is_unreachable_from_other_interfaces() -> None:
    service = PageService(PagePool(4, page_size=4), KVStore(4, 1, 1, 4, 4), PageHasher(4))
    with ServerThread(service) as server:
        port = server.server.port
        assert server.address == f"127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:  # the address this host uses towards other hosts (no packet is sent)
            probe.connect(("192.0.2.1", 9))
            outward = probe.getsockname()[0]
        except OSError:
            outward = "127.0.0.1"
        finally:
            probe.close()
        if is_loopback(outward):
            pytest.skip("this machine has no non-loopback IPv4 address")
        with pytest.raises(OSError):
            socket.create_connection((outward, port), timeout=2).close()


# ----------------------------------------------- what the profile accepted, on the wire


@pytest.fixture(scope="module")
def production_server(pki: dict[str, str]) -> Iterator[tuple[ServerThread, list[bytes]]]:
    service = PageService(PagePool(8, page_size=4), KVStore(8, 1, 1, 4, 4), PageHasher(4))
    hashes = service.hasher.hash_prompt(list(range(8)))
    pages = service.pool.get_new_pages(2)
    service.pool.cache_full_pages(pages, hashes, 0, 2, list(range(8)))
    service.pool.free_pages(pages)
    cfg = production_transfer(pki)
    check_profile("production", cfg, RAY_ON)
    server = ServerThread(service, cfg)
    server.start()
    try:
        yield server, list(hashes)
    finally:
        server.stop()


def _client(pki: dict[str, str], **changes: object) -> TransferConfig:
    base = production_transfer(
        pki, tls_cert=pki["client_cert"], tls_key=pki["client_key"], tls_root_ca=pki["ca"]
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_an_accepted_production_config_serves_a_cluster_peer(
    pki: dict[str, str], production_server: tuple[ServerThread, list[bytes]]
) -> None:
    server, hashes = production_server
    with SyncPeerClient(server.address, _client(pki)) as client:
        assert client.lookup(hashes) == [True, True]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("who", "changes", "error"),
    [
        ("no token", {"auth_token": None}, Unauthenticated),
        ("wrong token", {"auth_token": "x" * 32}, Unauthenticated),
        ("no client certificate", {"tls_cert": None, "tls_key": None}, TransportError),
        ("a foreign certificate", {"tls_cert": "foreign_cert", "tls_key": "foreign_key"}, None),
    ],
)
def test_an_accepted_production_config_refuses_outsiders(
    pki: dict[str, str],
    production_server: tuple[ServerThread, list[bytes]],
    who: str,
    changes: dict[str, object],
    error: type[Exception] | None,
) -> None:
    server, hashes = production_server
    changes = {k: pki.get(v, v) if isinstance(v, str) else v for k, v in changes.items()}
    with (
        SyncPeerClient(server.address, _client(pki, **changes)) as client,
        pytest.raises(error or TransportError),
    ):
        client.lookup(hashes, deadline_s=3.0)  # type: ignore[arg-type]


def test_an_accepted_production_config_refuses_plaintext(
    production_server: tuple[ServerThread, list[bytes]],
) -> None:
    server, _ = production_server
    channel = grpc.insecure_channel(server.address)
    try:
        call = channel.unary_unary("/kvmesh.v1.KVWorker/Lookup")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=3, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        channel.close()


# ------------------------------------------ the production profile from the Python API

# Ray reads RAY_AUTH_MODE once per process, so the production cluster runs in its own.
PRODUCTION_DRIVER = """
import json, sys
from kvmesh.app import connect
from kvmesh.config import TransferConfig
from kvmesh.errors import TransportError
from kvmesh.worker.transfer_client import SyncPeerClient

tls = TransferConfig(**json.loads(sys.argv[1]))
plaintext = TransferConfig(auth_token=tls.auth_token, deadline_s=3.0, retries=0)
with connect(worker_num_cpus=0.5) as mesh:  # no config: the environment's settings
    tokens = list(range(40))
    out = {"profile": mesh.config.security.profile}
    out["answer"] = len(mesh.generate(tokens, max_tokens=1).tokens)
    hashes = mesh.hashes(tokens)
    address = mesh.workers()[0]["address"]
    with SyncPeerClient(address, tls) as peer:
        out["with_tls"] = peer.lookup(hashes)
    with SyncPeerClient(address, plaintext) as outsider:
        try:
            out["plaintext"] = outsider.lookup(hashes, deadline_s=3.0)
        except TransportError as exc:
            out["plaintext"] = type(exc).__name__
print(json.dumps(out))
"""


def test_the_python_api_starts_a_production_cluster_from_the_environment(
    pki: dict[str, str],
) -> None:
    """`kvmesh.app.connect()` with no config and every production piece in ``KVMESH_*``: its
    workers serve mutual TLS with the token and refuse plaintext (was: a dev cluster)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "RAY_ADDRESS"))}
    env.update(
        RAY_AUTH_MODE="token",
        KVMESH_PROFILE="production",
        KVMESH_TLS_CERT=pki["server_cert"],
        KVMESH_TLS_KEY=pki["server_key"],
        KVMESH_TLS_CA=pki["ca"],
        KVMESH_AUTH_TOKEN=TOKEN,
        KVMESH_SEED="per-cluster-secret-seed",
        KVMESH_NUM_WORKERS="1",
        KVMESH_NUM_PAGES="64",
    )
    client = json.dumps(dataclasses.asdict(_client(pki)))
    res = subprocess.run(
        [sys.executable, "-c", PRODUCTION_DRIVER, client],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {
        "profile": "production",
        "answer": 1,
        "with_tls": [True, True],
        "plaintext": out["plaintext"],
    }
    assert out["plaintext"] in ("TransportError", "DeadlineExceeded")
