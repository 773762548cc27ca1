"""`kvmesh bench transfer`: page transfer GB/s between two worker processes on loopback.

Two processes on 127.0.0.1: a *peer* (spawned) holding ``--pages`` cached
pages of ``--page-bytes`` each, and this process, the *puller*, with an empty
pool of its own (a real `PagePool` + `KVStore` + `PageService`). Each
transport moves all the pages from the peer into the puller's pool:

- ``tcp``: the baseline. A plain socket: the peer ``sendall``\\s the same
  bytes straight from its KV tensor, the puller ``recv_into``\\s its own KV
  tensor. No framing, no checks, no pool: the ceiling of the machine.
- ``grpc``: `SyncPeerClient.pull_into` against the peer's `TransferServer`
  (chunked FetchPages streams, each page checked, proven against the
  puller's own `ProofBook` of the prompt, and inserted). Both
  processes take their `TransferConfig` from ``KVMESH_*`` variables, then the
  ``--grpc-*`` flags (``--grpc-malloc-tune``: the opt-in allocator tuning).
  One fetch engine (`kvmesh.worker.transfer_client.PageFetcher`): pooled
  connections, each page read from the socket straight into its pool page.
- ``dist``: `DistPageTransport.pull` over a gloo process group of the two
  (batched tensors, each page checked, proven and inserted).

Timed: from the pull's start until every page is in the puller's pool (for
tcp: until the last byte is in its KV tensor). The pool is emptied between
rounds; each transport runs ``--rounds`` times after one warm-up, the
transports taking turns within a round. Three figures per transport, all
from the same run:

- ``ratio_vs_tcp``: its best round's GB/s / tcp's best round's GB/s (the
  machine is shared; the best is the least disturbed);
- ``median_ratio_vs_tcp``: the median over rounds of tcp's time / its time
  *in the same round*, so that load which comes and goes during the run
  touches both sides of each ratio alike;
- ``puller_cpu_s_per_gib`` / ``peer_cpu_s_per_gib``: the CPU time (every
  thread, user and system) each process spent per GiB moved, the mean over
  rounds. Under load the GB/s move with others' work; the CPU a transport
  costs per byte moves much less, and on a machine where both ends share the
  cores it is what bounds the rate.

The 1-minute load average before and after the run is printed with the
figures: on a shared machine, other work competes for the same cores.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvmesh.arguments import positive_float, positive_int

DEFAULT_PAGES = 256
DEFAULT_PAGE_BYTES = 4 * 1024 * 1024
PAGE_SIZE = 16
SEED = "bench-transfer"
CPU_QUERY = b"cpu"
"""Asks the peer for its CPU time so far (`time.process_time`, all threads)."""
TRANSPORT_CHOICES = ("grpc", "dist", "both")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=positive_int, default=DEFAULT_PAGES, help="pages to move")
    parser.add_argument(
        "--page-bytes",
        type=positive_int,
        default=DEFAULT_PAGE_BYTES,
        help="bytes per page (float16; a multiple of 64)",
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORT_CHOICES,
        default="both",
        help="transports to measure next to the raw TCP baseline",
    )
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds per transport")
    parser.add_argument(
        "--batch-bytes",
        type=positive_int,
        default=None,
        help="dist: largest payload tensor per send (default: the transport's)",
    )
    parser.add_argument(
        "--gather",
        action="store_true",
        help="dist: gather every batch into one buffer (no in-place runs, no per-page messages)",
    )
    parser.add_argument(
        "--grpc-streams", type=positive_int, default=None, help="grpc: concurrent streams"
    )
    parser.add_argument(
        "--grpc-chunk-bytes", type=positive_int, default=None, help="grpc: page bytes per message"
    )
    parser.add_argument(
        "--grpc-malloc-tune",
        action="store_true",
        help="grpc: TransferConfig.grpc_malloc_tune in both processes (glibc keeps freed "
        "transfer buffers mapped; process-wide, off by default)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0, help="seconds for any one step"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per transport (tcp first)"
    )


@dataclass(frozen=True, slots=True)
class Spec:
    """What both processes agree on (sent to the peer as JSON)."""

    pages: int
    page_bytes: int
    rounds: int
    timeout_s: float
    dist_port: int
    use_dist: bool
    use_grpc: bool
    grpc_streams: int | None
    grpc_chunk_bytes: int | None
    grpc_malloc_tune: bool
    batch_bytes: int | None
    gather: bool

    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of a float16 page of `page_bytes` and PAGE_SIZE tokens."""
        per_token_pair = 2 * PAGE_SIZE * 2  # K and V, PAGE_SIZE tokens, 2 bytes
        if self.page_bytes % (per_token_pair * 8 * 128) == 0:
            return self.page_bytes // (per_token_pair * 8 * 128), 8, 128
        return 1, 1, self.page_bytes // per_token_pair


@dataclass(frozen=True, slots=True)
class Figure:
    """One transport's best round."""

    transport: str
    gb_per_s: float
    pages_per_s: float
    ratio_vs_tcp: float
    seconds: float
    median_gb_per_s: float
    pages: int
    page_bytes: int
    bytes: int
    rounds: int
    detail: str
    load_before: float = 0.0
    """The machine's 1-minute load average when the run started (others' work competes)."""
    load_after: float = 0.0
    median_ratio_vs_tcp: float = 0.0
    """Median over rounds of tcp's time / this transport's time in the same round."""
    puller_cpu_s_per_gib: float = 0.0
    """CPU seconds (all threads) the pulling process spent per GiB, mean over rounds."""
    peer_cpu_s_per_gib: float = 0.0
    """CPU seconds (all threads) the serving peer spent per GiB, mean over rounds."""


# --------------------------------------------------------------------------- both sides


def _make_service(spec: Spec) -> Any:
    from kvmesh.hashing import PageHasher
    from kvmesh.worker.kv_store import KVStore
    from kvmesh.worker.page_pool import PagePool
    from kvmesh.worker.page_service import PageService

    layers, heads, dim = spec.shape()
    num_pages = spec.pages + 1  # page 0 is the null page
    store = KVStore(num_pages, layers, heads, dim, PAGE_SIZE, "float16")
    store.kv.zero_()  # fault the memory in now, not inside a timed round
    pool = PagePool(num_pages, page_size=PAGE_SIZE)
    return PageService(pool, store, PageHasher(PAGE_SIZE, seed=SEED))


def _page_rows(store: Any) -> Any:
    """The store's bytes as a numpy array [num_pages, page_nbytes] (a view, CPU only)."""
    import torch

    return store.kv.view(store.num_pages, -1).view(torch.uint8).numpy()


def _tokens(spec: Spec) -> list[int]:
    return [(i * 7 + 3) % 32000 for i in range(spec.pages * PAGE_SIZE)]


def _transfer_config(spec: Spec) -> Any:
    """Both processes' `TransferConfig`: defaults, then ``KVMESH_*`` variables, then flags."""
    from kvmesh.config import TransferConfig, from_env

    extra: dict[str, Any] = {}
    if spec.grpc_streams is not None:
        extra["fetch_streams"] = spec.grpc_streams
    if spec.grpc_chunk_bytes is not None:
        extra["chunk_bytes"] = spec.grpc_chunk_bytes
        extra["max_message_bytes"] = max(
            TransferConfig().max_message_bytes, spec.grpc_chunk_bytes + (1 << 20)
        )
    if spec.grpc_malloc_tune:
        extra["grpc_malloc_tune"] = True
    return from_env(TransferConfig, host="127.0.0.1", port=0, deadline_s=spec.timeout_s, **extra)


def _dist_transport(group: Any, service: Any, spec: Spec) -> Any:
    from kvmesh.worker.dist_transport import DistPageTransport

    kwargs: dict[str, Any] = {"timeout_s": spec.timeout_s}
    if spec.batch_bytes is not None:
        kwargs["batch_bytes"] = spec.batch_bytes
        kwargs["max_batch_bytes"] = max(spec.batch_bytes, 1 << 30)
    if spec.gather:  # every batch gathered into a buffer: no page messages, no runs in place
        kwargs["min_in_place_bytes"] = 1 << 62
        kwargs["page_message_bytes"] = 1 << 62
    return DistPageTransport(group, service, **kwargs)


# --------------------------------------------------------------------------- the peer


def _peer_main(conn: Any, spec_json: str) -> None:
    """The spawned peer: holds the pages and serves them over tcp, grpc and dist."""
    import numpy as np

    from kvmesh.worker.dist_group import DistGroup
    from kvmesh.worker.transfer_server import ServerThread

    spec = Spec(**json.loads(spec_json))
    service = _make_service(spec)
    store, pool = service.store, service.pool
    # Distinct bytes per page: one random page, each copy stamped with its index.
    rng = np.random.default_rng(7)
    rows = _page_rows(store)
    rows[1:] = rng.integers(0, 256, store.page_nbytes, dtype=np.uint8)
    rows[1:, :8] = np.arange(1, spec.pages + 1, dtype="<u8").view(np.uint8).reshape(-1, 8)
    tokens = _tokens(spec)
    hashes = service.hasher.hash_prompt(tokens)
    with service.lock:
        pages = pool.get_new_pages(spec.pages)
        pool.cache_full_pages(pages, hashes, 0, spec.pages, tokens)
        pool.free_pages(list(reversed(pages)))
    service.take_events()  # learns the token ids, so pages travel with provable chains

    server = None
    if spec.use_grpc:
        server = ServerThread(service, _transfer_config(spec))
        server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    flat = memoryview(rows[1:].reshape(-1))
    stop = threading.Event()

    def serve_tcp() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not stop.is_set():
                head = sock.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                (nbytes,) = struct.unpack("<Q", head)
                sock.sendall(flat[:nbytes])

    threading.Thread(target=serve_tcp, daemon=True).start()
    conn.send_bytes(
        json.dumps(
            {"tcp": listener.getsockname()[1], "grpc": server.address if server else None}
        ).encode()
    )
    group = None
    errors: list[str] = []
    if spec.use_dist:
        group = DistGroup.init(1, 2, "127.0.0.1", spec.dist_port, timeout_s=spec.timeout_s)
        transport = _dist_transport(group, service, spec)

        def serve_dist() -> None:
            try:
                transport.serve_forever(0, idle_timeout_s=spec.timeout_s * 4)
            except Exception as exc:  # reported to the puller through the pipe
                errors.append(f"dist serving: {exc}")

        threading.Thread(target=serve_dist, daemon=True).start()
    # Answers CPU-time queries until told to stop (or the puller is gone for too long).
    end = time.monotonic() + spec.timeout_s * (4 + 3 * spec.rounds)
    while (left := end - time.monotonic()) > 0 and conn.poll(left):
        if conn.recv_bytes() != CPU_QUERY:
            break
        conn.send_bytes(struct.pack("<d", time.process_time()))
    stop.set()
    conn.send_bytes(json.dumps({"errors": errors}).encode())
    listener.close()
    if server is not None:
        server.stop()
    if group is not None:
        group.close()


# --------------------------------------------------------------------------- the puller


def _empty(service: Any) -> None:
    with service.lock:
        service.pool.reset_prefix_cache()
    service.take_events()


def _wait_for(conn: Any, peer: Any, timeout_s: float, what: str) -> bytes:
    """The peer's next message; `TransportError` if it exits or stays silent for `timeout_s`."""
    from kvmesh.errors import TransportError

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if conn.poll(0.1):
            return bytes(conn.recv_bytes())
        if not peer.is_alive():
            raise TransportError(f"the peer process exited (code {peer.exitcode}) before {what}")
    raise TransportError(f"the peer process did not {what} within {timeout_s:g}s")


def _recv_tcp(sock: socket.socket, target: memoryview, nbytes: int) -> None:
    sock.sendall(struct.pack("<Q", nbytes))
    got = 0
    while got < nbytes:
        n = sock.recv_into(target[got:nbytes])
        if n == 0:
            raise ConnectionError(f"peer closed the baseline socket after {got} of {nbytes} bytes")
        got += n


def measure(spec: Spec) -> list[Figure]:
    """Start the peer, run every transport `spec.rounds` times, return the figures (tcp first)."""
    import multiprocessing
    import os

    load_before = os.getloadavg()[0]

    from kvmesh.errors import TransportError
    from kvmesh.hashing import NO_EXTRA
    from kvmesh.worker.dist_group import DistGroup
    from kvmesh.worker.page_service import ProofBook

    service = _make_service(spec)
    tokens = _tokens(spec)
    hashes = service.hasher.hash_prompt(tokens)
    # The puller serves the prompt, so it proves every page from its own tokens.
    proofs = ProofBook.for_pages(hashes, tokens, NO_EXTRA, PAGE_SIZE)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer_main, args=(child, json.dumps(asdict(spec))), daemon=True)
    peer.start()
    cleanup: list[Callable[[], None]] = []
    try:
        where = json.loads(_wait_for(parent, peer, spec.timeout_s, "start"))
        pulls: dict[str, Callable[[list[Any]], int]] = {}
        details: dict[str, str] = {}

        sock = socket.create_connection(("127.0.0.1", where["tcp"]), timeout=spec.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cleanup.append(sock.close)
        flat = memoryview(_page_rows(service.store)[1:].reshape(-1))

        def pull_tcp(some: list[Any]) -> int:
            _recv_tcp(sock, flat, len(some) * service.store.page_nbytes)
            return len(some)

        pulls["tcp"] = pull_tcp
        details["tcp"] = "socket sendall / recv_into, no framing or checks"

        if spec.use_grpc:
            from kvmesh.worker.transfer_client import SyncPeerClient

            config = _transfer_config(spec)
            client = SyncPeerClient(where["grpc"], config)
            cleanup.append(client.close)
            receiver = service.receiving(proofs)
            pulls["grpc"] = lambda some: client.pull_into(receiver, some)
            details["grpc"] = (
                "pooled connections into reserved pages, "
                f"fetch_streams={config.fetch_streams} chunk_bytes={config.chunk_bytes}"
                + (" malloc_tune" if config.grpc_malloc_tune else "")
            )

        if spec.use_dist:
            group = DistGroup.init(0, 2, "127.0.0.1", spec.dist_port, timeout_s=spec.timeout_s)
            cleanup.append(group.close)
            transport = _dist_transport(group, service, spec)
            cleanup.append(lambda: transport.hang_up(1))

            def pull_dist(some: list[Any]) -> int:
                result = transport.pull(1, some, service.receiving(proofs))
                if result.rejected:
                    raise TransportError(f"dist rejected pages: {result.rejected[0][1]}")
                return len(result.inserted)

            pulls["dist"] = pull_dist
            per_page = spec.page_bytes >= transport.page_message_bytes
            details["dist"] = f"{group.backend} batch_bytes={transport.batch_bytes} " + (
                f"depth={transport.depth}, a message per page into reserved pool pages"
                if per_page
                else ("gathered batches" if spec.gather else "batches, in place where consecutive")
            )

        def peer_cpu() -> float:
            parent.send_bytes(CPU_QUERY)
            reply = _wait_for(parent, peer, spec.timeout_s, "report its CPU time")
            return float(struct.unpack("<d", reply)[0])

        times: dict[str, list[float]] = {name: [] for name in pulls}
        cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in pulls}
        warm = hashes[: max(1, min(len(hashes), 32))]
        for pull in pulls.values():
            _empty(service)
            pull(list(warm))
        for _ in range(spec.rounds):
            for name, pull in pulls.items():
                _empty(service)
                peer0, self0 = peer_cpu(), time.process_time()
                t0 = time.perf_counter()
                moved = pull(list(hashes))
                times[name].append(time.perf_counter() - t0)
                cpu[name].append((time.process_time() - self0, peer_cpu() - peer0))
                if moved != spec.pages:
                    raise TransportError(f"{name} moved {moved} of {spec.pages} pages")
        _empty(service)
    finally:
        for step in reversed(cleanup):
            try:
                step()
            except Exception as exc:
                print(f"bench transfer: cleanup: {exc}", file=sys.stderr)
        try:
            parent.send_bytes(b"stop")
            if parent.poll(spec.timeout_s):
                report = json.loads(parent.recv_bytes())
                for err in report.get("errors", []):
                    print(f"bench transfer: peer: {err}", file=sys.stderr)
        except (OSError, EOFError):
            pass
        peer.join(spec.timeout_s)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
    return _figures(spec, times, details, (load_before, os.getloadavg()[0]), cpu)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _figures(
    spec: Spec,
    times: dict[str, list[float]],
    details: dict[str, str],
    load: tuple[float, float] = (0.0, 0.0),
    cpu: dict[str, list[tuple[float, float]]] | None = None,
) -> list[Figure]:
    """The figures of every transport from its rounds' `times` (and `cpu`: per round, the
    puller's and the peer's CPU seconds); round i of each transport ran in the same turn."""
    nbytes = spec.pages * spec.page_bytes
    gib = nbytes / 2**30
    best = {name: min(ts) for name, ts in times.items()}
    tcp_rate = nbytes / best["tcp"]
    out = []
    for name, ts in times.items():
        median = _median(ts)
        rate = nbytes / best[name]
        rounds_cpu = (cpu or {}).get(name, [])
        out.append(
            Figure(
                transport=name,
                gb_per_s=rate / 1e9,
                pages_per_s=spec.pages / best[name],
                ratio_vs_tcp=rate / tcp_rate,
                seconds=best[name],
                median_gb_per_s=nbytes / median / 1e9,
                pages=spec.pages,
                page_bytes=spec.page_bytes,
                bytes=nbytes,
                rounds=len(ts),
                detail=details[name],
                load_before=load[0],
                load_after=load[1],
                median_ratio_vs_tcp=_median(
                    [a / b for a, b in zip(times["tcp"], ts, strict=False)]
                ),
                puller_cpu_s_per_gib=_mean([c[0] for c in rounds_cpu]) / gib,
                peer_cpu_s_per_gib=_mean([c[1] for c in rounds_cpu]) / gib,
            )
        )
    return out


def spec_from_args(args: argparse.Namespace) -> Spec:
    from kvmesh.errors import ConfigError
    from kvmesh.worker.dist_group import free_port

    if args.pages <= 0 or args.rounds <= 0 or args.timeout <= 0:
        raise ConfigError("--pages, --rounds and --timeout must be positive")
    if args.page_bytes <= 0 or args.page_bytes % 64:
        raise ConfigError(f"--page-bytes must be a positive multiple of 64, got {args.page_bytes}")
    if args.batch_bytes is not None and args.batch_bytes < args.page_bytes:
        raise ConfigError("--batch-bytes must hold at least one page (>= --page-bytes)")
    return Spec(
        pages=args.pages,
        page_bytes=args.page_bytes,
        rounds=args.rounds,
        timeout_s=args.timeout,
        dist_port=free_port(),
        use_dist=args.transport in ("dist", "both"),
        use_grpc=args.transport in ("grpc", "both"),
        grpc_streams=args.grpc_streams,
        grpc_chunk_bytes=args.grpc_chunk_bytes,
        grpc_malloc_tune=args.grpc_malloc_tune,
        batch_bytes=args.batch_bytes,
        gather=args.gather,
    )


def render(spec: Spec, figures: list[Figure]) -> str:
    """The human-readable table (tcp first)."""
    import os

    total = spec.pages * spec.page_bytes
    load = (
        f"; 1-min load {figures[0].load_before:.2f} before, {figures[0].load_after:.2f} after, "
        f"{os.cpu_count()} cores"
        if figures
        else ""
    )
    lines = [
        f"kvmesh bench transfer: {spec.pages} pages x {spec.page_bytes / 2**20:.2f} MiB = "
        f"{total / 2**30:.2f} GiB over loopback, {spec.rounds} rounds, transports in turn "
        f"(this process pulls from a spawned peer{load})",
        f"{'transport':<10}{'GB/s':>8}{'pages/s':>10}{'vs tcp':>8}{'median GB/s':>13}"
        f"{'median vs tcp':>15}{'CPU s/GiB puller+peer':>23}  detail",
    ]
    for fig in figures:
        cpu = f"{fig.puller_cpu_s_per_gib:.2f}+{fig.peer_cpu_s_per_gib:.2f}"
        lines.append(
            f"{fig.transport:<10}{fig.gb_per_s:>8.2f}{fig.pages_per_s:>10.0f}"
            f"{fig.ratio_vs_tcp:>8.0%}{fig.median_gb_per_s:>13.2f}"
            f"{fig.median_ratio_vs_tcp:>15.0%}{cpu:>23}  {fig.detail}"
        )
    lines.append(
        "vs tcp: best round / tcp's best round; median vs tcp: per round, tcp's time / this "
        "one's; CPU: all threads, per GiB moved, mean of rounds"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    figures = measure(spec)
    if args.json:
        for fig in figures:
            print(json.dumps(asdict(fig)))
    else:
        print(render(spec, figures))
    return 0
