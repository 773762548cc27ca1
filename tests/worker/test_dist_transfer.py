"""torch.distributed page transfer over real gloo process groups on 127.0.0.1.

Two-rank scenarios run in spawned processes (rank 0 pulls, rank 1 serves);
each rank writes what it saw to a JSON file that the tests read. One process
pair runs all the scenarios that leave the group usable (round trips,
rejections, pushes with good and bad tickets); a peer that dies and a peer
that hangs get a pair each. Every pull proves its pages against the puller's
own book (`proofs_of`, from the test's tokens); a push is taken against the
grant whose ticket the receiving rank handed over (through a file).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from worker_kit import proofs_for

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, InvalidInput, TransportError, UnknownWorker
from kvmesh.hashing import NO_EXTRA, PageHasher
from kvmesh.rendezvous import DistRendezvous, assign_ranks
from kvmesh.types import PageHash, PageId, WorkerId
from kvmesh.worker.dist_group import DistGroup, free_port
from kvmesh.worker.dist_transport import DistPageTransport
from kvmesh.worker.dist_wire import (
    DTYPE_CODES,
    Kind,
    Preamble,
    ReceiveResult,
    WirePage,
    decode_page_meta,
    encode_page_meta,
    plan_batches,
)
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService, ProofBook

PAGE = 4
SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
DTYPES = ("float16", "bfloat16", "float32")
N_PAGES = 40
SEED = "dist-test"
UNKNOWN = PageHash(b"\x01" * 32)
CORRUPT_AT = 5
PAIR_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------- helpers


def make_service(dtype: str = "float32", num_pages: int = 64) -> PageService:
    pool = PagePool(num_pages, page_size=PAGE)
    store = KVStore(num_pages, page_size=PAGE, dtype=dtype, **SHAPE)
    return PageService(pool, store, PageHasher(PAGE, seed=SEED))


def tokens_for(n: int, start: int) -> list[int]:
    return [(start + 3 * i) % 251 for i in range(n * PAGE)]


def page_data(store: KVStore, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *store.page_shape), generator=gen).to(store.dtype)


def fill(service: PageService, n: int, seed: int) -> list[PageHash]:
    """Cache `n` pages of seeded random KV under a real hash chain (as a worker would)."""
    tokens = tokens_for(n, seed)
    hashes = service.hasher.hash_prompt(tokens)
    pool, store = service.pool, service.store
    pages = pool.get_new_pages(n)
    store.write_pages([p.page_id for p in pages], page_data(store, n, seed))
    pool.cache_full_pages(pages, hashes, 0, n, tokens)
    pool.free_pages(list(reversed(pages)))
    service.take_events()
    return hashes


def pull(
    transport: DistPageTransport, hashes: list[PageHash], proofs: ProofBook
) -> ReceiveResult:
    """Pull from rank 1 into the transport's own service, proven against `proofs`."""
    return transport.pull(1, hashes, transport.service.receiving(proofs))


def hashes_for(n: int, seed: int) -> list[PageHash]:
    return PageHasher(PAGE, seed=SEED).hash_prompt(tokens_for(n, seed))


def proofs_of(n: int, seed: int) -> ProofBook:
    """The receiver's own proofs of the `n` pages `fill(_, n, seed)` caches on the sender."""
    return proofs_for(PageHasher(PAGE, seed=SEED), tokens_for(n, seed))


def mixed_order(hashes: list[PageHash]) -> list[PageHash]:
    """The first half in order (consecutive pages: sent in place), the rest reversed (gathered)."""
    half = len(hashes) // 2
    return hashes[:half] + hashes[half:][::-1]


def bytes_match(service: PageService, hashes: list[PageHash], expected: torch.Tensor) -> list[bool]:
    """For each hash: cached here with exactly the expected page's bytes."""
    out = []
    with service.pinned(hashes) as ids:
        for i, pid in enumerate(ids):
            if pid is None:
                out.append(False)
                continue
            got = service.store.read_page(pid).view(-1).view(torch.uint8)
            want = expected[i].reshape(-1).view(torch.uint8)
            out.append(bool(torch.equal(got, want)))
    return out


class CorruptingTransport(DistPageTransport):
    """Damages the checksum of the page at send position `CORRUPT_AT` (bytes and sum disagree)."""

    sent = 0

    def _checksums(self, page_ids: Any) -> torch.Tensor:
        sums = super()._checksums(page_ids).clone()
        n = len(page_ids)
        if self.sent <= CORRUPT_AT < self.sent + n:
            sums[CORRUPT_AT - self.sent] ^= 0x10
        self.sent += n
        return sums


class DyingTransport(DistPageTransport):
    """Exits the process when it starts its third batch (the first two are on the wire)."""

    batches = 0

    def _checksums(self, page_ids: Any) -> torch.Tensor:
        self.batches += 1
        if self.batches == 3:
            time.sleep(0.5)  # let the kernel deliver what is already sent
            os._exit(3)
        return super()._checksums(page_ids)


LAYOUTS = {"batch": 1 << 40, "pages": 1}
"""Sender `page_message_bytes` per layout: never one message per page / always."""


def page_bytes(dtype: str) -> int:
    return make_service(dtype, 2).store.page_nbytes


# --------------------------------------------------------------------------- scenarios


def exchange_server(ctx: PairContext) -> dict[str, Any]:
    with ctx.join(0) as group:
        return _exchange_server(group, ctx)


def exchange_client(ctx: PairContext) -> dict[str, Any]:
    with ctx.join(0) as group:
        return _exchange_client(group, ctx)


def _exchange_server(group: DistGroup, ctx: PairContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout, message_bytes in LAYOUTS.items():
        for seed, dtype in enumerate(DTYPES):
            service = make_service(dtype)
            fill(service, N_PAGES, seed)
            before = service.ref_counts()
            nbytes = page_bytes(dtype)
            transport = DistPageTransport(
                group,
                service,
                batch_bytes=3 * nbytes,
                min_in_place_bytes=4 * nbytes,
                page_message_bytes=message_bytes,
                timeout_s=20,
            )
            out[f"served_{layout}_{dtype}"] = transport.serve_forever(0, idle_timeout_s=60)
            out[f"refs_restored_{layout}_{dtype}"] = service.ref_counts() == before
    # push: eight float32 pages to rank 0, under the ticket rank 0 granted
    service = make_service("float32")
    hashes = fill(service, N_PAGES, 10)
    transport = DistPageTransport(group, service, batch_bytes=3 * page_bytes("float32"))
    ticket, fresh = (bytes.fromhex(t) for t in ctx.read("push-tickets").split())
    pushed = transport.push(0, [*hashes[:8], UNKNOWN], ticket)
    out["pushed"] = len(pushed.sent)
    out["push_missing"] = [h.hex() for h in pushed.missing]
    out["push_ack"] = [pushed.stored, pushed.refused]
    # the same ticket again (used up), then the same pages under a fresh one
    reused = transport.push(0, hashes[8:12], ticket)
    out["reused_ack"] = [len(reused.sent), reused.stored, reused.refused]
    again = transport.push(0, hashes[8:12], fresh)
    out["again_ack"] = [len(again.sent), again.stored, again.refused]
    # a page corrupted on the way, in each layout
    for message_bytes in LAYOUTS.values():
        service = make_service("float32")
        fill(service, N_PAGES, 11)
        corrupting = CorruptingTransport(
            group,
            service,
            batch_bytes=3 * page_bytes("float32"),
            page_message_bytes=message_bytes,
        )
        corrupting.serve_forever(0, idle_timeout_s=60)
    # pages of another dtype than the receiver's store
    service = make_service("float16")
    fill(service, 6, 12)
    DistPageTransport(group, service).serve_forever(0, idle_timeout_s=60)
    # pages the puller's book proves only in part
    service = make_service("float32")
    fill(service, 6, 13)
    DistPageTransport(group, service).serve_forever(0, idle_timeout_s=60)
    return out


def _exchange_client(group: DistGroup, ctx: PairContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        for seed, dtype in enumerate(DTYPES):
            service = make_service(dtype)
            transport = DistPageTransport(group, service, timeout_s=20)
            hashes = mixed_order(hashes_for(N_PAGES, seed))
            ask = [*hashes, UNKNOWN, hashes[3]]  # a hash it lacks, a hash twice
            proofs = proofs_of(N_PAGES, seed)
            result = pull(transport, ask, proofs)
            transport.hang_up(1)
            order = {h: i for i, h in enumerate(hashes_for(N_PAGES, seed))}
            expected = page_data(service.store, N_PAGES, seed)[[order[h] for h in hashes]]
            out[f"{layout}_{dtype}"] = {
                "inserted": sorted(h.hex() for h in result.inserted),
                "present": [h.hex() for h in result.present],
                "wanted": sorted(h.hex() for h in hashes),
                "twice": hashes[3].hex(),
                "missing": [h.hex() for h in result.missing],
                "rejected": len(result.rejected),
                "bit_exact": all(bytes_match(service, hashes, expected)),
                "cached": len(service.pool.cached_hashes()),
                "refs": sorted(set(service.ref_counts())),
            }
            service.check_invariants()
    # push: grant two tickets for the prompt's pages and hand them to the pusher
    service = make_service("float32")
    transport = DistPageTransport(group, service)
    tickets = [service.grants.grant(proofs_of(N_PAGES, 10)) for _ in range(2)]
    ctx.write("push-tickets", " ".join(t.hex() for t in tickets))
    result = transport.receive_push(1)
    hashes = hashes_for(N_PAGES, 10)
    expected = page_data(service.store, N_PAGES, 10)
    out["push"] = {
        "inserted": len(result.inserted),
        "bit_exact": all(bytes_match(service, hashes[:8], expected[:8])),
    }
    before = (service.pool.cached_hashes(), service.ref_counts(), service.store.kv.clone())
    reused = transport.receive_push(1)  # the used ticket: every page received and refused
    after = (service.pool.cached_hashes(), service.ref_counts(), service.store.kv)
    out["reused"] = {
        "rejected": [why for _, why in reused.rejected],
        "cached": len(reused.cached),
        "pool_unchanged": after[:2] == before[:2] and bool(torch.equal(after[2], before[2])),
    }
    again = transport.receive_push(1)  # the link still works: the fresh ticket is taken
    out["again"] = {
        "inserted": len(again.inserted),
        "bit_exact": all(bytes_match(service, hashes[8:12], expected[8:12])),
        "refs": sorted(set(service.ref_counts())),
    }
    # corrupted page
    for layout in LAYOUTS:
        service = make_service("float32")
        transport = DistPageTransport(group, service)
        hashes = hashes_for(N_PAGES, 11)
        result = pull(transport, hashes, proofs_of(N_PAGES, 11))
        transport.hang_up(1)
        expected = page_data(service.store, N_PAGES, 11)
        cached = service.pool.cached_hashes()
        good = [h for i, h in enumerate(hashes) if i != CORRUPT_AT]
        out[f"corrupt_{layout}"] = {
            "rejected": [(h.hex(), why) for h, why in result.rejected],
            "bad_hash": hashes[CORRUPT_AT].hex(),
            "bad_cached": hashes[CORRUPT_AT] in cached,
            "others_cached": all(h in cached for h in good),
            "others_exact": all(
                bytes_match(service, good, expected[[i for i in range(N_PAGES) if i != CORRUPT_AT]])
            ),
            "cached_count": len(cached),
            "refs": sorted(set(service.ref_counts())),
        }
        service.check_invariants()
    # wrong dtype
    service = make_service("float32")
    transport = DistPageTransport(group, service)
    result = pull(transport, hashes_for(6, 12), proofs_of(6, 12))
    transport.hang_up(1)
    out["wrong_dtype"] = {
        "rejected": [why for _, why in result.rejected],
        "cached": len(service.pool.cached_hashes()),
    }
    # a book that proves the first three pages only
    service = make_service("float32", num_pages=8)
    fill(service, 7, 50)  # the puller's own cached pages, in every page the pool has
    own = service.pool.cached_hashes()
    transport = DistPageTransport(group, service)
    hashes = hashes_for(6, 13)
    half = ProofBook.for_pages(hashes[:3], tokens_for(6, 13), NO_EXTRA, PAGE)
    result = pull(transport, hashes, half)
    transport.hang_up(1)
    cached = service.pool.cached_hashes()
    out["half_proven"] = {
        "inserted": [h.hex() for h in result.inserted],
        "rejected": [(h.hex(), why) for h, why in result.rejected],
        "wanted": [h.hex() for h in hashes],
        "own_left": len(own & cached),
        "refs": sorted(set(service.ref_counts())),
    }
    service.check_invariants()
    return out


def faults_server(ctx: PairContext) -> dict[str, Any]:
    with ctx.join(0):  # first group: joined, but never serves until rank 0 timed out
        ctx.wait_flag("timed-out")
    group = ctx.join(1)
    service = make_service("float32")
    fill(service, N_PAGES, 20)
    transport = DyingTransport(
        group, service, batch_bytes=4 * page_bytes("float32"), page_message_bytes=1
    )
    transport.serve_forever(0, idle_timeout_s=60)  # exits the process mid-transfer
    return {"unexpected": "the dying server returned"}


def faults_client(ctx: PairContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with ctx.join(0) as group:
        service = make_service("float32")
        transport = DistPageTransport(group, service, timeout_s=1.5)
        try:
            pull(transport, hashes_for(4, 30), proofs_of(4, 30))
            error = None
        except TransportError as exc:
            error = str(exc)
        out["hang"] = {"error": error, "cached": len(service.pool.cached_hashes())}
        ctx.set_flag("timed-out")
    group = ctx.join(1)
    service = make_service("float32")
    transport = DistPageTransport(group, service, timeout_s=60)
    hashes = hashes_for(N_PAGES, 20)
    t0 = time.monotonic()
    try:
        pull(transport, hashes, proofs_of(N_PAGES, 20))
        error = None
    except TransportError as exc:
        error = str(exc)
    elapsed = time.monotonic() - t0
    cached = [h for h in hashes if h in service.pool.cached_hashes()]
    expected = page_data(service.store, N_PAGES, 20)[: len(cached)]
    try:
        pull(transport, hashes, proofs_of(N_PAGES, 20))
        again = None
    except TransportError as exc:
        again = str(exc)
    service.check_invariants()
    out["die"] = {
        "error": error,
        "elapsed": elapsed,
        "timeout": transport.timeout_s,
        "cached_prefix": cached == hashes[: len(cached)],
        "cached": len(cached),
        "cached_exact": all(bytes_match(service, cached, expected)),
        "again": again,
        "refs": sorted(set(service.ref_counts())),
    }
    return out


class PairContext:
    """What a rank of a spawned pair knows: its rank, the groups' ports, a folder to talk through."""

    def __init__(self, rank: int, ports: list[int], out_dir: Path) -> None:
        self.rank, self.ports, self.out_dir = rank, ports, out_dir

    def join(self, i: int) -> DistGroup:
        return DistGroup.init(self.rank, 2, "127.0.0.1", self.ports[i], timeout_s=60)

    def set_flag(self, name: str) -> None:
        (self.out_dir / name).touch()

    def write(self, name: str, text: str) -> None:
        """Hand `text` to the other rank (whole: written aside, then renamed)."""
        part = self.out_dir / f"{name}.part"
        part.write_text(text)
        os.replace(part, self.out_dir / name)

    def read(self, name: str) -> str:
        self.wait_flag(name)
        return (self.out_dir / name).read_text()

    def wait_flag(self, name: str, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while not (self.out_dir / name).exists():
            if time.monotonic() > end:
                raise TimeoutError(f"flag {name} never came")
            time.sleep(0.05)


SCENARIOS: dict[str, tuple[Callable[[PairContext], dict[str, Any]], ...]] = {
    "exchange": (exchange_client, exchange_server),
    "faults": (faults_client, faults_server),
}


def _rank_main(rank: int, scenario: str, ports: list[int], out_dir: str) -> None:
    out = Path(out_dir) / f"{scenario}-{rank}.json"
    try:
        result = SCENARIOS[scenario][rank](PairContext(rank, ports, Path(out_dir)))
        out.write_text(json.dumps(result))
    except BaseException:
        out.write_text(json.dumps({"crash": traceback.format_exc()}))
    os._exit(0)  # skip interpreter teardown: a broken gloo group may block it


def run_pair(
    scenario: str, out_dir: Path, *, only_rank0: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a scenario on two spawned ranks; returns what each wrote (missing: {}).

    `only_rank0`: rank 1 is killed as soon as rank 0 is done (it dies or hangs anyway).
    """
    ctx = multiprocessing.get_context("spawn")
    ports = [free_port(), free_port()]
    procs = [
        ctx.Process(target=_rank_main, args=(rank, scenario, ports, str(out_dir)), daemon=True)
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + PAIR_TIMEOUT_S
    for p in procs[:1] if only_rank0 else procs:
        p.join(max(0.1, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = []
    for rank in (0, 1):
        path = out_dir / f"{scenario}-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    for rank, res in enumerate(results):
        assert "crash" not in res, f"rank {rank} crashed:\n{res['crash']}"
    return results[0], results[1]


@pytest.fixture(scope="module")
def exchange(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    return run_pair("exchange", tmp_path_factory.mktemp("exchange"))


# --------------------------------------------------------------------------- two ranks


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pulled_pages_are_bit_exact_in_every_dtype(exchange: Any, dtype: str, layout: str) -> None:
    client, server = exchange
    got = client[f"{layout}_{dtype}"]
    assert got["inserted"] == got["wanted"]
    assert got["rejected"] == 0
    assert got["bit_exact"] is True
    assert got["cached"] == N_PAGES
    assert server[f"served_{layout}_{dtype}"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_hash_the_peer_lacks_is_reported_missing_not_an_error(exchange: Any, layout: str) -> None:
    for dtype in DTYPES:
        assert exchange[0][f"{layout}_{dtype}"]["missing"] == [UNKNOWN.hex()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_sent_twice_is_cached_once_and_reported_present(exchange: Any, layout: str) -> None:
    for dtype in DTYPES:
        got = exchange[0][f"{layout}_{dtype}"]
        assert got["present"] == [got["twice"]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pins_and_reserved_pages_are_released_on_both_sides(exchange: Any, layout: str) -> None:
    client, server = exchange
    for dtype in DTYPES:
        assert client[f"{layout}_{dtype}"]["refs"] == [0]
        assert server[f"refs_restored_{layout}_{dtype}"] is True


def test_pushed_pages_are_inserted_bit_exact_and_acknowledged(exchange: Any) -> None:
    client, server = exchange
    assert server["pushed"] == 8
    assert server["push_ack"] == [8, 0]  # push returned after the receiver held all 8
    assert server["push_missing"] == [UNKNOWN.hex()]
    assert client["push"] == {"inserted": 8, "bit_exact": True}


def test_a_push_under_a_used_ticket_is_received_every_page_refused_and_the_link_stays(
    exchange: Any,
) -> None:
    """The bytes of a push follow its meta whatever the ticket, so the receiver takes them
    into spare buffers and refuses every page (the ack says so); the pool is untouched and
    the next push on the same link, under a live ticket, is taken."""
    client, server = exchange
    assert server["reused_ack"] == [4, 0, 4]  # sent, stored, refused
    got = client["reused"]
    assert got["cached"] == 0 and got["pool_unchanged"] is True
    assert len(got["rejected"]) == 4
    assert all("HashMismatch" in why for why in got["rejected"])
    assert server["again_ack"] == [4, 4, 0]
    assert client["again"] == {"inserted": 4, "bit_exact": True, "refs": [0]}


def test_a_pulled_page_the_pullers_book_cannot_prove_is_rejected_and_evicts_nothing(
    exchange: Any,
) -> None:
    got = exchange[0]["half_proven"]
    assert got["inserted"] == got["wanted"][:3]
    assert [h for h, _ in got["rejected"]] == got["wanted"][3:]
    assert all("HashMismatch" in why for _, why in got["rejected"])
    assert got["own_left"] == 7 - 3  # three evicted for the three proven pages, no more
    assert got["refs"] == [0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_corrupted_page_is_rejected_and_the_rest_are_inserted(exchange: Any, layout: str) -> None:
    got = exchange[0][f"corrupt_{layout}"]
    assert [h for h, _ in got["rejected"]] == [got["bad_hash"]]
    assert "ChecksumMismatch" in got["rejected"][0][1]
    assert got["bad_cached"] is False
    assert got["others_cached"] is True
    assert got["others_exact"] is True
    assert got["cached_count"] == N_PAGES - 1
    assert got["refs"] == [0]


def test_pages_of_another_dtype_are_rejected_with_a_format_error(exchange: Any) -> None:
    got = exchange[0]["wrong_dtype"]
    assert len(got["rejected"]) == 6
    assert all("PageFormatError" in why for why in got["rejected"])
    assert got["cached"] == 0


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    client, _ = run_pair("faults", tmp_path_factory.mktemp("faults"), only_rank0=True)
    return client


def test_a_peer_that_dies_mid_transfer_raises_transport_error_keeping_valid_pages(
    faults: dict[str, Any],
) -> None:
    got = faults["die"]
    assert got["error"] is not None
    assert "rank 1" in got["error"]
    assert "Timed out" not in got["error"]  # the closed connection, not the timeout
    assert got["elapsed"] < got["timeout"]
    assert 0 < got["cached"] < N_PAGES
    assert got["cached"] % 4 == 0  # whole batches only
    assert got["cached_prefix"] is True
    assert got["cached_exact"] is True
    assert got["again"] is not None and "broken" in got["again"]
    assert got["refs"] == [0]


def test_a_peer_that_never_answers_raises_transport_error_after_the_timeout(
    faults: dict[str, Any],
) -> None:
    got = faults["hang"]
    assert got["error"] is not None
    assert "Timed out" in got["error"]
    assert "limit 1.5s" in got["error"]
    assert got["cached"] == 0


def _join_slowly_and_leave(port: int, joined: Any) -> None:
    """Rank 1, whose group object takes a second longer to exist than its connection."""
    from kvmesh.worker import dist_group

    gloo = dist_group.GROUP_FACTORIES["gloo"]

    def slow(*args: Any) -> Any:
        pg = gloo(*args)
        time.sleep(1.0)
        joined.set()
        return pg

    dist_group.GROUP_FACTORIES["gloo"] = slow
    DistGroup.init(1, 2, "127.0.0.1", port, timeout_s=90).close()


def test_a_failed_rendezvous_does_not_spoil_the_next_one() -> None:
    with pytest.raises(TransportError, match="rendezvous"):
        DistGroup.init(0, 2, "127.0.0.1", free_port(), timeout_s=0.5)  # nobody comes
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    joined = spawn.Event()
    peer = spawn.Process(target=_join_slowly_and_leave, args=(port, joined), daemon=True)
    peer.start()
    try:
        group = DistGroup.init(0, 2, "127.0.0.1", port, timeout_s=90)
        # init returns only once the peer's group exists too, so closing at
        # once cannot break the peer's half-finished join (a CI run saw it)
        assert joined.is_set()
        group.close()
    finally:
        peer.join(90)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0


# --------------------------------------------------------------------------- pure parts


def test_ranks_follow_sorted_worker_ids() -> None:
    ids = [WorkerId("w-2"), WorkerId("w-0"), WorkerId("w-1")]
    assert assign_ranks(ids) == {"w-0": 0, "w-1": 1, "w-2": 2}
    assert assign_ranks(reversed(ids)) == assign_ranks(ids)


def test_duplicate_or_no_worker_ids_are_refused() -> None:
    with pytest.raises(InvalidInput, match="duplicates"):
        assign_ranks([WorkerId("a"), WorkerId("a")])
    with pytest.raises(InvalidInput, match="at least one"):
        assign_ranks([])


def test_rendezvous_names_ranks_and_refuses_gaps() -> None:
    rdv = DistRendezvous.for_workers([WorkerId("b"), WorkerId("a")], "127.0.0.1", 29500)
    assert (rdv.world_size, rdv.rank_of(WorkerId("b")), rdv.worker_of(0)) == (2, 1, "a")
    with pytest.raises(UnknownWorker):
        rdv.rank_of(WorkerId("zzz"))
    with pytest.raises(InvalidInput, match="ranks must be exactly"):
        DistRendezvous("127.0.0.1", 29500, 2, {WorkerId("a"): 0, WorkerId("b"): 2})
    with pytest.raises(InvalidInput, match="master_port"):
        DistRendezvous("127.0.0.1", 0, 1)


def test_group_init_refuses_impossible_arguments() -> None:
    with pytest.raises(ConfigError, match="rank"):
        DistGroup.init(2, 2, "127.0.0.1", free_port())
    with pytest.raises(ConfigError, match=r"no torch\.distributed backend"):
        DistGroup.init(0, 1, "127.0.0.1", free_port(), device="meta")


def test_preamble_round_trips() -> None:
    pre = Preamble(Kind.PAGES, 7, DTYPE_CODES["bfloat16"], (2, 2, 4, 2, 8), 123, 3)
    assert Preamble.decode(pre.encode(), max_batch_bytes=1 << 20) == pre
    assert pre.page_nbytes == 2 * 2 * 4 * 2 * 8 * 2


@pytest.mark.parametrize(
    ("words", "why"),
    [
        ({0: 42}, "magic"),
        ({2: 9}, "unknown kind"),
        ({4: 99}, "unknown dtype"),
        ({13: 1 << 20}, "exceeds"),
        ({3: -1}, "count"),
        ({14: 7}, "unknown payload layout"),
    ],
)
def test_a_garbled_preamble_is_a_transport_error(words: dict[int, int], why: str) -> None:
    t = Preamble(Kind.PAGES, 4, DTYPE_CODES["float32"], (2, 2, 4, 2, 8), 10, 2).encode()
    for index, value in words.items():
        t[index] = value
    with pytest.raises(TransportError, match=why):
        Preamble.decode(t, max_batch_bytes=1 << 20)


def test_page_meta_round_trips_and_refuses_garbage() -> None:
    page = WirePage(PageHash(b"h" * 32), None, (1, 2, 3, 4), 7, "cpu")
    raw = encode_page_meta([page], [PageHash(b"m" * 32)], [1])
    assert decode_page_meta(raw, 1, 1) == ([page], [PageHash(b"m" * 32)], [1], b"")
    pushed = encode_page_meta([page], [], [1], b"t" * 16)
    assert decode_page_meta(pushed, 1, 1) == ([page], [], [1], b"t" * 16)
    for ticket in (b"t" * 65, "text"):  # a ticket is at most 64 bytes, and bytes
        meta = msgpack.packb([[], [], [], ticket], use_bin_type=True)
        with pytest.raises(InvalidInput, match="push ticket"):
            decode_page_meta(meta, 0, 1)
    with pytest.raises(InvalidInput, match="preamble"):
        decode_page_meta(raw, 2, 1)
    with pytest.raises(InvalidInput, match="malformed"):
        decode_page_meta(b"\xc1garbage", 1, 1)
    with pytest.raises(InvalidInput, match="batch sizes"):
        decode_page_meta(encode_page_meta([page], [], [5]), 1, 1)


def test_batches_send_long_runs_in_place_and_gather_the_rest() -> None:
    ids = [PageId(i) for i in (10, 11, 12, 13, 14, 3, 7, 8, 20, 21, 22)]
    assert plan_batches(ids, 4, 3) == [
        (0, 4, True),  # 10..13
        (4, 1, True),  # 14, the rest of the run
        (5, 3, False),  # 3, 7, 8 gathered (runs shorter than 3)
        (8, 3, True),  # 20..22
    ]
    assert plan_batches(ids, 2, 100) == [
        (0, 2, False),
        (2, 2, False),
        (4, 2, False),
        (6, 2, False),
        (8, 2, False),
        (10, 1, False),
    ]
    assert plan_batches([], 4, 1) == []


def test_transport_takes_its_settings_from_the_transfer_config() -> None:
    group = DistGroup(0, 2, "gloo", torch.device("cpu"), 1.0)  # never joined: only read
    config = TransferConfig(dist_batch_bytes=8 << 20, dist_depth=6, dist_timeout_s=7.0)
    transport = DistPageTransport.from_config(group, make_service(), config)
    assert (transport.batch_bytes, transport.depth, transport.timeout_s) == (8 << 20, 6, 7.0)


def test_transport_refuses_a_store_on_another_device_than_the_group() -> None:
    group = DistGroup(0, 2, "nccl", torch.device("cuda"), 1.0)  # never joined: only checked
    with pytest.raises(ConfigError, match="device"):
        DistPageTransport(group, make_service())
