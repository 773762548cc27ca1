"""FetchPages into the pool (`kvmesh.worker.grpc_wire`) against real and scripted HTTP/2 servers."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import itertools
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from worker_kit import Recorder, proofs_for

from kvmesh import errors
from kvmesh.config import TransferConfig
from kvmesh.hashing import NO_EXTRA, PageHasher
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash, PageId
from kvmesh.worker import grpc_wire, transfer_client
from kvmesh.worker import h2_frames as h2
from kvmesh.worker.call_retry import RetryPolicy, translate
from kvmesh.worker.grpc_wire import WireChannel
from kvmesh.worker.h2_frames import FETCH_PATH, PREFACE, WireStatus
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_codec import encode_chunk
from kvmesh.worker.page_landing import Landed
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageInfo, PageReceiver, PageService, ProofBook
from kvmesh.worker.transfer_client import PageFetcher, SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

PAGE = 16
CFG = TransferConfig(chunk_bytes=4096, deadline_s=10.0, retries=0, fetch_streams=2)
ONE_STREAM = dataclasses.replace(CFG, fetch_streams=1)  # "pages before the fault" is exact


class Tampering(PageService):
    """A sender that corrupts the bytes (`corrupt`) or the token ids (`lie`) of chosen pages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupt: set[PageHash] = set()
        self.lie: set[PageHash] = set()

    def export(self, page_id: PageId) -> PageBlob:
        blob = super().export(page_id)
        if self.pool.pages[page_id].page_hash not in self.corrupt:
            return blob
        data = bytearray(blob.data)
        data[100] ^= 0x04  # the header keeps the checksum of the real bytes
        return dataclasses.replace(blob, data=bytes(data))

    def page_info(self, page_id: PageId) -> PageInfo:
        info = super().page_info(page_id)
        if info.page_hash not in self.lie:
            return info
        return dataclasses.replace(info, token_ids=(info.token_ids[0] + 1, *info.token_ids[1:]))


def service(num_pages: int, dtype: str = "float32", heads: int = 2, dim: int = 16) -> Tampering:
    """An empty pool + CPU store (`heads` x `dim` sets the page size)."""
    store = KVStore(num_pages, 2, heads, dim, PAGE, dtype)
    return Tampering(PagePool(num_pages, page_size=PAGE), store, PageHasher(PAGE, seed="wire"))


def tokens_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 251 for i in range(n * PAGE)]


def fill(svc: Tampering, n: int, salt: int = 0) -> list[PageHash]:
    """Cache `n` pages of random bytes under a token chain, all evictable; their hashes."""
    tokens = tokens_of(n, salt)
    keys = svc.hasher.hash_prompt(tokens)
    pages = svc.pool.get_new_pages(n)
    data = torch.randn((n, *svc.store.page_shape), generator=torch.Generator().manual_seed(salt))
    svc.store.write_pages([p.page_id for p in pages], data.to(svc.store.dtype))
    svc.pool.cache_full_pages(pages, keys, 0, n, tokens)
    svc.pool.free_pages(list(reversed(pages)))
    svc.take_events()  # the sender learns the token ids it sends with each page
    return keys


def into(svc: PageService, n: int, salt: int = 0) -> PageReceiver:
    """`svc` receiving the pages `fill(_, n, salt)` caches, proven by its own book of them."""
    return svc.receiving(proofs_for(svc.hasher, tokens_of(n, salt)))


def same_bytes(a: PageService, b: PageService, keys: list[PageHash]) -> bool:
    """Every page of `keys` cached in both, bit for bit the same."""

    def raw(svc: PageService, key: PageHash) -> bytes:
        with svc.pinned([key]) as (pid,):
            assert pid is not None
            return bytes(svc.export(pid).data)

    return all(raw(a, k) == raw(b, k) for k in keys)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `cond`: a server unpins a cancelled call's pages on its own loop, a moment later."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def idle(svc: PageService) -> bool:
    """No page pinned or reserved: every reference a transfer took was given back."""
    return all(c == 0 for c in svc.ref_counts())


@pytest.fixture(autouse=True)
def wire(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Addresses of every FetchPages call (`WireChannel.call`)."""
    runs: list[str] = []
    real = WireChannel.call

    def call(self: WireChannel, *args: Any, **kwargs: Any) -> None:
        runs.append(self.address)
        real(self, *args, **kwargs)

    monkeypatch.setattr(WireChannel, "call", call)
    return runs


# ------------------------------------------------------------ against the grpc server


@pytest.mark.parametrize(
    ("dtype", "heads", "chunk"),
    [("float16", 2, 4096), ("bfloat16", 8, 4096), ("float32", 8, 4096), ("float32", 2, 1 << 20)],
    ids=["fp16-1-chunk", "bf16-4-chunks", "fp32-8-chunks", "fp32-1-chunk"],
)
def test_zero_copy_pull_lands_pages_bit_exact_over_the_wire_and_ref_counts_return(
    wire: list[str], dtype: str, heads: int, chunk: int
) -> None:
    sender, receiver = service(48, dtype, heads), service(48, dtype, heads)
    keys = fill(sender, 40)
    held = sender.pin(keys[3:6])  # a "request" uses some of them meanwhile
    before = sender.ref_counts()
    cfg = dataclasses.replace(CFG, chunk_bytes=chunk, fetch_streams=3)
    with ServerThread(sender, cfg) as server, SyncPeerClient(server.address, cfg) as client:
        assert client.pull_into(into(receiver, 40), keys) == 40
        assert client.pull_into(into(receiver, 40), keys) == 0  # held already
    assert wire == [server.address] * 6  # 3 streams per pull
    assert same_bytes(sender, receiver, keys)
    assert sender.ref_counts() == before
    sender.unpin(held)
    assert idle(receiver) and idle(sender)
    receiver.check_invariants()


def test_page_bytes_go_from_the_socket_to_the_page_not_through_the_read_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the read buffer takes is copied once more; it reads ahead only a little, so the
    pages' bytes (2 MiB pages, 1 MiB chunks: frames of hundreds of KiB) bypass it."""
    buffered = [0]
    real = WireChannel._fill

    def _fill(self: WireChannel, n: int) -> None:
        had = self._end - self._start
        real(self, n)
        buffered[0] += self._end - self._start - had

    monkeypatch.setattr(WireChannel, "_fill", _fill)
    sender, receiver = service(10, "float32", heads=64, dim=128), service(10, "float32", 64, 128)
    keys = fill(sender, 8)
    cfg = dataclasses.replace(CFG, chunk_bytes=1 << 20, max_message_bytes=4 << 20)
    with ServerThread(sender, cfg) as server, SyncPeerClient(server.address, cfg) as client:
        assert client.pull_into(into(receiver, 8), keys) == 8
    assert same_bytes(sender, receiver, keys)
    page_bytes = 8 * receiver.store.page_nbytes
    assert 0 < buffered[0] < page_bytes // 20, (buffered[0], page_bytes)


def test_a_store_the_socket_cannot_write_into_gets_checked_pages_copied_in(
    monkeypatch: pytest.MonkeyPatch, wire: list[str]
) -> None:
    """A GPU store has no host view of its pages (`page_buffer` is None): pages land in host
    memory, are checked there and copied into the reserved page; the same code as on a GPU."""
    sender, receiver = service(24), service(24)
    keys = fill(sender, 20)
    imported: list[int] = []
    real_import = KVStore.import_page

    def import_page(self: KVStore, page_id: int, blob: PageBlob, **kw: Any) -> None:
        imported.append(page_id)
        real_import(self, page_id, blob, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(KVStore, "page_buffer", lambda _self, _pid: None)
    monkeypatch.setattr(KVStore, "import_page", import_page)
    sender.corrupt.add(keys[12])
    with (
        ServerThread(sender, ONE_STREAM) as server,
        SyncPeerClient(server.address, ONE_STREAM) as client,
    ):
        with pytest.raises(errors.ChecksumMismatch):
            client.pull_into(into(receiver, 20), keys)
        assert receiver.lookup(keys) == [True] * 12 + [False] * 8
        sender.corrupt.clear()
        assert client.pull_into(into(receiver, 20), keys) == 8
    assert len(wire) == 2 and len(imported) == 20  # every page copied in once, after its check
    assert same_bytes(sender, receiver, keys)
    assert idle(receiver) and idle(sender)
    receiver.check_invariants()


def test_unknown_hashes_in_the_middle_are_missing_and_later_pages_still_land() -> None:
    sender, receiver, fresh = service(32), service(32), service(32)
    keys = fill(sender, 10)
    unknown = [PageHash(bytes([i + 1]) * 32) for i in range(2)]
    asked = [*keys[:3], unknown[0], *keys[3:7], unknown[1], *keys[7:]]

    landing = into(fresh, 10)

    def commit(_index: int, item: object) -> None:
        assert isinstance(item, Landed)  # received straight into a reserved page of `fresh`
        landing.commit([(item.reservation, item.page)])

    with ServerThread(sender, CFG) as server:
        with SyncPeerClient(server.address, CFG) as client:
            assert client.pull_into(into(receiver, 10), asked[:9]) == 7
        fetcher = PageFetcher(server.address, CFG, RetryPolicy.of(server.address, CFG))
        result = fetcher.fetch(asked, commit, service=landing)
        fetcher.close()
    assert receiver.lookup(keys) == [True] * 7 + [False] * 3
    assert result.missing == tuple(unknown) and result.received == 10  # in request order
    assert same_bytes(sender, receiver, keys[:7]) and same_bytes(sender, fresh, keys)
    assert idle(sender) and idle(receiver) and idle(fresh)


def test_a_corrupted_page_raises_checksum_mismatch_and_keeps_only_the_pages_before_it() -> None:
    sender, receiver = service(32), service(32)
    keys = fill(sender, 12)
    sender.corrupt.add(keys[5])
    with (
        ServerThread(sender, ONE_STREAM) as server,
        SyncPeerClient(server.address, ONE_STREAM) as client,
    ):
        with pytest.raises(errors.ChecksumMismatch, match="corrupted"):
            client.pull_into(into(receiver, 12), keys)
        assert receiver.lookup(keys) == [True] * 5 + [False] * 7
        assert wait_until(lambda: idle(sender)) and idle(receiver)
        receiver.check_invariants()
        sender.corrupt.clear()
        assert client.pull_into(into(receiver, 12), keys) == 7  # nothing was left reserved
    assert same_bytes(sender, receiver, keys)


def test_a_page_whose_proof_tokens_do_not_hash_to_it_is_refused_before_anything_is_evicted() -> (
    None
):
    """The receiver proves each page from its own request's tokens as its header arrives,
    before a pool page is reserved: a page it cannot prove evicts nothing."""
    sender, receiver = service(16), service(9)
    keys = fill(sender, 4)
    own = fill(receiver, 8, salt=3)  # every usable page cached and evictable
    wrong = tokens_of(4)
    wrong[0] += 1  # the first page's proof fails; the pull stops there
    misproven = receiver.receiving(ProofBook.for_pages(keys, wrong, NO_EXTRA, PAGE))
    with ServerThread(sender, ONE_STREAM) as server:
        client = SyncPeerClient(server.address, ONE_STREAM)
        with client, pytest.raises(errors.HashMismatch, match="do not hash"):
            client.pull_into(misproven, keys)
        assert wait_until(lambda: idle(sender))
    assert receiver.lookup(own) == [True] * 8 and receiver.lookup(keys) == [False] * 4
    assert idle(receiver)
    receiver.check_invariants()


def test_token_ids_a_sender_lies_about_neither_refuse_nor_prove_a_page(wire: list[str]) -> None:
    """The token ids in a page's header are the sender's word, never the proof: under the
    receiver's own book a page whose header lies is taken, and a page it did not ask to
    prove (another prompt's book) is refused however true the header."""
    sender, receiver = service(16), service(16)
    keys = fill(sender, 4)
    sender.lie.add(keys[0])
    with (
        ServerThread(sender, ONE_STREAM) as server,
        SyncPeerClient(server.address, ONE_STREAM) as client,
    ):
        with pytest.raises(errors.HashMismatch, match="refused without proof"):
            client.pull_into(into(receiver, 4, salt=5), keys[1:])  # true headers, no proof
        assert receiver.pool.cached_hashes() == set()
        assert client.pull_into(into(receiver, 4), keys) == 4
    assert same_bytes(sender, receiver, keys) and idle(sender) and idle(receiver)


def test_a_pull_of_thousands_of_pages_on_one_stream_sends_its_request_as_the_server_allows() -> (
    None
):
    """2000 hashes make a 68 KB request: over HTTP/2's initial 16 KiB frame and 64 KiB window
    (sent in one frame, grpc's server broke the connection: FRAME_SIZE_ERROR)."""
    sender, receiver = service(2001, "float16"), service(2001, "float16")
    keys = fill(sender, 2000)
    with (
        ServerThread(sender, ONE_STREAM) as server,
        SyncPeerClient(server.address, ONE_STREAM) as client,
    ):
        assert client.pull_into(into(receiver, 2000), keys) == 2000
    assert same_bytes(sender, receiver, keys[::7]) and idle(sender) and idle(receiver)


def test_windows_are_topped_up_with_exactly_what_was_consumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streams longer than WINDOW_TOP_UP (1 GiB) give the server back what it sent, no more:
    windows stay at most 2**31 - 1. Topped up every 64 KiB here, so a 1 MiB pull sends many
    WINDOW_UPDATEs; each is checked against the DATA bytes received before it."""
    monkeypatch.setattr(grpc_wire, "WINDOW_TOP_UP", 64 * 1024)
    received = [0]  # flow-controlled DATA bytes the call has read
    updates: list[tuple[int, int, int]] = []  # (stream, increment, bytes received by then)
    real_account = WireChannel._account

    def account(self: WireChannel, n: int) -> None:
        received[0] += n
        real_account(self, n)

    class Recording:
        """The call's socket, noting every WINDOW_UPDATE it sends after the request."""

        def __init__(self, sock: socket.socket) -> None:
            self._sock = sock

        def sendall(self, data: bytes) -> None:
            at = 0
            while received[0] and at < len(data):  # frames sent after the request
                length = int.from_bytes(data[at : at + 3], "big")
                if data[at + 3] == h2.WINDOW_UPDATE:
                    stream = int.from_bytes(data[at + 5 : at + 9], "big")
                    inc = int.from_bytes(data[at + 9 : at + 13], "big")
                    updates.append((stream, inc, received[0]))
                at += 9 + length
            self._sock.sendall(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._sock, name)

    real_connect = WireChannel._connect
    monkeypatch.setattr(WireChannel, "_account", account)
    monkeypatch.setattr(WireChannel, "_connect", lambda self, t: Recording(real_connect(self, t)))
    sender, receiver = service(160), service(160)
    keys = fill(sender, 128)  # 8 KiB pages: 1 MiB in all
    with (
        ServerThread(sender, ONE_STREAM) as server,
        SyncPeerClient(server.address, ONE_STREAM) as client,
    ):
        assert client.pull_into(into(receiver, 128), keys) == 128
    for stream in (0, 1):
        given = [(inc, by) for s, inc, by in updates if s == stream]
        assert len(given) >= 10
        total = 0
        for inc, by in given:
            total += inc
            assert total <= by  # never more back than was received
        assert by - total < 64 * 1024
    assert same_bytes(sender, receiver, keys) and idle(sender) and idle(receiver)


def test_a_wrong_or_missing_bearer_token_is_unauthenticated_over_the_wire(
    wire: list[str],
) -> None:
    sender, receiver = service(16), service(16)
    keys = fill(sender, 3)
    secured = dataclasses.replace(CFG, auth_token="s3cret")
    with ServerThread(sender, secured) as server:
        for token in (None, "wrong"):
            client = SyncPeerClient(server.address, dataclasses.replace(CFG, auth_token=token))
            with client, pytest.raises(errors.Unauthenticated):
                client.pull_into(into(receiver, 3), keys)
        assert wire and receiver.lookup(keys) == [False] * 3
        with SyncPeerClient(server.address, secured) as client:
            assert client.pull_into(into(receiver, 3), keys) == 3
    assert idle(receiver) and idle(sender)


Issuer = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


def make_cert(folder: Path, name: str, issuer: Issuer | None = None) -> Issuer:
    """A CA (no `issuer`) or a leaf for 127.0.0.1 signed by `issuer`: folder/name.{pem,key}."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[1].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
        builder = builder.add_extension(x509.SubjectAlternativeName([ip]), critical=False)
    cert = builder.sign(issuer[0] if issuer else key, hashes.SHA256())
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pkcs8, none = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, none))
    return key, cert


def test_mutual_tls_pulls_over_the_wire_and_refuses_foreign_certificates(
    wire: list[str], tmp_path: Path
) -> None:
    ca, other = make_cert(tmp_path, "ca"), make_cert(tmp_path, "other")
    for name, issuer in (("server", ca), ("client", ca), ("intruder", other)):
        make_cert(tmp_path, name, issuer)
    sender, receiver = service(16), service(16)
    keys = fill(sender, 4)

    def tls(me: str, **kw: Any) -> TransferConfig:
        return dataclasses.replace(
            CFG, tls_cert=f"{tmp_path}/{me}.pem", tls_key=f"{tmp_path}/{me}.key", **kw
        )

    with ServerThread(sender, tls("server", tls_ca=f"{tmp_path}/ca.pem")) as server:
        for me, root in (("intruder", "ca"), ("client", "other")):
            client = SyncPeerClient(server.address, tls(me, tls_root_ca=f"{tmp_path}/{root}.pem"))
            with client, pytest.raises(errors.TransportError, match="UNAVAILABLE"):
                client.pull_into(into(receiver, 4), keys)
        assert wire and receiver.lookup(keys) == [False] * 4
        wire.clear()
        good = tls("client", tls_root_ca=f"{tmp_path}/ca.pem")
        with SyncPeerClient(server.address, good) as client:
            assert client.pull_into(into(receiver, 4), keys) == 4
    assert wire == [server.address] * 2  # two streams
    assert same_bytes(sender, receiver, keys)
    assert idle(receiver) and idle(sender)


def test_a_deadline_on_a_slow_peer_keeps_whole_pages_and_releases_the_server_pins() -> None:
    sender, receiver = service(32), service(32)
    keys = fill(sender, 20)
    with ServerThread(sender, CFG, page_delay_s=0.05) as server:
        client = SyncPeerClient(server.address, CFG)
        with client, pytest.raises(errors.DeadlineExceeded):
            client.pull_into(into(receiver, 20), keys, deadline_s=0.3)
        assert wait_until(lambda: idle(sender))
    got = receiver.lookup(keys).count(True)
    assert receiver.lookup(keys) == [True] * got + [False] * (20 - got)
    assert same_bytes(sender, receiver, keys[:got])
    assert idle(receiver)
    receiver.check_invariants()


def test_cancel_from_another_thread_ends_run_with_cancelled_and_unpins_the_server() -> None:
    sender, sink = service(32), Recorder()
    keys = fill(sender, 20)
    failures: list[BaseException] = []
    with ServerThread(sender, CFG, page_delay_s=0.2) as server:
        call = WireChannel(server.address, CFG, None, CFG.max_message_bytes)

        def run() -> None:
            request = pb.FetchRequest(page_hashes=keys, max_chunk_bytes=4096)
            try:
                call.call(request, time.monotonic() + 10.0, sink)
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert wait_until(lambda: len(sink.chunks) >= 1)  # mid-stream, blocked on the socket
        call.cancel()
        thread.join(10)
        assert not thread.is_alive()
        assert wait_until(lambda: idle(sender))
    assert len(failures) == 1 and isinstance(failures[0], WireStatus)
    assert failures[0].code() == grpc.StatusCode.CANCELLED
    assert len(sink.chunks) < 40 and call.broken  # never reused


def test_a_message_over_max_message_bytes_is_message_too_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender, receiver = service(8, heads=8, dim=128), service(8, heads=8, dim=128)  # 256 KiB pages
    keys = fill(sender, 2)
    big = pb.FetchRequest(page_hashes=keys, max_chunk_bytes=1 << 20)
    with ServerThread(sender, dataclasses.replace(CFG, chunk_bytes=1 << 20)) as server:
        with pytest.raises(WireStatus) as raised:
            channel = WireChannel(server.address, CFG, None, 128 * 1024)
            channel.call(big, time.monotonic() + 5.0, Recorder())
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A client asking for more than it accepts, as a peer ignoring max_chunk_bytes would send
        monkeypatch.setattr(transfer_client, "chunk_size", lambda _cfg: 1 << 20)
        client = SyncPeerClient(server.address, dataclasses.replace(CFG, max_message_bytes=1 << 17))
        with client, pytest.raises(errors.MessageTooLarge):
            client.pull_into(into(receiver, 2), keys)
        assert wait_until(lambda: idle(sender))
    assert receiver.lookup(keys) == [False, False] and idle(receiver)


# ---------------------------------------------------------- against a scripted HTTP/2 peer


OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def frame(kind: int, flags: int, payload: bytes = b"", stream: int = 1) -> bytes:
    """One HTTP/2 frame (RFC 9113 section 4.1), built by hand as any server might."""
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
    return head + payload


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes (TCP may split anything)."""
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def read_frame(conn: socket.socket) -> tuple[int, int, bytes]:
    """The next frame the client sent: (type, flags, payload)."""
    head = recv_exact(conn, 9)
    return head[3], head[4], recv_exact(conn, int.from_bytes(head[:3], "big"))


class FakePeer:
    """One connection of a plain-socket HTTP/2 server: reads the request, plays `script`."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.headers: dict[str, str] = {}
        self.request = pb.FetchRequest()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(5.0)
                assert recv_exact(conn, len(PREFACE)) == PREFACE
                while True:
                    kind, flags, payload = read_frame(conn)
                    if kind == h2.HEADERS:
                        self.headers = {str(k): str(v) for k, v in hpack.Decoder().decode(payload)}
                    if kind == h2.DATA and flags & h2.END_STREAM:
                        self.request = pb.FetchRequest.FromString(payload[5:])
                        break
                self.script(conn)
                while conn.recv(65536):  # until the client closes
                    pass
        except BaseException as exc:
            self.error = exc

    def call(self, sink: Recorder) -> None:
        """Run a FetchPages call against this peer; re-raise what went wrong on its side."""
        try:
            request = pb.FetchRequest(page_hashes=[b"\x01" * 32], max_chunk_bytes=4096)
            channel = WireChannel(self.address, CFG, None, 1 << 20)
            channel.call(request, time.monotonic() + 5.0, sink)
        finally:
            self.thread.join(10)
            self.listener.close()
            if self.error is not None and not isinstance(self.error, OSError):
                raise self.error


def test_any_compliant_http2_server_framing_is_read_exactly() -> None:
    header = pb.PageHeader(page_hash=b"\x01" * 32, dtype="float32", shape=[1250], nbytes=5000)
    data0, data1 = bytes(range(256)) * 16, b"\xab" * 904
    chunks = [
        encode_chunk(0, 0, data0, header=header),
        encode_chunk(0, len(data0), data1),
        encode_chunk(1, 0, b"", header=pb.PageHeader(page_hash=b"\x02" * 32), missing=True),
    ]
    body = b"".join(b"\x00" + len(c).to_bytes(4, "big") + c for c in chunks)
    acks: list[bytes] = []

    def script(conn: socket.socket) -> None:
        enc = hpack.Encoder()  # one encoder: the trailers may refer to the headers' table
        conn.sendall(frame(h2.SETTINGS, 0, stream=0) + frame(h2.PING, 0, b"kvmesh!!", 0))
        while not acks:
            kind, flags, payload = read_frame(conn)
            if kind == h2.PING and flags & h2.ACK:
                acks.append(payload)
        block = enc.encode(OK_HEADERS)
        out = frame(h2.HEADERS, 0, block[:3]) + frame(h2.CONTINUATION, h2.END_HEADERS, block[3:])
        cuts = [0, 2, 7, 8, 30, 31, 2500, 4100, 4200, len(body)]  # in prefixes, varints, data
        for n, (a, b) in enumerate(itertools.pairwise(cuts)):
            pad, part = n % 3, body[a:b]
            padded = frame(h2.DATA, h2.PADDED, bytes((pad,)) + part + bytes(pad))
            out += padded if n % 2 else frame(h2.DATA, 0, part)
        out += frame(h2.DATA, h2.PADDED, b"\x02\x00\x00")  # empty, padded
        trailers = enc.encode([("grpc-status", "0")])
        conn.sendall(out + frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, trailers))

    peer, sink = FakePeer(script), Recorder()
    peer.call(sink)
    assert acks == [b"kvmesh!!"]
    assert peer.headers[":path"] == FETCH_PATH and peer.headers["te"] == "trailers"
    assert "grpc-timeout" in peer.headers and list(peer.request.page_hashes) == [b"\x01" * 32]
    got = [(m.page_index, m.offset, m.missing, d) for m, d in sink.chunks]
    assert got == [(0, 0, False, data0), (0, 4096, False, data1), (1, 0, True, b"")]
    assert sink.chunks[0][0].header == header and not sink.chunks[1][0].HasField("header")


def test_a_trailers_only_error_carries_its_status_decoded_details_and_kvmesh_error() -> None:
    details = "page 0101 not found: ünïcode ✓ 100%"

    def script(conn: socket.socket) -> None:
        fields = [*OK_HEADERS, ("grpc-status", "5"), ("grpc-message", urllib.parse.quote(details))]
        block = hpack.Encoder().encode([*fields, ("kvmesh-error", "UnknownHash")])
        conn.sendall(frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, block))

    peer = FakePeer(script)
    with pytest.raises(WireStatus) as raised:
        peer.call(Recorder())
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.details() == details
    assert ("kvmesh-error", "UnknownHash") in raised.value.trailing_metadata()
    assert isinstance(translate(raised.value, "FetchPages", peer.address), errors.UnknownHash)


def test_a_server_closing_mid_message_is_unavailable() -> None:
    def script(conn: socket.socket) -> None:
        block = hpack.Encoder().encode(OK_HEADERS)
        chunk = encode_chunk(0, 0, b"\x55" * 4800, header=pb.PageHeader(page_hash=b"\x01" * 32))
        message = b"\x00" + len(chunk).to_bytes(4, "big") + chunk
        conn.sendall(frame(h2.HEADERS, h2.END_HEADERS, block) + frame(h2.DATA, 0, message[:300]))
        conn.shutdown(socket.SHUT_RDWR)

    sink = Recorder()
    with pytest.raises(WireStatus) as raised:
        FakePeer(script).call(sink)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sink.chunks == []


# ------------------------------------------------------------------ connection reuse


@pytest.fixture
def dials(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Addresses of every new connection a `WireChannel` opens."""
    opened: list[str] = []
    real = WireChannel._open

    def _open(self: WireChannel, timeout: float) -> socket.socket:
        opened.append(self.address)
        return real(self, timeout)

    monkeypatch.setattr(WireChannel, "_open", _open)
    return opened


def test_pulls_reuse_the_peer_connections_instead_of_dialing_each_time(
    wire: list[str], dials: list[str]
) -> None:
    """Small and large pulls take the same path; two streams, two connections, kept."""
    sender, receiver = service(48), service(48)
    keys = fill(sender, 40)
    with ServerThread(sender, CFG) as server, SyncPeerClient(server.address, CFG) as client:
        for n in (1, 4, 40, 2, 40):
            with receiver.lock:
                receiver.pool.reset_prefix_cache()
            assert client.pull_into(into(receiver, 40), keys[:n]) == n
    assert len(wire) == 1 + 2 * 4 and dials == [server.address] * 2
    assert same_bytes(sender, receiver, keys) and idle(sender) and idle(receiver)


def test_a_pooled_connection_the_peer_closed_while_idle_is_replaced_not_failed(
    dials: list[str],
) -> None:
    """A peer restarted between two pulls: the idle connection is found closed before a call
    is made on it, and a new one is dialled (no retry needed: retries=0 here)."""
    sender, receiver = service(16), service(16)
    keys = fill(sender, 4)
    with ServerThread(sender, ONE_STREAM) as first:
        port = first.server.port
        client = SyncPeerClient(first.address, ONE_STREAM)
        assert client.pull_into(into(receiver, 4), keys[:2]) == 2
    with ServerThread(sender, dataclasses.replace(ONE_STREAM, port=port)), client:
        assert client.pull_into(into(receiver, 4), keys) == 2
    assert len(dials) == 2 and idle(sender) and idle(receiver)


def test_fetched_pages_without_a_pool_are_checksummed_and_none_after_a_corrupt_one_is_given(
    wire: list[str],
) -> None:
    sender = service(16)
    keys = fill(sender, 8)
    sender.corrupt.add(keys[3])
    got: list[int] = []
    with (
        ServerThread(sender, ONE_STREAM) as server,
        SyncPeerClient(server.address, ONE_STREAM) as client,
    ):
        with pytest.raises(errors.ChecksumMismatch, match="corrupted"):
            client.fetch_pages(keys, on_page=lambda i, _p: got.append(i))
        sender.corrupt.clear()
        pages = client.fetch_pages(keys).pages
    assert got == [0, 1, 2] and [p.page_hash for p in pages] == keys
    assert wait_until(lambda: idle(sender))
