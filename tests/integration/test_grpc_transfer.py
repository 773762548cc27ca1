"""Page transfer over real gRPC servers on 127.0.0.1: round trips, refusals, faults, ref counts.

A receiver proves every page against its own book of the prompt it serves
(`into`); a push is taken only under a ticket the receiving service granted
(`grant`), and one pusher's evictions are capped by its budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import torch

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    ChecksumMismatch,
    ConfigError,
    DeadlineExceeded,
    HashMismatch,
    InvalidInput,
    MessageTooLarge,
    PageFormatError,
    PermissionDenied,
    PoolExhausted,
    TransportError,
    Unauthenticated,
    UnknownHash,
)
from kvmesh.hashing import NO_EXTRA, PageHasher
from kvmesh.proto import kvmesh_pb2, kvmesh_pb2_grpc
from kvmesh.types import PageHash
from kvmesh.worker.grpc_wire import WireChannel
from kvmesh.worker.kv_store import KVStore, checksum
from kvmesh.worker.page_codec import PUSH_TICKET_KEY, encode_chunk
from kvmesh.worker.page_landing import verify_header
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import (
    EvictionBudget,
    IncomingPage,
    PageReceiver,
    PageService,
    ProofBook,
    PushGrants,
)
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread, TransferServer

PAGE = 16
SMALL = TransferConfig(chunk_bytes=4096, deadline_s=10.0, retry_backoff_s=0.01)

# A peer worker process for the kill test. Also imported by the test (same file)
# so that both sides build the same deterministic pages.
PEER_SCRIPT = """
import sys, time
import torch
from kvmesh.config import TransferConfig
from kvmesh.hashing import PageHasher
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService

PAGE = 16

def page_data(store, i):
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(store.page_shape, generator=gen).to(store.dtype)

def build(num_pages, n, dtype="float32"):
    pool = PagePool(num_pages, page_size=PAGE)
    store = KVStore(num_pages, 2, 2, 16, PAGE, dtype)
    service = PageService(pool, store, PageHasher(PAGE, seed="it-seed"))
    tokens = [(7 * i) % 251 for i in range(n * PAGE)]
    hashes = service.hasher.hash_prompt(tokens)
    pages = pool.get_new_pages(n)
    for i, page in enumerate(pages):
        store.write_page(page.page_id, page_data(store, i))
    pool.cache_full_pages(pages, hashes, 0, n, tokens)
    pool.free_pages(list(reversed(pages)))
    service.take_events()
    return service, hashes, tokens

if __name__ == "__main__":
    from kvmesh.worker.transfer_server import ServerThread
    n, delay = int(sys.argv[1]), float(sys.argv[2])
    service, _, _ = build(n + 8, n)
    server = ServerThread(service, TransferConfig(chunk_bytes=4096), page_delay_s=delay)
    print(server.start(), flush=True)
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def peer_module(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, Path]:
    path = tmp_path_factory.mktemp("peer") / "peer_server.py"
    path.write_text(PEER_SCRIPT)
    spec = importlib.util.spec_from_file_location("kvmesh_test_peer_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def prompt_tokens(n: int, start: int = 0) -> list[int]:
    """The tokens of the `n`-page prompt whose pages the peer script's `build` caches
    (`start`: another prompt)."""
    return [(7 * i + start) % 251 for i in range(n * PAGE)]


def build(
    peer: tuple[ModuleType, Path], num_pages: int, n: int, dtype: str = "float32"
) -> tuple[PageService, list[PageHash], list[int]]:
    service, hashes, tokens = peer[0].build(num_pages, n, dtype)
    assert tokens == prompt_tokens(n)
    return service, hashes, tokens


def empty(num_pages: int = 64, dtype: str = "float32", **kw: Any) -> PageService:
    pool = PagePool(num_pages, page_size=PAGE)
    return PageService(
        pool, KVStore(num_pages, 2, 2, 16, PAGE, dtype), PageHasher(PAGE, seed="it-seed"), **kw
    )


def book(service: PageService, n: int, start: int = 0) -> ProofBook:
    """What `service` proves when it serves the `n`-page prompt (its own tokens)."""
    tokens = prompt_tokens(n, start)
    return ProofBook.for_pages(service.hasher.hash_prompt(tokens), tokens, NO_EXTRA, PAGE)


def into(service: PageService, n: int) -> PageReceiver:
    """`service` receiving pages of the `n`-page prompt, each proven by its own book."""
    return service.receiving(book(service, n))


def grant(service: PageService, n: int) -> bytes:
    """A ticket `service` grants for a push of the `n`-page prompt's pages (prefill -> decode)."""
    return service.grants.grant(book(service, n))


def page_bytes(service: PageService, page_hash: PageHash) -> bytes:
    with service.pinned([page_hash]) as (pid,):
        assert pid is not None
        return bytes(service.export(pid).data)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def served(
    peer_module: tuple[ModuleType, Path],
) -> Iterator[tuple[PageService, list[PageHash], ServerThread]]:
    sender, hashes, _ = build(peer_module, 64, 24)
    with ServerThread(sender, SMALL) as server:
        yield sender, hashes, server


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_many_pages_round_trip_bit_exact_and_ref_counts_return(
    peer_module: tuple[ModuleType, Path], dtype: str
) -> None:
    sender, hashes, _ = build(peer_module, 96, 80, dtype)
    held = sender.pin(hashes[:3])  # some pages already in use by a "request"
    before = sender.ref_counts()
    receiver = empty(96, dtype)
    with ServerThread(sender, SMALL) as server, SyncPeerClient(server.address, SMALL) as client:
        assert client.pull_into(into(receiver, 80), hashes) == 80
    assert receiver.lookup(hashes) == [True] * 80
    for h in hashes:
        assert page_bytes(receiver, h) == page_bytes(sender, h)
    assert sender.ref_counts() == before
    assert all(c == 0 for c in receiver.ref_counts())
    sender.unpin(held)
    receiver.check_invariants()
    sender.check_invariants()


def test_fetched_pages_carry_provable_tokens_and_the_parent_chain(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    _, hashes, server = served
    with SyncPeerClient(server.address, SMALL) as client:
        result = client.fetch_pages(hashes[:4])
    assert [p.page_hash for p in result.pages] == hashes[:4]
    assert result.pages[0].parent_hash is None and result.pages[2].parent_hash == hashes[1]
    assert all(len(p.token_ids) == PAGE for p in result.pages)
    assert result.missing == ()


def test_pages_larger_than_one_message_are_chunked_for_any_protobuf_client(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, server = served
    nbytes = sender.store.page_nbytes  # 8 KiB float32 pages, chunks of 4 KiB
    channel = grpc.insecure_channel(server.address)
    stub = kvmesh_pb2_grpc.KVWorkerStub(channel)
    chunks = list(stub.FetchPages(kvmesh_pb2.FetchRequest(page_hashes=hashes[:3]), timeout=10))
    channel.close()
    assert [(c.page_index, c.offset) for c in chunks] == [
        (i, o) for i in range(3) for o in (0, 4096)
    ]
    assert all(len(c.data) == nbytes // 2 for c in chunks)
    first = chunks[0].header
    assert first.nbytes == nbytes and first.dtype == "float32" and not chunks[1].HasField("header")
    assert checksum(chunks[0].data + chunks[1].data) == first.checksum
    assert chunks[0].data + chunks[1].data == page_bytes(sender, hashes[0])


def test_unknown_hashes_are_reported_missing_and_the_stream_goes_on(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, server = served
    unknown = [PageHash(bytes([i]) * 32) for i in range(2)]
    asked = [hashes[0], unknown[0], hashes[1], unknown[1]]
    with SyncPeerClient(server.address, SMALL) as client:
        result = client.fetch_pages(asked)
        assert client.lookup(asked) == [True, False, True, False]
    assert [p.page_hash for p in result.pages] == hashes[:2]
    assert result.missing == tuple(unknown)
    assert all(c == 0 for c in sender.ref_counts())


def test_push_caches_pages_on_the_peer_and_skips_pages_it_holds(
    peer_module: tuple[ModuleType, Path],
) -> None:
    prefill, hashes, _ = build(peer_module, 64, 12, "bfloat16")
    decode = empty(64, "bfloat16")
    with ServerThread(decode, SMALL) as server, SyncPeerClient(server.address, SMALL) as client:
        assert client.push_from(prefill, hashes[:8], grant(decode, 12)) == [True] * 8
        again = client.push_from(prefill, hashes[4:12], grant(decode, 12))
        assert again == [False] * 4 + [True] * 4
        with pytest.raises(UnknownHash):
            client.push_from(prefill, [PageHash(b"\x09" * 32)], grant(decode, 12))
    assert decode.lookup(hashes) == [True] * 12
    assert all(page_bytes(decode, h) == page_bytes(prefill, h) for h in hashes)
    assert all(c == 0 for c in prefill.ref_counts() + decode.ref_counts())


# ------------------------------------------------------------------ refusals


def _pushable(sender: PageService, hashes: list[PageHash], i: int) -> IncomingPage:
    with sender.pinned([hashes[i]]) as (pid,):
        assert pid is not None
        info = sender.page_info(pid)
        blob = sender.store.export_page(pid, copy=True)
    return IncomingPage(info.page_hash, info.parent_hash, info.token_ids, blob, info.lora_id)


def _state(service: PageService) -> tuple[object, ...]:
    return (service.ref_counts(), service.pool.cached_hashes(), service.store.kv.clone())


def _same(service: PageService, before: tuple[object, ...]) -> bool:
    after = _state(service)
    return after[:2] == before[:2] and torch.equal(after[2], before[2])  # type: ignore[arg-type]


def test_pushed_pages_failing_a_check_are_refused_with_their_error_and_change_nothing(
    peer_module: tuple[ModuleType, Path],
) -> None:
    sender, hashes, _ = build(peer_module, 32, 3)
    page = _pushable(sender, hashes, 1)
    flipped = bytearray(page.blob.data)
    flipped[100] ^= 0x04
    corrupt = dataclasses.replace(page, blob=dataclasses.replace(page.blob, data=bytes(flipped)))
    # Was: the page with its sender's token ids replaced. A sender's token ids are no proof
    # any more (test_a_ticket_admits_only_its_requests_pages_proven_by_the_receiver takes
    # such a page); the page that cannot be proven now is one of a prompt the ticket was
    # not granted for.
    unproven = _pushable(_other_prompt(), OTHER_HASHES, 1)
    half_sender, _, _ = build(peer_module, 32, 3, "float16")
    half = _pushable(half_sender, hashes, 1)
    reshaped = dataclasses.replace(
        page, blob=dataclasses.replace(page.blob, shape=(2, 2, 16, 4, 8))
    )
    receiver = empty()
    before = _state(receiver)
    cases: list[tuple[IncomingPage, type[Exception]]] = [
        (corrupt, ChecksumMismatch),
        (unproven, HashMismatch),
        (half, PageFormatError),
        (reshaped, PageFormatError),
    ]
    with ServerThread(receiver, SMALL) as server, SyncPeerClient(server.address, SMALL) as client:
        for bad, error in cases:
            with pytest.raises(error, match=server.address.split(":")[0]):
                client.push_pages([bad], grant(receiver, 3))
        assert _same(receiver, before)
        # pages before the bad one stay; the bad one and later ones do not
        with pytest.raises(ChecksumMismatch):
            client.push_pages(
                [_pushable(sender, hashes, 0), corrupt, _pushable(sender, hashes, 2)],
                grant(receiver, 3),
            )
    assert receiver.lookup(hashes) == [True, False, False]


OTHER_START = 100
OTHER_HASHES = PageHasher(PAGE, seed="it-seed").hash_prompt(prompt_tokens(2, OTHER_START))


def _other_prompt() -> PageService:
    """A sender holding the pages of another prompt (`prompt_tokens(2, OTHER_START)`)."""
    service = empty(8)
    pages = service.pool.get_new_pages(2)
    for page in pages:
        service.store.write_page(page.page_id, torch.randn(service.store.page_shape))
    service.pool.cache_full_pages(pages, OTHER_HASHES, 0, 2, prompt_tokens(2, OTHER_START))
    service.pool.free_pages(list(reversed(pages)))
    service.take_events()
    return service


def test_a_ticket_admits_only_its_requests_pages_proven_by_the_receiver(
    peer_module: tuple[ModuleType, Path],
) -> None:
    """Under a ticket for a prompt, its pages are taken whatever token ids their sender
    claims; a page of another prompt in the same push is `HashMismatch`, the pages before
    it stay and none after it is taken."""
    sender, hashes, _ = build(peer_module, 32, 4)
    other = _other_prompt()
    lying = dataclasses.replace(_pushable(sender, hashes, 1), token_ids=(1,) * PAGE)
    push = [_pushable(sender, hashes, 0), lying, _pushable(other, OTHER_HASHES, 0)]
    receiver = empty()
    with ServerThread(receiver, SMALL) as server, SyncPeerClient(server.address, SMALL) as client:
        with pytest.raises(HashMismatch, match="refused without proof"):
            client.push_pages([*push, _pushable(sender, hashes, 2)], grant(receiver, 4))
        assert receiver.lookup(hashes) == [True, True, False, False]
        assert receiver.lookup(OTHER_HASHES) == [False, False]
        assert client.push_from(sender, hashes, grant(receiver, 4)) == [False, False, True, True]
    assert all(page_bytes(receiver, h) == page_bytes(sender, h) for h in hashes)
    assert all(c == 0 for c in receiver.ref_counts())


@pytest.mark.parametrize("case", ["none", "not-hex", "unknown", "expired", "used"])
def test_a_push_without_a_live_ticket_is_permission_denied_before_any_page_is_read(
    peer_module: tuple[ModuleType, Path], case: str
) -> None:
    """Checked before the stream is read: junk that would be INVALID_ARGUMENT once decoded
    is PERMISSION_DENIED, real pages are `PermissionDenied` on the client, the pool as
    before, and the server serves on."""
    sender, hashes, _ = build(peer_module, 32, 3)
    clock = [0.0]
    receiver = empty(grants=PushGrants(ttl_s=30.0, clock=lambda: clock[0]))

    def bad_ticket(client: SyncPeerClient) -> str:
        """The metadata value of a ticket that is not live (hex unless "not-hex")."""
        if case in ("none", "not-hex"):
            return "" if case == "none" else "not a ticket"
        if case == "unknown":
            return secrets.token_bytes(16).hex()
        ticket = grant(receiver, 3)
        if case == "expired":
            clock[0] += 30.0
        else:  # used: once, for the first page
            client.push_pages([_pushable(sender, hashes, 0)], ticket)
            assert receiver.lookup(hashes[:1]) == [True]
        return ticket.hex()

    with ServerThread(receiver, SMALL) as server, SyncPeerClient(server.address, SMALL) as client:
        tickets = [bad_ticket(client), bad_ticket(client)]
        before = _state(receiver)
        channel = grpc.insecure_channel(server.address)
        try:
            stub = channel.stream_unary("/kvmesh.v1.KVWorker/PushPages")
            metadata = ((PUSH_TICKET_KEY, tickets[0]),) if tickets[0] else None
            with pytest.raises(grpc.RpcError) as err:
                stub(iter([b"\xff\xff\xff"]), timeout=10, metadata=metadata)
            code = err.value.code()  # type: ignore[attr-defined]
            assert code == grpc.StatusCode.PERMISSION_DENIED
        finally:
            channel.close()
        raw = b"\x00" * 16 if case == "not-hex" else bytes.fromhex(tickets[1])
        with pytest.raises(PermissionDenied, match=r"grant|ticket"):
            client.push_pages([_pushable(sender, hashes, i) for i in (1, 2)], raw)
        assert _same(receiver, before)
        assert client.health() == "SERVING"


def test_one_pushers_evictions_are_capped_by_its_budget_which_refills(
    peer_module: tuple[ModuleType, Path],
) -> None:
    """A push into a pool full of other cached pages evicts at most the pusher's budget:
    the page that would evict more is `PoolExhausted` and evicts nothing; once the budget
    has refilled, the rest is taken."""
    sender, hashes, _ = build(peer_module, 32, 4)
    clock = [0.0]
    receiver = empty(9, evictions=EvictionBudget(2, 10.0, clock=lambda: clock[0]))
    tokens = prompt_tokens(8, OTHER_START)
    own_hashes = receiver.hasher.hash_prompt(tokens)
    pages = receiver.pool.get_new_pages(8)  # every usable page: cached, evictable
    receiver.pool.cache_full_pages(pages, own_hashes, 0, 8, tokens)
    receiver.pool.free_pages(list(reversed(pages)))
    with ServerThread(receiver, SMALL) as server, SyncPeerClient(server.address, SMALL) as client:
        with pytest.raises(PoolExhausted, match="may evict 0 more"):
            client.push_from(sender, hashes, grant(receiver, 4))
        assert receiver.lookup(hashes) == [True, True, False, False]
        assert receiver.lookup(own_hashes).count(True) == 6  # two evicted, no more
        clock[0] += 10.0  # a whole window: the budget is full again
        assert client.push_from(sender, hashes, grant(receiver, 4)) == [False, False, True, True]
    assert receiver.lookup(own_hashes).count(True) == 4
    assert all(c == 0 for c in receiver.ref_counts())
    receiver.check_invariants()


def _wide(num_pages: int) -> PageService:
    """A service with 128 KiB pages (wider than the tight message limit below)."""
    pool = PagePool(num_pages, page_size=PAGE)
    store = KVStore(num_pages, 2, 8, 64, PAGE, "float32")
    return PageService(pool, store, PageHasher(PAGE, seed="it-seed"))


def test_oversized_messages_are_refused_while_other_clients_keep_working() -> None:
    sender = _wide(8)
    tokens = list(range(2 * PAGE))
    hashes = sender.hasher.hash_prompt(tokens)
    pages = sender.pool.get_new_pages(2)
    for page in pages:
        sender.store.write_page(page.page_id, torch.randn(sender.store.page_shape))
    sender.pool.cache_full_pages(pages, hashes, 0, 2, tokens)
    sender.pool.free_pages(pages)
    big = TransferConfig(chunk_bytes=1 << 20)  # sends each 128 KiB page as one message...
    tight = TransferConfig(max_message_bytes=64 * 1024 + 8192)  # ...the server takes 72 KiB
    receiver = _wide(8)
    proofs = ProofBook.for_pages(hashes, tokens, NO_EXTRA, PAGE)
    with ServerThread(receiver, tight) as server:
        with SyncPeerClient(server.address, big) as client, pytest.raises(MessageTooLarge):
            client.push_pages([_pushable(sender, hashes, 0)], receiver.grants.grant(proofs))
        with SyncPeerClient(server.address, tight) as client:  # 8 KiB chunks
            ticket = receiver.grants.grant(proofs)
            assert client.push_pages([_pushable(sender, hashes, 0)], ticket) == [True]
            assert client.health() == "SERVING"
        with SyncPeerClient(server.address, big) as client:  # fetches ask for small chunks
            assert len(client.fetch_pages(hashes[:1]).pages) == 1
    assert receiver.lookup(hashes) == [True, False]
    assert all(c == 0 for c in receiver.ref_counts())


def test_a_stock_client_reading_bigger_chunks_than_it_accepts_gets_resource_exhausted(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    _, hashes, server = served
    small = grpc.insecure_channel(
        server.address, options=[("grpc.max_receive_message_length", 1024)]
    )
    stub = kvmesh_pb2_grpc.KVWorkerStub(small)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchPages(kvmesh_pb2.FetchRequest(page_hashes=hashes[:1]), timeout=10))
    small.close()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]


def test_malformed_push_streams_are_invalid_and_insert_nothing(
    peer_module: tuple[ModuleType, Path],
) -> None:
    sender, hashes, _ = build(peer_module, 32, 1)
    page = _pushable(sender, hashes, 0)
    header = kvmesh_pb2.PageHeader(
        page_hash=page.page_hash,
        token_ids=page.token_ids,
        dtype="float32",
        shape=page.blob.shape,
        nbytes=page.blob.nbytes,
        checksum=page.blob.checksum,
    )
    data = bytes(page.blob.data)
    receiver = empty()
    bad_streams = {
        "gap": [encode_chunk(0, 0, data[:4096], header=header), encode_chunk(0, 5000, data[5000:])],
        "truncated": [encode_chunk(0, 0, data[:4096], header=header)],
        "no header": [encode_chunk(0, 0, data)],
        "garbage": [b"\xff\xff\xff"],
    }
    with ServerThread(receiver, SMALL) as server:
        channel = grpc.insecure_channel(server.address)
        stub = channel.stream_unary("/kvmesh.v1.KVWorker/PushPages")
        try:
            for name, messages in bad_streams.items():
                ticket = ((PUSH_TICKET_KEY, grant(receiver, 1).hex()),)  # decoded, then refused
                with pytest.raises(grpc.RpcError) as err:
                    stub(iter(messages), timeout=10, metadata=ticket)
                code = err.value.code()  # type: ignore[attr-defined]
                assert code == grpc.StatusCode.INVALID_ARGUMENT, name
        finally:
            channel.close()
    assert receiver.pool.cached_hashes() == set()


def test_a_page_header_that_is_not_the_page_asked_for_or_not_its_size_is_refused() -> None:
    service = empty()
    page = IncomingPage(
        PageHash(b"\x01" * 32),
        None,
        (),
        service.store.export_page(service.store.num_pages - 1, copy=True),
    )
    verify_header(page, page.page_hash, "peer")
    with pytest.raises(InvalidInput, match="asked for"):
        verify_header(page, PageHash(b"\x02" * 32), "peer")
    odd = dataclasses.replace(page, blob=dataclasses.replace(page.blob, shape=(3,)))
    with pytest.raises(PageFormatError, match="which is not"):
        verify_header(odd, page.page_hash, "peer")


def test_wrong_or_missing_token_is_unauthenticated_but_health_stays_open(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, _ = served
    secured = dataclasses.replace(SMALL, auth_token="s3cret")
    with ServerThread(sender, secured) as server:
        for token in (None, "wrong"):
            cfg = dataclasses.replace(SMALL, auth_token=token)
            with SyncPeerClient(server.address, cfg) as client:
                with pytest.raises(Unauthenticated, match="bearer token"):
                    client.lookup(hashes[:1])
                with pytest.raises(Unauthenticated):
                    client.fetch_pages(hashes[:1])
                with pytest.raises(Unauthenticated):
                    client.push_pages([], sender.grants.grant(book(sender, 1)))
                assert client.health() == "SERVING"
        with SyncPeerClient(server.address, secured) as client:
            assert client.lookup(hashes[:2]) == [True, True]


# ----------------------------------------------------------- faults and pins


def test_deadline_exceeded_on_a_slow_peer_and_its_pins_are_released(
    peer_module: tuple[ModuleType, Path],
) -> None:
    sender, hashes, _ = build(peer_module, 64, 20)
    receiver = empty()
    with ServerThread(sender, SMALL, page_delay_s=0.05) as server:
        with SyncPeerClient(server.address, SMALL) as client, pytest.raises(DeadlineExceeded):
            client.pull_into(into(receiver, 20), hashes, deadline_s=0.3)
        assert wait_until(lambda: all(c == 0 for c in sender.ref_counts()))
    got = receiver.prefix_length(hashes)
    assert 0 < got < 20
    assert receiver.lookup(hashes)[got:] == [False] * (20 - got)
    for h in hashes[:got]:
        assert page_bytes(receiver, h) == page_bytes(sender, h)


def test_a_failing_consumer_ends_the_stream_and_pins_are_released(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, server = served

    def explode(index: int, _page: IncomingPage) -> None:
        if index == 2:
            raise PageFormatError("consumer refused page 2")

    with SyncPeerClient(server.address, SMALL) as client, pytest.raises(PageFormatError):
        client.fetch_pages(hashes, on_page=explode)
    assert wait_until(lambda: all(c == 0 for c in sender.ref_counts()))


@contextlib.contextmanager
def slow_peer_process(
    peer_module: tuple[ModuleType, Path], n: int
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A peer in its own process serving `n` pages, 50 ms each (so it can be killed mid-stream)."""
    proc = subprocess.Popen(
        [sys.executable, str(peer_module[1]), str(n), "0.05"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "peer process did not start"
        yield proc, address
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_peer_killed_mid_stream_gives_a_clear_error_and_only_whole_pages(
    peer_module: tuple[ModuleType, Path],
) -> None:
    n = 40
    with slow_peer_process(peer_module, n) as (proc, address):
        expected, hashes, _ = build(peer_module, n + 8, n)
        receiver = empty(n + 8)
        received: list[int] = []
        landing = into(receiver, n)

        def insert_then_kill(index: int, page: IncomingPage) -> None:
            landing.insert_many([page])
            received.append(index)
            if len(received) == 5:
                proc.kill()

        with (
            SyncPeerClient(address, SMALL) as client,
            pytest.raises(TransportError, match=re.escape(address)) as err,
        ):
            client.fetch_pages(hashes, on_page=insert_then_kill, deadline_s=20)
        assert not isinstance(err.value, DeadlineExceeded)  # it failed fast, not at the deadline
        assert received == list(range(len(received))) and 5 <= len(received) < n
        held = receiver.lookup(hashes)
        assert held == [True] * len(received) + [False] * (n - len(received))
        for h in hashes[: len(received)]:
            assert page_bytes(receiver, h) == page_bytes(expected, h)
        assert all(c == 0 for c in receiver.ref_counts())
        receiver.check_invariants()


def test_unavailable_is_retried_for_fetches_and_lookups_but_never_for_pushes() -> None:
    sleeps: list[float] = []
    cfg = dataclasses.replace(SMALL, retries=3)
    dead = "127.0.0.1:1"  # nothing listens on port 1
    with SyncPeerClient(dead, cfg, sleep=sleeps.append) as client:
        with pytest.raises(TransportError, match=re.escape(dead)):
            client.fetch_pages([PageHash(b"\x01" * 32)], deadline_s=5)
        assert len(sleeps) == 3
        sleeps.clear()
        with pytest.raises(TransportError):
            client.lookup([PageHash(b"\x01" * 32)], deadline_s=5)
        assert len(sleeps) == 3
        sleeps.clear()
        service = empty()
        page = IncomingPage(
            PageHash(b"\x01" * 32), None, (), service.export(service.store.num_pages - 1)
        )
        with pytest.raises(TransportError):
            client.push_pages([page], b"\x00" * 16, deadline_s=5)
        assert sleeps == []


def test_backoff_is_jittered_and_grows() -> None:
    import random

    sleeps: list[float] = []
    cfg = dataclasses.replace(SMALL, retries=4, retry_backoff_s=0.1)
    client = SyncPeerClient("127.0.0.1:1", cfg, rng=random.Random(3), sleep=sleeps.append)
    with client, pytest.raises(TransportError):
        client.health(deadline_s=5)
    assert len(sleeps) == 4
    for i, s in enumerate(sleeps):
        assert 0.1 * 2**i * 0.5 <= s <= 0.1 * 2**i * 1.5


def test_a_draining_server_reports_not_serving(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    _, _, server = served
    with SyncPeerClient(server.address, SMALL) as client:
        assert client.health() == "SERVING"
        server.set_serving(False)
        assert client.health() == "NOT_SERVING"
        server.set_serving(True)
        assert client.health() == "SERVING"


def test_the_server_runs_inside_an_existing_event_loop(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, _ = served

    async def scenario() -> list[bool]:
        server = TransferServer(sender, SMALL)
        address = await server.start()
        try:
            with SyncPeerClient(address, SMALL) as client:  # its calls block: off the loop
                return await asyncio.to_thread(client.lookup, hashes[:2])
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == [True, True]


# ------------------------------------------- tuning, the fetcher, many streams

TUNED = dataclasses.replace(
    SMALL,
    grpc_frame_bytes=1 << 20,
    grpc_window_bytes=8 << 20,
    grpc_bdp_probe=False,
    grpc_read_chunk_bytes=256 << 10,
    grpc_max_read_chunk_bytes=1 << 20,
    grpc_socket_buffer_bytes=4 << 20,
)
TUNED_ARGS = {
    ("grpc.http2.max_frame_size", 1 << 20),
    ("grpc.http2.lookahead_bytes", 8 << 20),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.experimental.tcp_read_chunk_size", 256 << 10),
    ("grpc.experimental.tcp_max_read_chunk_size", 1 << 20),
    ("grpc.tcp_receive_buffer_size", 4 << 20),
}


def spy(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[set[tuple[str, Any]]]:
    """Record the options every call of `module.name` gets, and call the real one."""
    real = getattr(module, name)
    seen: list[set[tuple[str, Any]]] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        options = kwargs["options"] if "options" in kwargs else args[-1]
        seen.append({(str(k), v) for k, v in options})
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def test_tuning_settings_reach_the_server_and_the_client_channel(
    monkeypatch: pytest.MonkeyPatch,
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, _ = served
    servers = spy(monkeypatch, grpc.aio, "server")
    channels = spy(monkeypatch, grpc, "insecure_channel")
    cfg = TUNED
    receiver = empty()
    with ServerThread(sender, cfg) as server, SyncPeerClient(server.address, cfg) as client:
        assert client.pull_into(into(receiver, 24), hashes) == len(hashes)  # all of them
        assert client.lookup(hashes[:1]) == [True]
    assert servers[0] >= TUNED_ARGS
    assert len(channels) == 1  # Lookup, Health, PushPages; fetches go over grpc_wire
    for options in channels:
        assert options >= TUNED_ARGS
    for h in hashes:
        assert page_bytes(receiver, h) == page_bytes(sender, h)


def test_untuned_settings_leave_grpc_defaults(
    monkeypatch: pytest.MonkeyPatch,
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    _, hashes, server = served
    channels = spy(monkeypatch, grpc, "insecure_channel")
    with SyncPeerClient(server.address, SMALL) as client:
        assert len(client.fetch_pages(hashes).pages) == len(hashes)
    tuned_names = {name for name, _ in TUNED_ARGS}
    assert channels
    for opts in channels:
        assert not tuned_names & {name for name, _ in opts}


@pytest.mark.parametrize(
    "change",
    [
        {"grpc_frame_bytes": 1000},  # below HTTP/2's 16 KiB
        {"grpc_frame_bytes": 1 << 24},  # above 16 MiB - 1
        {"grpc_window_bytes": -1},
    ],
)
def test_impossible_tuning_is_refused_before_anything_starts(change: dict[str, Any]) -> None:
    cfg = dataclasses.replace(SMALL, **change)
    with pytest.raises(ConfigError, match="grpc_"):
        TransferServer(empty(), cfg)
    with pytest.raises(ConfigError, match="grpc_"):
        SyncPeerClient("127.0.0.1:1", cfg)


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20], ids=["two-chunk-pages", "one-chunk-pages"])
def test_the_fetcher_pulls_bit_exact_pages_over_several_streams_on_kept_connections(
    monkeypatch: pytest.MonkeyPatch, peer_module: tuple[ModuleType, Path], chunk_bytes: int
) -> None:
    sender, hashes, _ = build(peer_module, 96, 60)
    in_use = sender.pin(hashes[5:8])  # a "request" holds some of them meanwhile
    before = sender.ref_counts()
    receiver = empty(96)
    dials: list[str] = []
    real_open = WireChannel._open

    def _open(self: WireChannel, timeout: float) -> Any:
        dials.append(self.address)
        return real_open(self, timeout)

    monkeypatch.setattr(WireChannel, "_open", _open)
    cfg = dataclasses.replace(SMALL, chunk_bytes=chunk_bytes, fetch_streams=3)
    with ServerThread(sender, cfg) as server, SyncPeerClient(server.address, cfg) as client:
        assert client.pull_into(into(receiver, 60), hashes) == 60
        assert client.pull_into(into(receiver, 60), hashes) == 0  # held already: nothing new
    assert len(dials) == 3  # one connection per stream, reused by the second pull
    assert receiver.lookup(hashes) == [True] * 60
    for h in hashes:
        assert page_bytes(receiver, h) == page_bytes(sender, h)
    assert sender.ref_counts() == before
    sender.unpin(in_use)
    assert all(c == 0 for c in receiver.ref_counts())
    receiver.check_invariants()


def test_pages_are_handed_over_in_request_order_and_misses_reported(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, server = served
    unknown = PageHash(b"\x07" * 32)
    wanted = [*hashes[:10], unknown, *hashes[10:]]
    cfg = dataclasses.replace(SMALL, fetch_streams=3)
    order: list[int] = []
    with SyncPeerClient(server.address, cfg) as client:
        result = client.fetch_pages(wanted, on_page=lambda i, _p: order.append(i))
    assert order == [i for i in range(len(wanted)) if i != 10]
    assert result.missing == (unknown,) and result.received == len(hashes)
    assert all(c == 0 for c in sender.ref_counts())


def test_a_consumer_failing_in_a_multi_stream_fetch_leaves_the_server_ref_counts_as_they_were(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, _ = served
    in_use = sender.pin(hashes[:2])
    before = sender.ref_counts()
    cfg = dataclasses.replace(SMALL, fetch_streams=3)

    def refuse(index: int, _page: IncomingPage) -> None:
        if index == 4:
            raise PageFormatError("consumer refused page 4")

    with ServerThread(sender, cfg, page_delay_s=0.02) as server:
        with SyncPeerClient(server.address, cfg) as client, pytest.raises(PageFormatError):
            client.fetch_pages(hashes, on_page=refuse)
        assert wait_until(lambda: sender.ref_counts() == before)
    sender.unpin(in_use)


def test_a_deadline_in_a_multi_stream_pull_keeps_whole_pages_and_leaks_no_reservation(
    served: tuple[PageService, list[PageHash], ServerThread],
) -> None:
    sender, hashes, server = served
    before = sender.ref_counts()
    receiver = empty()
    cfg = dataclasses.replace(SMALL, fetch_streams=3)
    with ServerThread(sender, cfg, page_delay_s=0.05) as slow:
        with SyncPeerClient(slow.address, cfg) as client, pytest.raises(DeadlineExceeded):
            client.pull_into(into(receiver, 24), hashes, deadline_s=0.4)
        assert wait_until(lambda: sender.ref_counts() == before)
    got = receiver.lookup(hashes).count(True)
    assert receiver.lookup(hashes) == [True] * got + [False] * (len(hashes) - got)
    assert all(c == 0 for c in receiver.ref_counts())
    receiver.check_invariants()
    # Nothing is left "in flight": a second pull caches exactly the rest.
    with SyncPeerClient(server.address, cfg) as client:
        assert client.pull_into(into(receiver, 24), hashes) == len(hashes) - got
    for h in hashes:
        assert page_bytes(receiver, h) == page_bytes(sender, h)


def test_peer_killed_during_a_multi_stream_pull_gives_transport_error_and_only_whole_pages(
    peer_module: tuple[ModuleType, Path],
) -> None:
    n = 40
    with slow_peer_process(peer_module, n) as (proc, address):
        expected, hashes, _ = build(peer_module, n + 8, n)
        receiver = empty(n + 8)

        def kill_after_five() -> None:
            wait_until(lambda: receiver.lookup(hashes).count(True) >= 5, timeout_s=20)
            proc.kill()

        killer = threading.Thread(target=kill_after_five, daemon=True)
        cfg = dataclasses.replace(SMALL, fetch_streams=3)
        with (
            SyncPeerClient(address, cfg) as client,
            pytest.raises(TransportError, match=re.escape(address)) as err,
        ):
            killer.start()
            client.pull_into(into(receiver, n), hashes, deadline_s=20)
        killer.join(5)
        assert not isinstance(err.value, DeadlineExceeded)  # it failed fast, not at the deadline
        held = receiver.lookup(hashes)
        got = held.count(True)
        assert 5 <= got < n and held == [True] * got + [False] * (n - got)
        for h in hashes[:got]:
            assert page_bytes(receiver, h) == page_bytes(expected, h)
        assert all(c == 0 for c in receiver.ref_counts())  # no reservation left behind
        receiver.check_invariants()


def test_fetches_retry_unavailable_with_jittered_growing_backoff() -> None:
    import random

    sleeps: list[float] = []
    cfg = dataclasses.replace(SMALL, retries=3, retry_backoff_s=0.1)
    dead = "127.0.0.1:1"  # nothing listens on port 1
    with (
        SyncPeerClient(dead, cfg, rng=random.Random(5), sleep=sleeps.append) as client,
        pytest.raises(TransportError, match=re.escape(dead)),
    ):
        client.fetch_pages([PageHash(b"\x01" * 32)], deadline_s=5)
    assert len(sleeps) == 3
    for i, s in enumerate(sleeps):
        assert 0.1 * 2**i * 0.5 <= s <= 0.1 * 2**i * 1.5


def test_malloc_tuning_is_opt_in_and_applies_once_per_process() -> None:
    code = (
        "import dataclasses\n"
        "from kvmesh.config import TransferConfig\n"
        "from kvmesh.worker.grpc_tuning import tune_malloc\n"
        "off = TransferConfig()\n"
        "on = dataclasses.replace(off, grpc_malloc_tune=True)\n"
        "print(tune_malloc(off), tune_malloc(on), tune_malloc(on), tune_malloc(off))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "True", "True", "True"]  # glibc (this machine)
