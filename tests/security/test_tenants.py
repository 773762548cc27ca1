"""Tenants: `cache_salt` isolates them end to end, and an operator can bind salts to API keys.

A small in-process cluster made of the real parts: two `ServingEngine`s (real
tiny transformer, page pools, KV stores), each with its `PageService` behind a
real gRPC `TransferServer` on 127.0.0.1 with the cluster token, pulls over
`SyncPeerClient`, and one `Coordinator` fed with the workers' encoded event
batches. (The Ray client, `KVMesh`, runs the same engine and coordinator
classes; starting Ray costs ~40 s on a 2-core machine, so it is left to the
end-to-end tests.)

Every paired test also runs tenant A twice and checks a full hit (or a full
pull), so it cannot pass with caching off.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.config import CoordinatorConfig, ModelConfig, SecurityConfig, TransferConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import ConfigError, InvalidInput, Unauthenticated
from kvmesh.events import PagesRemoved, PagesStored, encode_batch, make_batch
from kvmesh.hashing import ExtraKeys, PageHasher
from kvmesh.security import TenantPolicy
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.cache_manager import KVCacheManager
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService, PullOutcome
from kvmesh.worker.peers import Peers
from kvmesh.worker.serving import (
    GenerationResult,
    PullFn,
    PullRequest,
    RouteHint,
    ServingEngine,
)
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

PAGE = 8
SEED = "tenant-test-cluster-seed"
TOKEN = "tenant-test-cluster-token-0123456789"
MODEL = ModelConfig(num_layers=2, prefill_chunk_tokens=4 * PAGE)
TRANSFER = TransferConfig(auth_token=TOKEN, chunk_bytes=4096, deadline_s=5.0, retries=0)
PROMPT = [(31 * i + 7) % MODEL.vocab_size for i in range(6 * PAGE + 1)]
REUSABLE = 6  # full pages of PROMPT a request can reuse (the last token is recomputed)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(MODEL)


@dataclass
class Node:
    """One worker: engine + page service over one pool, a gRPC server, its event stream."""

    worker_id: WorkerId
    engine: ServingEngine
    pages: PageService
    server: ServerThread
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    sent: list[bytes] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.address


class Cluster:
    """Two workers and a coordinator, wired as the Ray actors wire them."""

    def __init__(self, model: TinyTransformer) -> None:
        self.coordinator = Coordinator(CoordinatorConfig(policy="kv_aware"))
        self.hasher = PageHasher(PAGE, seed=SEED)
        self.nodes = [self._node(model, WorkerId(f"w{i}")) for i in range(2)]
        self.pulls: list[tuple[PullRequest, int]] = []
        self.expected: dict[tuple[int, ...], list[int]] = {}

    def _node(self, model: TinyTransformer, wid: WorkerId) -> Node:
        lock = threading.RLock()
        pool = PagePool(64, page_size=PAGE)
        store = KVStore(64, MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, PAGE)
        hasher = PageHasher(PAGE, seed=SEED)
        engine = ServingEngine(
            model, KVCacheManager(pool, PAGE), store, hasher, worker_id=wid, lock=lock
        )
        pages = PageService(pool, store, hasher, lock=lock)
        server = ServerThread(pages, TRANSFER)
        server.start()
        node = Node(wid, engine, pages, server)
        self.coordinator.register_worker(
            WorkerRegistration(wid, node.address, 63, node.incarnation)
        )
        self._report(node, [], snapshot=True)
        return node

    def _report(self, node: Node, events: Sequence[object], *, snapshot: bool = False) -> None:
        batch = encode_batch(
            make_batch(events, node.worker_id, node.incarnation, node.seq, snapshot=snapshot)  # type: ignore[arg-type]
        )
        node.seq += 1
        node.sent.append(batch)
        result = self.coordinator.report(WorkerReport(node.worker_id, [batch]))
        assert not result.needs_snapshot

    def flush(self, node: Node) -> list[object]:
        events = node.engine.take_events()
        node.pages.observe(events)
        if events:
            self._report(node, events)
        return list(events)

    def pull_fn(self, node: Node) -> PullFn:
        """Pull as a worker does: from the peer over gRPC, into `node`'s pool through its
        `PageService`, each page proven against the request being served."""

        def pull(ask: PullRequest) -> PullOutcome:
            peers = Peers(TRANSFER)
            try:
                receiver = node.pages.receiving(ask.proofs(PAGE))
                outcome = peers.get(ask.peer).pull_into(receiver, ask.page_hashes)
            finally:
                peers.close()
            self.pulls.append((ask, outcome.inserted))
            return outcome

        return pull

    def hashes(self, tokens: Sequence[int], salt: str | None) -> list[PageHash]:
        return self.hasher.hash_prompt(tokens, ExtraKeys(cache_salt=salt))

    def serve(
        self, node: Node, tokens: Sequence[int], salt: str | None, hint: RouteHint | None = None
    ) -> GenerationResult:
        result = node.engine.serve(
            uuid.uuid4().hex,
            tokens,
            2,
            extra_keys=ExtraKeys(cache_salt=salt),
            hint=hint or RouteHint(),
            pull_fn=self.pull_fn(node),
        )
        self.flush(node)
        key = tuple(tokens)
        if key not in self.expected:  # a salt changes identity, never the answer
            self.expected[key] = node.engine.compute_from_scratch(tokens, 2)
        assert list(result.tokens) == self.expected[key]
        return result

    def routed(self, tokens: Sequence[int], salt: str | None) -> tuple[Node, GenerationResult]:
        """Route through the coordinator and serve where it says, with its pull hint."""
        d = self.coordinator.route(
            RouteQuery(self.hashes(tokens, salt), len(tokens), page_size=PAGE, allow_pull=True)
        )
        node = self.node(d.worker_id)
        peer = self.node(d.peer_id).address if d.peer_id is not None and d.peer_pages else None
        hint = RouteHint(d.local_pages, d.peer_pages if peer else 0, peer)
        return node, self.serve(node, tokens, salt, hint)

    def node(self, worker_id: str) -> Node:
        return next(n for n in self.nodes if n.worker_id == worker_id)

    def close(self) -> None:
        for n in self.nodes:
            n.server.stop()


@pytest.fixture
def cluster(model: TinyTransformer) -> Iterator[Cluster]:
    c = Cluster(model)
    try:
        yield c
    finally:
        c.close()


# ---------------------------------------------------------------- paired tests


def test_tenant_b_gets_no_hit_and_no_pull_from_tenant_a_but_a_gets_all(cluster: Cluster) -> None:
    w0, w1 = cluster.nodes
    first = cluster.serve(w0, PROMPT, "tenant-a")
    assert (first.pages_hit_local, first.pages_pulled) == (0, 0)

    # The coordinator sees nothing of B's prompt anywhere.
    d = cluster.coordinator.route(
        RouteQuery(cluster.hashes(PROMPT, "tenant-b"), len(PROMPT), page_size=PAGE, allow_pull=True)
    )
    assert (d.local_pages, d.peer_pages) == (0, 0)
    _, b = cluster.routed(PROMPT, "tenant-b")
    assert (b.pages_hit_local, b.pages_pulled, b.pages_computed) == (0, 0, REUSABLE + 1)
    # Even told to pull everything from A's worker, or served on it, B gets nothing.
    pulls_before = len(cluster.pulls)
    forced = cluster.serve(w1, PROMPT, "tenant-b2", RouteHint(0, REUSABLE, w0.address))
    assert (forced.pages_hit_local, forced.pages_pulled) == (0, 0)
    assert [got for _, got in cluster.pulls[pulls_before:]] == [0]  # asked, and got no page
    on_a = cluster.serve(w0, PROMPT, "tenant-b3")
    assert (on_a.pages_hit_local, on_a.pages_pulled) == (0, 0)

    # The control: A again hits in full where its pages are, and pulls them in full elsewhere.
    assert cluster.serve(w0, PROMPT, "tenant-a").pages_hit_local == REUSABLE
    d = cluster.coordinator.route(
        RouteQuery(cluster.hashes(PROMPT, "tenant-a"), len(PROMPT), page_size=PAGE, allow_pull=True)
    )
    assert d.local_pages + d.peer_pages == REUSABLE
    pulled = cluster.serve(w1, PROMPT, "tenant-a", RouteHint(0, REUSABLE, w0.address))
    assert (pulled.pages_hit_local, pulled.pages_pulled) == (0, REUSABLE)


def test_requests_without_a_salt_are_a_tenant_of_their_own(cluster: Cluster) -> None:
    w0, _ = cluster.nodes
    cluster.serve(w0, PROMPT, None)
    assert cluster.serve(w0, PROMPT, "tenant-a").pages_hit_local == 0
    assert cluster.serve(w0, PROMPT, None).pages_hit_local == REUSABLE
    assert cluster.serve(w0, PROMPT, "").pages_hit_local == 0  # "" is a salt, not "no salt"


# -------------------------------------------------------- API-key-bound salts


KEYS = {"key-of-tenant-a-0001": "salt-a", "key-of-tenant-b-0001": "salt-b"}


def test_with_bound_keys_a_salt_sent_by_the_client_is_ignored(cluster: Cluster) -> None:
    w0, _ = cluster.nodes
    policy = TenantPolicy(KEYS)

    def serve(api_key: str, requested: str | None) -> GenerationResult:
        return cluster.serve(w0, PROMPT, policy.resolve_salt(api_key, requested))

    assert serve("key-of-tenant-a-0001", None).pages_hit_local == 0
    # B asks for A's salt: it gets its own, hence nothing of A.
    assert serve("key-of-tenant-b-0001", "salt-a").pages_hit_local == 0
    # A, whatever salt it sends, is always A.
    assert serve("key-of-tenant-a-0001", "salt-b").pages_hit_local == REUSABLE
    assert serve("key-of-tenant-a-0001", "anything").pages_hit_local == REUSABLE


def test_without_bound_keys_the_requested_salt_decides(cluster: Cluster) -> None:
    w0, _ = cluster.nodes
    open_policy = TenantPolicy()
    assert not open_policy.bound
    cluster.serve(w0, PROMPT, open_policy.resolve_salt(None, "salt-a"))
    # This is why an operator binds keys: whoever knows a salt is that tenant.
    assert (
        cluster.serve(w0, PROMPT, open_policy.resolve_salt("any", "salt-a")).pages_hit_local
        == REUSABLE
    )


@pytest.mark.parametrize("api_key", [None, "", "key-of-tenant-c-0001", "key-of-tenant-a-0002"])
def test_a_missing_or_unknown_key_is_unauthenticated(api_key: str | None) -> None:
    with pytest.raises(Unauthenticated):
        TenantPolicy(KEYS).resolve_salt(api_key, "salt-a")


def test_a_salt_of_the_wrong_type_is_invalid_input() -> None:
    for policy in (TenantPolicy(), TenantPolicy(KEYS)):
        with pytest.raises(InvalidInput):
            policy.resolve_salt("key-of-tenant-a-0001", 42)  # type: ignore[arg-type]


def test_the_policy_keeps_no_keys_and_prints_none() -> None:
    policy = TenantPolicy(KEYS)
    assert policy.bound and len(policy) == 2
    shown = repr(policy) + str(policy)
    assert not any(k in shown or s in shown for k, s in KEYS.items())
    assert not any(k.encode() in bytes_ for k in KEYS for bytes_ in policy._salts)


def test_the_key_map_loads_from_json_yaml_and_the_environment(tmp_path: Path) -> None:
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps(KEYS))
    as_yaml = tmp_path / "keys.yaml"
    as_yaml.write_text("api_keys:\n" + "".join(f"  {k}: {v}\n" for k, v in KEYS.items()))
    policies = [
        TenantPolicy.from_file(as_json),
        TenantPolicy.from_file(as_yaml),
        TenantPolicy.from_env({"KVMESH_API_KEYS_FILE": str(as_yaml)}),
        TenantPolicy.from_env({"KVMESH_API_KEYS": json.dumps(KEYS)}),
        TenantPolicy.from_env({}, SecurityConfig(api_keys_file=str(as_json))),
    ]
    for policy in policies:
        assert policy.resolve_salt("key-of-tenant-b-0001", "salt-a") == "salt-b"
    assert not TenantPolicy.from_env({}).bound


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("list.json", "[1, 2]"),
        ("broken.json", "{"),
        ("number.yaml", "api_keys: 3"),
        ("empty-salt.json", '{"k": ""}'),
        ("int-salt.yaml", "k: 5"),
        ("python.yaml", "!!python/object/apply:os.system ['true']"),
    ],
)
def test_a_bad_key_file_is_a_config_error(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError):
        TenantPolicy.from_file(path)


def test_ambiguous_or_missing_key_sources_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep one"):
        TenantPolicy.from_env({"KVMESH_API_KEYS_FILE": "x.json", "KVMESH_API_KEYS": "{}"})
    with pytest.raises(ConfigError, match="cannot read"):
        TenantPolicy.from_file(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="JSON"):
        TenantPolicy.from_env({"KVMESH_API_KEYS": "{nope"})


# ---------------------------------------------- reaching A's pages by hash


@settings(max_examples=80, deadline=None)
@given(
    a=st.lists(st.integers(0, 255), min_size=PAGE, max_size=5 * PAGE),
    b=st.lists(st.integers(0, 255), min_size=PAGE, max_size=5 * PAGE),
    salt_a=st.text(max_size=6),
    salt_b=st.none() | st.text(max_size=6),
)
def test_two_tenants_page_identities_never_meet_whatever_their_prompts(
    a: list[int], b: list[int], salt_a: str, salt_b: str | None
) -> None:
    if salt_b == salt_a:
        salt_b = None
    hasher = PageHasher(PAGE, seed=SEED)
    mine = hasher.hash_prompt(a, ExtraKeys(cache_salt=salt_a))
    theirs = hasher.hash_prompt(b, ExtraKeys(cache_salt=salt_b))
    assert not set(mine) & set(theirs)


def test_another_tenants_pages_cannot_be_reached_by_hash_through_any_api(
    cluster: Cluster,
) -> None:
    w0, w1 = cluster.nodes
    cluster.serve(w0, PROMPT, "tenant-a")
    a_hashes = cluster.hashes(PROMPT, "tenant-a")[:REUSABLE]
    # Everything B can compute: its own salt, no salt, salts it guesses.
    guesses = [cluster.hashes(PROMPT, s)[:REUSABLE] for s in ("tenant-b", None, "", "a", "tenant")]
    b_hashes = [h for g in guesses for h in g]
    assert not set(b_hashes) & set(a_hashes)

    # route and match (coordinator)
    for g in guesses:
        d = cluster.coordinator.route(RouteQuery(g, len(PROMPT), page_size=PAGE, allow_pull=True))
        assert (d.local_pages, d.peer_pages) == (0, 0)
    assert cluster.coordinator.match(b_hashes).pages == {}
    assert cluster.coordinator.match(a_hashes).pages == {w0.worker_id: REUSABLE}

    # Lookup and FetchPages (worker gRPC), as a cluster member holding the token
    for node in (w0, w1):
        with SyncPeerClient(node.address, TRANSFER) as client:
            assert client.lookup(b_hashes) == [False] * len(b_hashes)
            fetched = client.fetch_pages(b_hashes)
            assert (fetched.pages, len(fetched.missing)) == ((), len(b_hashes))
    assert all(c == 0 for c in w0.pages.ref_counts())

    # events: A's batches name only A's pages, B's only B's, and B's leave A's index alone
    stored = {
        h
        for data in w0.sent
        for ev in _decode(data)
        if isinstance(ev, PagesStored)
        for h in ev.page_hashes
    }
    assert stored == set(cluster.hashes(PROMPT, "tenant-a"))
    cluster.serve(w1, PROMPT, "tenant-b")
    named = {
        h
        for data in w1.sent
        for ev in _decode(data)
        if isinstance(ev, PagesStored | PagesRemoved)
        for h in ev.page_hashes
    }
    assert named and not named & stored
    assert cluster.coordinator.match(a_hashes).pages == {w0.worker_id: REUSABLE}


@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token-wrong-token"])
def test_a_leaked_raw_hash_is_refused_to_a_caller_outside_the_cluster(
    cluster: Cluster, token: str | None
) -> None:
    """The worker gRPC API is cluster-internal: its bearer token (and mTLS) guard raw hashes."""
    w0, _ = cluster.nodes
    cluster.serve(w0, PROMPT, "tenant-a")
    leaked = cluster.hashes(PROMPT, "tenant-a")[:REUSABLE]
    outsider = TransferConfig(auth_token=token, deadline_s=5.0, retries=0)
    with SyncPeerClient(w0.address, outsider) as client:
        with pytest.raises(Unauthenticated):
            client.lookup(leaked)
        with pytest.raises(Unauthenticated):
            client.fetch_pages(leaked)
    assert all(c == 0 for c in w0.pages.ref_counts())


def _decode(data: bytes) -> tuple[object, ...]:
    from kvmesh.events import decode_batch

    return decode_batch(data).events


def test_the_client_hashes_with_the_salt_bound_to_the_api_key() -> None:
    from kvmesh.client import KVMesh
    from kvmesh.config import ClusterConfig

    mesh = KVMesh(
        ClusterConfig(),
        None,
        {},
        owns_ray=False,
        created=[],
        retries=0,
        pull=False,
        request_timeout_s=1.0,
        ray_address="",
        tenants=TenantPolicy(KEYS),
    )
    tokens = list(range(40))
    expected = mesh.hasher.hash_prompt(tokens, ExtraKeys(cache_salt="salt-b"))
    assert mesh.hashes(tokens, "salt-a", api_key="key-of-tenant-b-0001") == expected
    with pytest.raises(Unauthenticated):
        mesh.hashes(tokens, "salt-a", api_key=None)
