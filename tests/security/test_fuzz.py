"""Hostile input: malformed protobuf and msgpack, and flipped bits in page bytes.

Every outcome must be a specific kvmesh error or gRPC status, never a crash;
the server must stay healthy and the pool / index must not change; a page
whose bytes were damaged must never be inserted or served. Raw bytes go to
the real worker server (a generic channel with identity serializers), event
bytes to the decoder, the global index and the coordinator. Example counts
are bounded so that the file runs in well under a minute.

Receivers prove pages against their own book of the prompt (`proofs`); fuzzed
pushes carry a ticket the worker granted, so that their bytes are decoded
(without one, every push stream is refused before a byte is read).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordination import WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import ChecksumMismatch, EventDecodeError, KVMeshError
from kvmesh.events import (
    AllPagesCleared,
    EventBatch,
    PagesRemoved,
    PagesStored,
    decode_batch,
    encode_batch,
    make_batch,
)
from kvmesh.hashing import NO_EXTRA, PageHasher
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash, PageId, WorkerId
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_codec import (
    PUSH_TICKET_KEY,
    SERVICE_NAME,
    decode_chunk,
    encode_chunk,
    iter_page_chunks,
    page_header,
)
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import IncomingPage, PageInfo, PageService, ProofBook
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

PAGE = 4
HELD = 4  # pages the fuzzed worker holds
CFG = TransferConfig(chunk_bytes=4096, deadline_s=5.0, retries=0, fetch_streams=1)
KV = "/" + SERVICE_NAME + "/"
HEALTH = "/grpc.health.v1.Health/"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ the worker


def make_service(num_pages: int = 16) -> PageService:
    # 8 KiB pages: two 4 KiB chunks each, so that framing across chunks is fuzzed too.
    store = KVStore(num_pages, 2, 2, 64, PAGE)
    return PageService(PagePool(num_pages, page_size=PAGE), store, PageHasher(PAGE))


def tokens_of(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 1000 for i in range(n * PAGE)]


def proofs(n: int, start: int = 0) -> ProofBook:
    """A receiver's own book of the `n`-page prompt `fill(_, n, start)` caches."""
    tokens = tokens_of(n, start)
    return ProofBook.for_pages(PageHasher(PAGE).hash_prompt(tokens), tokens, NO_EXTRA, PAGE)


def fill(service: PageService, n: int, start: int = 0) -> list[PageHash]:
    tokens = tokens_of(n, start)
    hashes = service.hasher.hash_prompt(tokens)
    pages = service.pool.get_new_pages(n)
    gen = torch.Generator().manual_seed(start)
    for page in pages:
        service.store.write_page(page.page_id, torch.randn(service.store.page_shape, generator=gen))
    service.pool.cache_full_pages(pages, hashes, 0, n, tokens)
    service.pool.free_pages(list(reversed(pages)))
    service.take_events()
    return hashes


def exported(service: PageService, page_hash: PageHash) -> IncomingPage:
    with service.pinned([page_hash]) as (pid,):
        assert pid is not None
        info = service.page_info(pid)
        blob = service.store.export_page(pid, copy=True)
    return IncomingPage(info.page_hash, info.parent_hash, info.token_ids, blob, info.lora_id)


def page_bytes(service: PageService, page_hash: PageHash) -> bytes:
    with service.pinned([page_hash]) as (pid,):
        assert pid is not None
        return bytes(service.export(pid).data)


def state(service: PageService) -> tuple[Any, ...]:
    return service.ref_counts(), service.pool.cached_hashes(), service.store.kv.clone()


def assert_unchanged(service: PageService, before: tuple[Any, ...]) -> None:
    after = state(service)
    assert after[:2] == before[:2]
    assert torch.equal(after[2], before[2])


@dataclasses.dataclass
class Worker:
    service: PageService
    hashes: list[PageHash]
    server: ServerThread
    channel: grpc.Channel
    before: tuple[Any, ...]

    def assert_healthy_and_unchanged(self) -> None:
        check = self.channel.unary_unary(HEALTH + "Check")
        assert check(b"", timeout=5) == b"\x08\x01"  # HealthCheckResponse(status=SERVING)
        lookup = self.channel.unary_unary(
            KV + "Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        assert (
            list(lookup(pb.LookupRequest(page_hashes=self.hashes), timeout=5).held) == [True] * HELD
        )
        assert_unchanged(self.service, self.before)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    service = make_service()
    hashes = fill(service, HELD)
    server = ServerThread(service, CFG)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield Worker(service, hashes, server, channel, state(service))
    finally:
        channel.close()
        server.stop()


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def assert_specific(code: grpc.StatusCode, details: str, allowed: set[grpc.StatusCode]) -> None:
    """The outcome is a status kvmesh means, or today's UNKNOWN for undecodable protobuf."""
    if code == grpc.StatusCode.UNKNOWN and "DecodeError" in details:
        return  # see test_undecodable_requests_are_invalid_argument (needs a server patch)
    assert code in allowed, (code, details)


# ------------------------------------------------------------- byte strategies


def mutations(valid: list[bytes]) -> st.SearchStrategy[bytes]:
    """Random bytes, and valid messages with a bit flipped, cut short or extended."""

    def flip(data: bytes, bit: int) -> bytes:
        if not data:
            return data
        out = bytearray(data)
        bit %= len(out) * 8
        out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)

    base = st.sampled_from(valid)
    return st.one_of(
        st.binary(max_size=300),
        st.builds(flip, base, st.integers(0, 2**20)),
        st.builds(lambda d, n: d[: n % (len(d) + 1)], base, st.integers(0, 2**20)),
        st.builds(lambda d, tail: d + tail, base, st.binary(min_size=1, max_size=40)),
    )


def lookup_requests(held: list[PageHash]) -> st.SearchStrategy[bytes]:
    hashes = st.lists(st.sampled_from(held) | st.binary(max_size=80), max_size=6)
    structured = st.builds(lambda h: pb.LookupRequest(page_hashes=h).SerializeToString(), hashes)
    valid = [pb.LookupRequest(page_hashes=held).SerializeToString()]
    return structured | mutations(valid)


def fetch_requests(held: list[PageHash]) -> st.SearchStrategy[bytes]:
    hashes = st.lists(st.sampled_from(held) | st.binary(max_size=80), max_size=6)
    structured = st.builds(
        lambda h, c: pb.FetchRequest(page_hashes=h, max_chunk_bytes=c).SerializeToString(),
        hashes,
        st.integers(0, 2**32 - 1),
    )
    valid = [pb.FetchRequest(page_hashes=held, max_chunk_bytes=4096).SerializeToString()]
    return structured | mutations(valid)


# -------------------------------------------------------- gRPC: every method


@FUZZ
@given(data=st.data())
def test_malformed_lookups_get_a_status_and_change_nothing(
    worker: Worker, data: st.DataObject
) -> None:
    raw = data.draw(lookup_requests(worker.hashes))
    call = worker.channel.unary_unary(KV + "Lookup")
    code, details = status_of(lambda: call(raw, timeout=5))
    assert_specific(code, details, {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT})
    worker.assert_healthy_and_unchanged()


@FUZZ
@given(data=st.data())
def test_malformed_fetches_get_a_status_serve_only_held_pages_and_change_nothing(
    worker: Worker, data: st.DataObject
) -> None:
    raw = data.draw(fetch_requests(worker.hashes))
    call = worker.channel.unary_stream(KV + "FetchPages")
    chunks: list[bytes] = []
    code, details = status_of(lambda: chunks.extend(call(raw, timeout=5)))
    assert_specific(code, details, {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT})
    for message in chunks:
        chunk = decode_chunk(message)
        if chunk.meta.HasField("header") and not chunk.meta.missing:
            page_hash = PageHash(chunk.meta.header.page_hash)
            assert page_hash in worker.hashes
            start = chunk.meta.offset
            assert (
                bytes(chunk.data)
                == page_bytes(worker.service, page_hash)[start:][: len(chunk.data)]
            )
    worker.assert_healthy_and_unchanged()


def _push_streams(worker: Worker) -> st.SearchStrategy[list[bytes]]:
    """Push streams built from pages the worker already holds, then mutated."""
    messages: list[bytes] = []
    for page_hash in worker.hashes[:2]:
        page = exported(worker.service, page_hash)
        info = PageInfo(PageId(0), page.page_hash, page.parent_hash, page.token_ids, None, "cpu")
        header = page_header(info, page.blob)
        messages.extend(iter_page_chunks(0, header, memoryview(page.blob.data), 4096))
    return st.lists(mutations(messages), min_size=1, max_size=3)


@FUZZ
@given(data=st.data())
def test_malformed_push_streams_are_refused_with_a_status_and_change_nothing(
    worker: Worker, data: st.DataObject
) -> None:
    stream = data.draw(_push_streams(worker))
    call = worker.channel.stream_unary(KV + "PushPages")
    reply: list[bytes] = []
    ticket = worker.service.grants.grant(proofs(HELD))  # for the pages it holds: decoded
    metadata = ((PUSH_TICKET_KEY, ticket.hex()),)
    code, details = status_of(
        lambda: reply.append(call(iter(stream), timeout=5, metadata=metadata))
    )
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS}
    assert code in allowed, (code, details)  # PushPages decodes its bytes itself: never UNKNOWN
    if code == grpc.StatusCode.OK:  # only pages it already held can pass: skipped, not written
        assert not any(pb.PushResponse.FromString(reply[0]).inserted)
    worker.assert_healthy_and_unchanged()


@FUZZ
@given(data=st.data(), ticket=st.none() | st.binary(max_size=40))
def test_any_push_stream_without_a_granted_ticket_is_permission_denied_unread(
    worker: Worker, data: st.DataObject, ticket: bytes | None
) -> None:
    """No ticket, or one the worker never granted: PERMISSION_DENIED whatever the stream
    holds, since it is refused before its first message is decoded."""
    stream = data.draw(_push_streams(worker))
    call = worker.channel.stream_unary(KV + "PushPages")
    metadata = None if ticket is None else ((PUSH_TICKET_KEY, ticket.hex()),)
    code, details = status_of(lambda: call(iter(stream), timeout=5, metadata=metadata))
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
    worker.assert_healthy_and_unchanged()


@settings(max_examples=12, deadline=None)
@given(raw=mutations([b"", b"\x0a\x12kvmesh.v1.KVWorker", b"\x0a\x07unknown"]))
def test_malformed_health_checks_and_watches_get_a_status(worker: Worker, raw: bytes) -> None:
    check = worker.channel.unary_unary(HEALTH + "Check")
    code, details = status_of(lambda: check(raw, timeout=5))
    assert_specific(code, details, {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND})
    watch = worker.channel.unary_stream(HEALTH + "Watch")
    code, details = status_of(lambda: list(watch(raw, timeout=0.2)))
    assert_specific(code, details, {grpc.StatusCode.DEADLINE_EXCEEDED})  # a watch never ends
    worker.assert_healthy_and_unchanged()


@pytest.mark.parametrize("method", [KV + "Nope", "/kvmesh.v1.Other/Lookup", "/", "x"])
def test_unknown_methods_are_unimplemented(worker: Worker, method: str) -> None:
    call = worker.channel.unary_unary(method)
    code, _ = status_of(lambda: call(b"\x0a\x01a", timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    worker.assert_healthy_and_unchanged()


@pytest.mark.parametrize("method", ["Lookup", "FetchPages"])
def test_undecodable_requests_are_invalid_argument(worker: Worker, method: str) -> None:
    def call() -> object:
        if method == "Lookup":
            return worker.channel.unary_unary(KV + method)(b"\xff\xff", timeout=5)
        return list(worker.channel.unary_stream(KV + method)(b"\xff\xff", timeout=5))

    code, _ = status_of(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------- flipped bits in page bytes


@settings(max_examples=25, deadline=None)
@given(bit=st.integers(0, 8 * 8192 - 1))
def test_a_pushed_page_with_a_flipped_bit_is_data_loss_never_inserted_never_served(
    worker: Worker, bit: int
) -> None:
    source = make_service()
    new_hashes = fill(source, 2, start=500)  # pages the worker does not hold
    page = exported(source, new_hashes[1])
    data = bytearray(page.blob.data)
    data[bit // 8] ^= 1 << (bit % 8)
    damaged = dataclasses.replace(page, blob=dataclasses.replace(page.blob, data=bytes(data)))
    with SyncPeerClient(worker.server.address, CFG) as client:
        with pytest.raises(ChecksumMismatch):  # proven (the worker granted its prompt), damaged
            client.push_pages([damaged], worker.service.grants.grant(proofs(2, start=500)))
        assert client.lookup(new_hashes) == [False, False]
        assert client.fetch_pages(new_hashes).missing == tuple(new_hashes)
    worker.assert_healthy_and_unchanged()


class TamperingProxy:
    """A man in the middle for FetchPages: forwards to `upstream`, rewrites each response."""

    def __init__(self, upstream: str) -> None:
        self.tamper: Callable[[int, bytes], bytes] = lambda _i, raw: raw
        self._upstream = grpc.insecure_channel(upstream)
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_stream_rpc_method_handler(self._fetch)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"FetchPages": handler}),)
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def _fetch(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        responses = self._upstream.unary_stream(KV + "FetchPages")(raw, timeout=5)
        for index, message in enumerate(responses):
            yield self.tamper(index, message)

    def __enter__(self) -> TamperingProxy:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)
        self._upstream.close()


@pytest.fixture(scope="module")
def proxy(worker: Worker) -> Iterator[TamperingProxy]:
    with TamperingProxy(worker.server.address) as p:
        yield p


def _pull_through(proxy: TamperingProxy, worker: Worker) -> tuple[PageService, Exception | None]:
    receiver = make_service()
    try:
        with SyncPeerClient(proxy.address, CFG) as client:
            client.pull_into(receiver.receiving(proofs(HELD)), worker.hashes)
    except KVMeshError as exc:
        return receiver, exc
    return receiver, None


def _assert_only_true_pages(receiver: PageService, worker: Worker) -> list[bool]:
    held = receiver.lookup(worker.hashes)
    for page_hash, has in zip(worker.hashes, held, strict=True):
        if has:
            assert page_bytes(receiver, page_hash) == page_bytes(worker.service, page_hash)
    assert receiver.pool.cached_hashes() <= set(worker.hashes)
    receiver.check_invariants()
    return held


@settings(max_examples=30, deadline=None)
@given(message=st.integers(0, 2 * HELD - 1), bit=st.integers(0, 8 * 4096 - 1))
def test_a_fetched_page_with_a_flipped_bit_is_checksum_mismatch_and_never_inserted(
    worker: Worker, proxy: TamperingProxy, message: int, bit: int
) -> None:
    def flip_data(index: int, raw: bytes) -> bytes:
        if index != message:
            return raw
        chunk = decode_chunk(raw)
        data = bytearray(chunk.data)
        data[bit // 8] ^= 1 << (bit % 8)
        meta = chunk.meta
        header = meta.header if meta.HasField("header") else None
        return encode_chunk(meta.page_index, meta.offset, bytes(data), header=header)

    proxy.tamper = flip_data
    receiver, error = _pull_through(proxy, worker)
    assert isinstance(error, ChecksumMismatch), error
    held = _assert_only_true_pages(receiver, worker)
    damaged = message // 2  # two chunks per page
    assert held == [True] * damaged + [False] * (HELD - damaged)  # whole pages before it only
    worker.assert_healthy_and_unchanged()


@settings(max_examples=40, deadline=None)
@given(message=st.integers(0, 2 * HELD - 1), bit=st.integers(0, 2**20))
def test_a_bit_flipped_anywhere_in_a_fetch_response_never_yields_a_wrong_page(
    worker: Worker, proxy: TamperingProxy, message: int, bit: int
) -> None:
    def flip_anywhere(index: int, raw: bytes) -> bytes:
        if index != message:
            return raw
        out = bytearray(raw)
        b = bit % (len(out) * 8)
        out[b // 8] ^= 1 << (b % 8)
        return bytes(out)

    proxy.tamper = flip_anywhere
    receiver, error = _pull_through(proxy, worker)
    held = _assert_only_true_pages(receiver, worker)
    if error is None:  # the flip hit a field nobody relies on (e.g. the tier)
        assert held == [True] * HELD
    worker.assert_healthy_and_unchanged()


# ------------------------------------------------------------- msgpack events

WORKER = WorkerId("w0")
HASH_A, HASH_B = PageHash(b"\x0a" * 32), PageHash(b"\x0b" * 32)

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=70)
)
trees = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=25,
)


def _valid_struct(seq: int) -> list[Any]:
    return [
        1.0,
        [
            ["BlockStored", [HASH_A, HASH_B], None, list(range(2 * PAGE)), PAGE, None, "cpu"],
            ["BlockRemoved", [HASH_B], None],
            ["AllBlocksCleared"],
        ],
        None,
        WORKER,
        "inc-1",
        seq,
        False,
    ]


def _paths(value: Any, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    out = [prefix]
    if isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _replace(value: Any, path: tuple[int, ...], new: Any) -> Any:
    if not path:
        return new
    copy = list(value)
    copy[path[0]] = _replace(copy[path[0]], path[1:], new)
    return copy


@st.composite
def event_bytes(draw: st.DrawFn) -> bytes:
    """Random bytes, random msgpack trees, and valid batches with one field replaced."""
    kind = draw(st.sampled_from(["bytes", "tree", "near-valid", "flip"]))
    valid = _valid_struct(draw(st.integers(0, 3)))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "tree":
        return msgpack.packb(draw(trees), use_bin_type=True)
    packed = msgpack.packb(valid, use_bin_type=True)
    if kind == "flip":
        out = bytearray(packed)
        bit = draw(st.integers(0, len(out) * 8 - 1))
        out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    path = draw(st.sampled_from(_paths(valid)))
    return msgpack.packb(_replace(valid, path, draw(trees)), use_bin_type=True)


@settings(max_examples=200, deadline=None)
@given(data=event_bytes())
def test_the_event_decoder_returns_a_batch_or_event_decode_error(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except EventDecodeError:
        return
    assert isinstance(batch, EventBatch)
    assert all(isinstance(e, PagesStored | PagesRemoved | AllPagesCleared) for e in batch.events)
    again = encode_batch(batch)  # what decodes, re-encodes to bytes that decode the same
    assert encode_batch(decode_batch(again)) == again


@pytest.mark.parametrize(
    "data",
    [
        b"\x91" * 200_000 + b"\xc0",  # arrays nested 200k deep
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4G elements
        b"\xdb\xff\xff\xff\xff",  # a string claiming 4 GiB
        b"\xc1",  # a reserved byte
        b"\x92\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00\x90",  # [NaN, []]: not a valid batch
    ],
)
def test_pathological_msgpack_is_an_event_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(data)


def _index() -> GlobalIndex:
    """An index with one registered worker holding two pages."""
    index = GlobalIndex(require_registration=True)
    index.register_worker(WORKER, "inc-1")
    stored = PagesStored((HASH_A, HASH_B), None, tuple(range(2 * PAGE)), PAGE, None, "cpu")
    index.apply_encoded(encode_batch(make_batch([stored], WORKER, "inc-1", 0)))
    return index


@settings(max_examples=100, deadline=None)
@given(data=event_bytes())
def test_the_global_index_applies_a_valid_batch_or_refuses_and_changes_nothing(
    data: bytes,
) -> None:
    index = _index()
    before = index.snapshot()
    try:
        index.apply_encoded(data)
    except KVMeshError:
        assert index.snapshot() == before
    index.check_invariants()


@settings(max_examples=100, deadline=None)
@given(data=event_bytes())
def test_the_coordinator_rejects_a_bad_report_whole_and_changes_nothing(data: bytes) -> None:
    coordinator = Coordinator(CoordinatorConfig())
    coordinator.register_worker(WorkerRegistration(WORKER, "127.0.0.1:1", 16, "inc-1"))
    good = encode_batch(make_batch([], WORKER, "inc-1", 0, snapshot=True))
    coordinator.report(WorkerReport(WORKER, [good]))
    before = (coordinator.snapshot_index(), coordinator.stats().batches_applied)
    try:
        coordinator.report(WorkerReport(WORKER, [data]))
    except EventDecodeError:
        assert (coordinator.snapshot_index(), coordinator.stats().batches_applied) == before
        assert coordinator.stats().batches_rejected == 1
    except KVMeshError as exc:  # decoded, but refused when applied
        assert not isinstance(exc, EventDecodeError)
    coordinator.index.check_invariants()


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_an_index_snapshot_that_does_not_decode_is_refused_and_changes_nothing(
    data: st.DataObject,
) -> None:
    index = _index()
    valid = index.snapshot()
    raw = data.draw(mutations([valid]) | st.builds(lambda t: msgpack.packb(t), trees))
    before = index.snapshot()
    try:
        index.restore(raw)
    except KVMeshError:
        assert index.snapshot() == before
    index.check_invariants()


@pytest.mark.parametrize("ts", [math.inf, math.nan, -math.inf])
def test_a_non_finite_batch_timestamp_is_an_event_decode_error(ts: float) -> None:
    struct = _valid_struct(0)
    struct[0] = ts
    with pytest.raises(EventDecodeError):
        decode_batch(msgpack.packb(struct, use_bin_type=True))
