"""TLS and mutual TLS on the transfer server, with certificates made in the test."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, TransportError, Unauthenticated
from kvmesh.hashing import NO_EXTRA, PageHasher
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService, ProofBook
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

PAGE = 16
TOKEN = "cluster-token"


@dataclasses.dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


class CA:
    """A throwaway certificate authority writing PEM files into a folder."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / f"{name}-ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, ip: str | None = None, dns: str | None = None) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = []
        if ip:
            names.append(x509.IPAddress(ipaddress.ip_address(ip)))
        if dns:
            names.append(x509.DNSName(dns))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
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
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = self.folder / f"{self.name}-{common_name}"
        cert_path, key_path = Path(f"{stem}.pem"), Path(f"{stem}.key")
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return Issued(cert_path, key_path)


@dataclasses.dataclass(frozen=True)
class PKI:
    ca: CA
    other_ca: CA
    server: Issued
    server_dns_only: Issued
    client: Issued
    foreign_client: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = CA(folder, "cluster"), CA(folder, "intruder")
    return PKI(
        ca=ca,
        other_ca=other,
        server=ca.issue("worker-0", ip="127.0.0.1", dns="localhost"),
        server_dns_only=ca.issue("worker-1", dns="worker-1.kvmesh.internal"),
        client=ca.issue("worker-2"),
        foreign_client=other.issue("worker-2"),
    )


@pytest.fixture(scope="module")
def service() -> PageService:
    pool = PagePool(16, page_size=PAGE)
    svc = PageService(pool, KVStore(16, 1, 1, 8, PAGE), PageHasher(PAGE))
    tokens = list(range(2 * PAGE))
    keys = svc.hasher.hash_prompt(tokens)
    pages = pool.get_new_pages(2)
    pool.cache_full_pages(pages, keys, 0, 2, tokens)
    pool.free_pages(pages)
    return svc


def page_hashes(service: PageService) -> list[PageHash]:
    return service.hasher.hash_prompt(list(range(2 * PAGE)))


NO_RETRY = TransferConfig(retries=0, deadline_s=5.0)


def server_config(pki: PKI, *, mutual: bool, token: str | None = TOKEN) -> TransferConfig:
    return dataclasses.replace(
        NO_RETRY,
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        tls_ca=str(pki.ca.path) if mutual else None,
        auth_token=token,
    )


def client_config(
    pki: PKI, client: Issued | None, *, token: str | None = TOKEN, root: Path | None = None
) -> TransferConfig:
    return dataclasses.replace(
        NO_RETRY,
        tls_root_ca=str(root or pki.ca.path),
        tls_cert=str(client.cert) if client else None,
        tls_key=str(client.key) if client else None,
        auth_token=token,
    )


@pytest.fixture(scope="module")
def mtls_server(pki: PKI, service: PageService) -> Iterator[ServerThread]:
    with ServerThread(service, server_config(pki, mutual=True)) as server:
        yield server


def test_a_client_with_a_cluster_certificate_and_the_token_is_served(
    pki: PKI, service: PageService, mtls_server: ServerThread
) -> None:
    assert mtls_server.server.tls
    cfg = client_config(pki, pki.client)
    receiver = PageService(
        PagePool(16, page_size=PAGE), KVStore(16, 1, 1, 8, PAGE), PageHasher(PAGE)
    )
    with SyncPeerClient(mtls_server.address, cfg) as client:
        assert client.lookup(page_hashes(service)) == [True, True]
        result = client.fetch_pages(page_hashes(service))
        assert [p.page_hash for p in result.pages] == page_hashes(service)
        tokens = list(range(2 * PAGE))  # the receiver's own request: it proves both pages
        proofs = ProofBook.for_pages(page_hashes(service), tokens, NO_EXTRA, PAGE)
        assert client.pull_into(receiver.receiving(proofs), page_hashes(service)) == 2
        assert client.health() == "SERVING"
    assert receiver.lookup(page_hashes(service)) == [True, True]


def test_mutual_tls_refuses_a_client_without_a_certificate(
    pki: PKI, service: PageService, mtls_server: ServerThread
) -> None:
    with (
        SyncPeerClient(mtls_server.address, client_config(pki, None)) as client,
        pytest.raises(TransportError, match="UNAVAILABLE"),
    ):
        client.lookup(page_hashes(service))


def test_mutual_tls_refuses_a_certificate_from_another_ca(
    pki: PKI, service: PageService, mtls_server: ServerThread
) -> None:
    cfg = client_config(pki, pki.foreign_client)
    with (
        SyncPeerClient(mtls_server.address, cfg) as client,
        pytest.raises(TransportError, match="UNAVAILABLE"),
    ):
        client.fetch_pages(page_hashes(service))


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_mutual_tls_with_a_missing_or_wrong_token_is_unauthenticated(
    pki: PKI, service: PageService, mtls_server: ServerThread, token: str | None
) -> None:
    cfg = client_config(pki, pki.client, token=token)
    with SyncPeerClient(mtls_server.address, cfg) as client:
        with pytest.raises(Unauthenticated, match="bearer token"):
            client.lookup(page_hashes(service))
        with pytest.raises(Unauthenticated):
            client.fetch_pages(page_hashes(service))


def test_a_client_that_does_not_trust_the_server_ca_refuses_it(
    pki: PKI, service: PageService, mtls_server: ServerThread
) -> None:
    cfg = client_config(pki, pki.client, root=pki.other_ca.path)
    with (
        SyncPeerClient(mtls_server.address, cfg) as client,
        pytest.raises(TransportError, match="UNAVAILABLE"),
    ):
        client.lookup(page_hashes(service))


def test_server_only_tls_serves_clients_without_certificates_but_not_plaintext(
    pki: PKI, service: PageService
) -> None:
    with ServerThread(service, server_config(pki, mutual=False, token=None)) as server:
        with SyncPeerClient(server.address, client_config(pki, None, token=None)) as client:
            assert client.lookup(page_hashes(service)) == [True, True]
        with (
            SyncPeerClient(server.address, NO_RETRY) as plain,
            pytest.raises(TransportError, match="UNAVAILABLE"),
        ):
            plain.lookup(page_hashes(service))


def test_tls_server_name_matches_a_certificate_issued_for_a_dns_name(
    pki: PKI, service: PageService
) -> None:
    cfg = dataclasses.replace(
        NO_RETRY, tls_cert=str(pki.server_dns_only.cert), tls_key=str(pki.server_dns_only.key)
    )
    with ServerThread(service, cfg) as server:
        by_ip = client_config(pki, None, token=None)
        with SyncPeerClient(server.address, by_ip) as client, pytest.raises(TransportError):
            client.lookup(page_hashes(service))
        by_name = dataclasses.replace(by_ip, tls_server_name="worker-1.kvmesh.internal")
        with SyncPeerClient(server.address, by_name) as client:
            assert client.lookup(page_hashes(service)) == [True, True]


def test_incomplete_tls_settings_are_config_errors(pki: PKI, service: PageService) -> None:
    with pytest.raises(ConfigError, match="tls_key"):
        ServerThread(service, dataclasses.replace(NO_RETRY, tls_cert=str(pki.server.cert)))
    with pytest.raises(ConfigError, match="needs tls_cert"):
        ServerThread(service, dataclasses.replace(NO_RETRY, tls_ca=str(pki.ca.path)))
    with pytest.raises(ConfigError, match="cannot read"):
        ServerThread(
            service,
            dataclasses.replace(NO_RETRY, tls_cert="/nonexistent.pem", tls_key=str(pki.server.key)),
        )
