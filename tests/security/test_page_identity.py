"""Page identity: SHA-256 over a fixed encoding with a cluster seed, and no poisoning by claims.

tests/kvmesh/test_hashing.py pins chaining, extra keys and one cross-process
hash; this file adds the security side: the encoding is exactly the documented
one, every kind of page hashes alike in fresh processes, different seeds
never share an identity, and a page whose token ids do not hash to the hash
it claims never enters a pool, whether it is inserted directly, pushed over
gRPC, or pulled from a lying peer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.config import TransferConfig
from kvmesh.errors import HashMismatch, InvalidInput, PermissionDenied
from kvmesh.events import PagesStored
from kvmesh.hashing import NO_EXTRA, ExtraKeys, MultiModalInput, PageHasher
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_codec import SERVICE_NAME, iter_page_chunks, page_header
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import NO_PROOFS, IncomingPage, PageService, ProofBook
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

PAGE = 4
SEED = "identity-test-seed"
CFG = TransferConfig(chunk_bytes=4096, deadline_s=5.0, retries=0)

tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=PAGE, max_size=6 * PAGE)
seed_st = st.text(min_size=0, max_size=12)
salt_st = st.none() | st.text(min_size=1, max_size=8)


# ------------------------------------------------------------------- helpers


def make_service(seed: str = SEED, num_pages: int = 16) -> PageService:
    pool = PagePool(num_pages, page_size=PAGE)
    return PageService(pool, KVStore(num_pages, 1, 2, 4, PAGE), PageHasher(PAGE, seed=seed))


def fill(service: PageService, tokens: list[int], keys: ExtraKeys = NO_EXTRA) -> list[PageHash]:
    """Cache the full pages of `tokens` with distinct random KV, as a worker would."""
    hashes = service.hasher.hash_prompt(tokens, keys)
    pages = service.pool.get_new_pages(len(hashes))
    gen = torch.Generator().manual_seed(len(tokens))
    for page in pages:
        service.store.write_page(page.page_id, torch.randn(service.store.page_shape, generator=gen))
    service.pool.cache_full_pages(pages, hashes, 0, len(hashes), tokens, keys.lora_id)
    service.pool.free_pages(list(reversed(pages)))
    service.take_events()
    return hashes


def exported(service: PageService, hashes: list[PageHash], i: int) -> IncomingPage:
    """Page `i` as its holder would send it (bytes, proof tokens, parent)."""
    with service.pinned([hashes[i]]) as (pid,):
        assert pid is not None
        info = service.page_info(pid)
        blob = service.store.export_page(pid, copy=True)
    return IncomingPage(info.page_hash, info.parent_hash, info.token_ids, blob, info.lora_id)


def state(service: PageService) -> tuple[Any, ...]:
    return service.ref_counts(), service.pool.cached_hashes(), service.store.kv.clone()


def assert_unchanged(service: PageService, before: tuple[Any, ...]) -> None:
    after = state(service)
    assert after[:2] == before[:2]
    assert torch.equal(after[2], before[2])


def page_bytes(service: PageService, page_hash: PageHash) -> bytes:
    with service.pinned([page_hash]) as (pid,):
        assert pid is not None
        return bytes(service.export(pid).data)


# -------------------------------------------------------------- the encoding


def _documented_hash(parent: bytes, tokens: list[int], extra: Any) -> bytes:
    data = parent + struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens)
    if extra is not None:
        data += msgpack.packb(extra, use_bin_type=True)
    return hashlib.sha256(data).digest()


def test_the_page_hash_is_sha256_of_the_documented_canonical_encoding() -> None:
    hasher = PageHasher(PAGE, seed=SEED)
    root = hashlib.sha256(b"kvmesh-root\x00" + SEED.encode()).digest()
    assert hasher.root_hash == root
    tokens = [0, 1, 255, 2**32 - 1, 7, 8, 9, 10]
    plain = hasher.hash_prompt(tokens)
    first = _documented_hash(root, tokens[:4], None)
    assert plain == [first, _documented_hash(first, tokens[4:], None)]
    salted = hasher.hash_prompt(tokens, ExtraKeys(cache_salt="tenant"))
    first = _documented_hash(root, tokens[:4], [None, [], "tenant"])
    assert salted == [first, _documented_hash(first, tokens[4:], None)]  # salt: first page only
    lora = hasher.hash_prompt(tokens, ExtraKeys(lora_id=3))
    first = _documented_hash(root, tokens[:4], [3, [], None])
    assert lora == [first, _documented_hash(first, tokens[4:], [3, [], None])]


CASES_SCRIPT = """
import json
from kvmesh.hashing import ExtraKeys, MultiModalInput, PageHasher


def cases():
    out = []
    for algo in ("sha256", "xxh3_128"):
        for seed in ("cluster-a", "cluster-b", ""):
            h = PageHasher(4, seed=seed, algo=algo)
            toks = [(i * 37) % 300 for i in range(23)]
            for keys in (
                ExtraKeys(),
                ExtraKeys(cache_salt="tenant-a"),
                ExtraKeys(lora_id=7),
                ExtraKeys(mm_inputs=(MultiModalInput("img-1", 5, 6),), cache_salt="t"),
            ):
                out.append([x.hex() for x in h.hash_prompt(toks, keys)])
    return out


if __name__ == "__main__":
    print(json.dumps(cases()))
"""


def test_every_kind_of_page_hashes_alike_in_fresh_processes_whatever_their_hash_seed(
    tmp_path: Path,
) -> None:
    script = tmp_path / "identity_cases.py"
    script.write_text(CASES_SCRIPT)
    runs = [
        subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            timeout=60,
        ).stdout
        for seed in ("1", "2")
    ]
    spec = importlib.util.spec_from_file_location("kvmesh_identity_cases", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.cases()
    assert json.loads(runs[0]) == json.loads(runs[1]) == expected
    assert len({tuple(x) for x in expected}) == len(expected)  # every case its own identity


@settings(max_examples=60, deadline=None)
@given(seed_a=seed_st, seed_b=seed_st, tokens_a=tokens_st, tokens_b=tokens_st, salt=salt_st)
def test_different_seeds_give_disjoint_identities_for_any_prompts(
    seed_a: str, seed_b: str, tokens_a: list[int], tokens_b: list[int], salt: str | None
) -> None:
    if seed_a == seed_b:
        seed_b += "'"
    keys = ExtraKeys(cache_salt=salt)
    a = PageHasher(PAGE, seed=seed_a).hash_prompt(tokens_a, keys)
    b = PageHasher(PAGE, seed=seed_b).hash_prompt(tokens_b, keys)
    assert not set(a) & set(b)  # no page of one cluster is ever a page of the other
    assert PageHasher(PAGE, seed=seed_a).hash_prompt(tokens_a, keys) == a


# ------------------------------------------------------------ direct inserts

perturbation_st = st.sampled_from(["token", "parent", "lora", "root-parent"])


@settings(max_examples=40, deadline=None)
def book(
    service: PageService, tokens: list[int], keys: ExtraKeys = NO_EXTRA
) -> ProofBook:
    """The receiver's own proofs for a prompt it serves (its hasher, its tokens and keys)."""
    hashes = service.hasher.hash_prompt(tokens, keys)
    return ProofBook.for_pages(hashes, tokens, keys, PAGE)


@given(
    tokens=st.lists(st.integers(0, 999), min_size=3 * PAGE, max_size=3 * PAGE),
    how=perturbation_st,
    where=st.integers(0, PAGE - 1),
)
def test_a_page_the_receivers_request_does_not_hash_to_is_refused(
    tokens: list[int], how: str, where: int
) -> None:
    victim = make_service()
    hashes = fill(victim, tokens)
    page = exported(victim, hashes, 2)
    receiver = make_service()
    honest = book(receiver, tokens)
    proof = honest.get(hashes[2])
    assert proof is not None
    wrong = {
        "token": dataclasses.replace(
            proof,
            token_ids=tuple(t + 1 if i == where else t for i, t in enumerate(proof.token_ids)),
        ),
        "parent": dataclasses.replace(proof, parent_hash=hashes[0]),
        "lora": dataclasses.replace(proof, extra=(where, (), None)),
        "root-parent": dataclasses.replace(proof, parent_hash=None),
    }[how]
    before = state(receiver)
    with pytest.raises(HashMismatch, match="do not hash"):
        receiver.insert_many([page], ProofBook({hashes[2]: wrong}))
    assert_unchanged(receiver, before)
    assert receiver.insert_many([page], honest) == [True]  # the receiver's own proof holds


def test_what_a_sender_claims_about_a_page_is_never_its_proof() -> None:
    tokens = list(range(3 * PAGE))
    sender = make_service()
    hashes = fill(sender, tokens)
    honest = exported(sender, hashes, 1)
    receiver = make_service()
    # Proof-less (no tokens) and lying claims alike: without the receiver's proof, refused.
    for claim in (
        dataclasses.replace(honest, token_ids=()),
        dataclasses.replace(honest, token_ids=(7,) * PAGE, parent_hash=None),
        honest,
    ):
        with pytest.raises(HashMismatch, match="not a page of a request"):
            receiver.insert_many([claim], NO_PROOFS)
    assert receiver.pool.cached_hashes() == set()
    # With it, the page is cached with the receiver's parent and tokens, whatever was claimed.
    lying = dataclasses.replace(honest, token_ids=(7,) * PAGE, parent_hash=None, lora_id=3)
    assert receiver.insert_many([lying], book(receiver, tokens)) == [True]
    (stored,) = [e for e in receiver.take_events() if isinstance(e, PagesStored)]
    assert stored.page_hashes == (hashes[1],)
    assert stored.parent_hash == hashes[0]
    assert stored.token_ids == tuple(tokens[PAGE : 2 * PAGE])
    assert stored.lora_id is None


@pytest.mark.parametrize(
    "keys",
    [
        ExtraKeys(cache_salt="tenant-a"),
        ExtraKeys(mm_inputs=(MultiModalInput("img-1", 1, 2),)),
        ExtraKeys(lora_id=4, cache_salt="tenant-a"),
    ],
    ids=["salted", "media", "lora+salt"],
)
def test_salted_and_media_pages_prove_like_any_other(keys: ExtraKeys) -> None:
    tokens = list(range(2 * PAGE))
    sender = make_service()
    hashes = fill(sender, tokens, keys)
    first = exported(sender, hashes, 0)
    receiver = make_service()
    before = state(receiver)
    # A receiver serving the same prompt without the salt / media cannot prove the page ...
    with pytest.raises(HashMismatch):
        receiver.insert_many([first], book(receiver, tokens))
    assert_unchanged(receiver, before)
    # ... nor can one serving it with another salt; with the request's own keys it can.
    with pytest.raises(HashMismatch):
        receiver.insert_many([first], book(receiver, tokens, ExtraKeys(cache_salt="other")))
    assert receiver.insert_many([first], book(receiver, tokens, keys)) == [True]


def test_a_page_from_another_cluster_is_refused_whatever_its_position() -> None:
    tokens = list(range(3 * PAGE))
    other_cluster = make_service(seed="other-cluster")
    hashes = fill(other_cluster, tokens)
    receiver = make_service(seed=SEED)
    own = book(receiver, tokens)
    assert not set(own.hashes) & set(hashes)  # the seed enters through the root
    before = state(receiver)
    for i in range(3):
        with pytest.raises(HashMismatch):
            receiver.insert_many([exported(other_cluster, hashes, i)], own)
    assert_unchanged(receiver, before)


def test_a_forged_page_never_overwrites_a_page_already_held() -> None:
    tokens = list(range(2 * PAGE))
    holder = make_service()
    hashes = fill(holder, tokens)
    original = page_bytes(holder, hashes[1])
    store = holder.store
    zeros = PageBlob.from_bytes(bytes(len(original)), store.dtype_name, store.page_shape)
    proven = IncomingPage(hashes[1], hashes[0], (), zeros)
    assert holder.insert_many([proven], book(holder, tokens)) == [False]  # held: never rewritten
    with pytest.raises(HashMismatch):
        holder.insert_many([proven], book(holder, [9] * 2 * PAGE))
    assert page_bytes(holder, hashes[1]) == original


# ------------------------------------------------------------- over real gRPC


@pytest.fixture(scope="module")
def victim() -> tuple[PageService, list[PageHash], list[int]]:
    service = make_service(num_pages=32)
    tokens = [(5 * i) % 97 for i in range(6 * PAGE)]
    return service, fill(service, tokens), tokens


def test_a_push_without_a_grant_is_refused_and_the_held_page_is_still_served_intact(
    victim: tuple[PageService, list[PageHash], list[int]],
) -> None:
    service, hashes, _ = victim
    attacker = make_service()
    attacker_hashes = fill(attacker, [200 + i for i in range(6 * PAGE)])
    own = exported(attacker, attacker_hashes, 3)
    forged_new = dataclasses.replace(own, page_hash=PageHash(b"\x42" * 32))  # not held yet
    forged_held = dataclasses.replace(own, page_hash=hashes[3], parent_hash=hashes[2])
    proofless = dataclasses.replace(own, page_hash=hashes[3], token_ids=())
    original = page_bytes(service, hashes[3])
    before = state(service)
    with ServerThread(service, CFG) as server, SyncPeerClient(server.address, CFG) as client:
        for forged in (forged_new, forged_held, proofless):
            with pytest.raises(PermissionDenied, match="grant"):
                client.push_pages([forged], b"")
            with pytest.raises(PermissionDenied, match="ticket"):
                client.push_pages([forged], b"\x00" * 16)
        # A grant for another request admits none of these pages.
        ticket = service.grants.grant(book(service, [300 + i for i in range(2 * PAGE)]))
        with pytest.raises(HashMismatch):
            client.push_pages([forged_new], ticket)
        assert_unchanged(service, before)
        fetched = client.fetch_pages([hashes[3]]).pages
    assert bytes(fetched[0].blob.data) == original


class RoguePeer:
    """A gRPC KVWorker that answers FetchPages with pages `forge` rewrites (a lying peer)."""

    def __init__(self, source: PageService, forge: Callable[[IncomingPage], IncomingPage]) -> None:
        self.source = source
        self.forge = forge
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_stream_rpc_method_handler(
            self._fetch, request_deserializer=pb.FetchRequest.FromString
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"FetchPages": handler}),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def _fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        hashes = [PageHash(h) for h in request.page_hashes]
        for index, page_hash in enumerate(hashes):
            page = self.forge(exported(self.source, hashes, index))
            with self.source.pinned([page_hash]) as (pid,):
                assert pid is not None
                info = dataclasses.replace(
                    self.source.page_info(pid),
                    page_hash=page.page_hash,
                    parent_hash=page.parent_hash,
                    token_ids=page.token_ids,
                    lora_id=page.lora_id,
                )
            yield from iter_page_chunks(
                index, page_header(info, page.blob), memoryview(page.blob.data), 4096
            )

    def __enter__(self) -> RoguePeer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)


@pytest.mark.parametrize(
    "forge",
    [
        lambda p: dataclasses.replace(p, token_ids=tuple(t ^ 1 for t in p.token_ids)),
        lambda p: dataclasses.replace(p, parent_hash=None),
        lambda p: dataclasses.replace(p, lora_id=5),
        lambda p: dataclasses.replace(p, token_ids=()),
    ],
    ids=["tokens of another prompt", "another parent", "a LoRA", "no tokens"],
)
def test_pages_pulled_from_a_lying_peer_are_cached_with_the_receivers_own_proof(
    victim: tuple[PageService, list[PageHash], list[int]],
    forge: Callable[[IncomingPage], IncomingPage],
) -> None:
    source, hashes, tokens = victim
    receiver = make_service(num_pages=32)
    wanted = hashes[1:4]
    proofs = ProofBook.for_pages(
        wanted, tokens[PAGE : 4 * PAGE], NO_EXTRA, PAGE, first_page=1, parent=hashes[0]
    )
    with RoguePeer(source, forge) as rogue, SyncPeerClient(rogue.address, CFG) as client:
        assert client.pull_into(receiver.receiving(proofs), wanted) == 3
    stored = [e for e in receiver.take_events() if isinstance(e, PagesStored)]
    got = {h: (e.parent_hash, e.token_ids) for e in stored for h in e.page_hashes}
    assert got[hashes[1]] == (hashes[0], tuple(tokens[PAGE : 2 * PAGE]))
    assert all(page_bytes(receiver, h) == page_bytes(source, h) for h in wanted)


def test_a_page_other_than_the_one_asked_for_is_refused_and_the_pool_is_unchanged(
    victim: tuple[PageService, list[PageHash], list[int]],
) -> None:
    source, hashes, tokens = victim
    receiver = make_service(num_pages=32)
    before = state(receiver)
    proofs = book(receiver, tokens)
    swap = lambda p: dataclasses.replace(p, page_hash=PageHash(bytes(32)))  # noqa: E731
    with (
        RoguePeer(source, swap) as rogue,
        SyncPeerClient(rogue.address, CFG) as client,
        pytest.raises(InvalidInput),
    ):
        client.pull_into(receiver.receiving(proofs), hashes[1:4])
    assert_unchanged(receiver, before)


def test_an_honest_peer_through_the_same_rogue_harness_is_accepted(
    victim: tuple[PageService, list[PageHash], list[int]],
) -> None:
    source, hashes, tokens = victim
    receiver = make_service(num_pages=32)
    proofs = book(receiver, tokens)
    with RoguePeer(source, lambda p: p) as honest, SyncPeerClient(honest.address, CFG) as client:
        assert client.pull_into(receiver.receiving(proofs), hashes) == len(hashes)
    assert all(page_bytes(receiver, h) == page_bytes(source, h) for h in hashes)
