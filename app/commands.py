"""`kvmesh start | status | generate | replay`: the cluster from the command line.

Each subcommand is a ``configure_<name>(parser)`` / ``run_<name>(args)`` pair
(see `kvmesh.app.cli`). Ray, torch and the client are imported inside ``run_*``
only, so ``kvmesh --help`` stays fast. Bad arguments raise a `KVMeshError`
subclass, which `kvmesh.app.cli.main` prints as one line with exit status 2.

`kvmesh start` starts a cluster: an embedded local one, or kvmesh on the
Ray cluster at ``--address`` / ``RAY_ADDRESS``, recorded in the state
directory (`kvmesh.app.local_cluster`) until it stops; it refuses when
kvmesh already runs there, unless ``--join``. `status`, `generate` and `replay` act
on a running cluster (``--address``, else ``RAY_ADDRESS``, else the recorded
one) and never start one: with nothing reachable they fail within seconds
(`ClusterConfig.connect_timeout_s`, ``KVMESH_CONNECT_TIMEOUT_S``). Every input is checked first,
flags by their argparse types (`kvmesh.arguments`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.arguments import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvmesh.errors import ClusterAlreadyRunning, ClusterUnreachable, ConfigError, InvalidInput

if TYPE_CHECKING:
    from rich.console import Console

    from kvmesh.client import KVMesh
    from kvmesh.client.mesh import ClusterStats
    from kvmesh.config import ClusterConfig
    from kvmesh.requests import GenerationResult


# -- shared flags --------------------------------------------------------------------------


def _cluster_args(parser: argparse.ArgumentParser, *, creates: bool = False) -> None:
    """The flags that say which cluster and which settings; `creates`: those of `start`."""
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--address",
        default=None,
        help="Ray cluster (HOST:PORT, ray://HOST:PORT or 'auto'); default: RAY_ADDRESS, "
        + (
            "else a new embedded local cluster"
            if creates
            else "else the local cluster `kvmesh start` recorded"
        ),
    )
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings file (TOML or YAML; default: KVMESH_CONFIG); the KVMESH_* environment "
        "and flags win over it (docs/configuration.md)",
    )
    g.add_argument("--policy", default=None, help="routing policy (default: kv_aware)")
    g.add_argument(
        "--profile",
        default=None,
        help="security profile: dev (default: loopback only) or production "
        "(Ray token auth, gRPC TLS and a bearer token; see kvmesh.security)",
    )
    if not creates:
        return
    g.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="worker actors to start (default: 4 embedded)",
    )
    g.add_argument(
        "--prefill-workers",
        type=non_negative_int,
        default=None,
        help="disaggregation: prefill workers",
    )
    g.add_argument(
        "--decode-workers",
        type=non_negative_int,
        default=None,
        help="disaggregation: decode workers",
    )
    g.add_argument("--num-pages", type=positive_int, default=None, help="pages per worker pool")
    g.add_argument(
        "--worker-cpus", type=positive_float, default=None, help="Ray CPUs per worker actor"
    )
    g.add_argument(
        "--worker-gpus", type=non_negative_float, default=0.0, help="Ray GPUs per worker actor"
    )
    g.add_argument(
        "--transfer-host",
        default=None,
        help="bind address of the workers' gRPC page servers (default 127.0.0.1; "
        "0.0.0.0 for multi-node, with --allow-remote or the production profile)",
    )
    g.add_argument(
        "--transport",
        default=None,
        help="how workers move pages to each other: grpc (default) or dist "
        "(torch.distributed links: gloo on CPU, NCCL on GPU; falls back to gRPC)",
    )
    g.add_argument(
        "--allow-remote",
        action="store_true",
        default=None,
        help="dev profile: let the workers' gRPC servers bind beyond loopback",
    )


CLUSTER_FLAGS: dict[str, str] = {
    "workers": "num_workers",
    "prefill_workers": "prefill_workers",
    "decode_workers": "decode_workers",
    "policy": "coordinator.policy",
    "num_pages": "pool.num_pages",
    "transfer_host": "transfer.host",
    "transport": "transfer.transport",
    "profile": "security.profile",
    "allow_remote": "security.allow_remote",
}
"""Cluster flag (argparse dest) -> the `ClusterConfig` setting it sets (`kvmesh.settings`)."""


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The `ClusterConfig` of the config file, the ``KVMESH_*`` environment and, over
    them, the cluster flags: the same `load_cluster_config` as `kvmesh.app.connect()`.

    A flag left unset keeps the file's or the variable's value in force; a bad
    value names its flag, variable or file key. Nothing is started.
    """
    from kvmesh.settings import load_cluster_config

    prefill = getattr(args, "prefill_workers", 0) or 0
    decode = getattr(args, "decode_workers", 0) or 0
    if (prefill > 0) != (decode > 0):
        raise ConfigError("disaggregation needs both --prefill-workers and --decode-workers")
    given = {path: getattr(args, dest, None) for dest, path in CLUSTER_FLAGS.items()}
    names = {path: "--" + dest.replace("_", "-") for dest, path in CLUSTER_FLAGS.items()}
    return load_cluster_config(given, names=names, config_file=getattr(args, "config", None))


def cluster_target(args: argparse.Namespace, cfg: ClusterConfig) -> tuple[str, str]:
    """(address, where it came from) of the running cluster a command acts on:
    ``--address``, else ``RAY_ADDRESS``, else the local cluster `kvmesh start`
    recorded. `ClusterUnreachable` when none is given or recorded: a command
    that acts on a cluster never starts a throwaway one."""
    from kvmesh.app.local_cluster import read_record, record_path
    from kvmesh.ray_address import RAY_ADDRESS_VARIABLE, address_from_environment

    if args.address is not None:
        return args.address, "--address"
    if (address := address_from_environment()) is not None:
        return address, RAY_ADDRESS_VARIABLE
    ns = cfg.coordinator.namespace
    recorded = read_record(ns)
    if recorded is not None:
        return recorded.address, f"the cluster recorded in {record_path(ns)}"
    raise ClusterUnreachable(
        f"no kvmesh cluster is running here (none recorded in {record_path(ns)}): start one "
        "with `kvmesh start`, or give --address HOST:PORT or RAY_ADDRESS"
    )


def attach(args: argparse.Namespace, cfg: ClusterConfig) -> KVMesh:
    """A client of the running cluster `cluster_target` names; nothing is created."""
    from kvmesh.client import KVMesh
    from kvmesh.security import check_cluster

    check_cluster(cfg)  # the security profile refuses first, whatever cluster is there
    address, source = cluster_target(args, cfg)
    return KVMesh.attach(address, config=cfg, source=source)


def _console(stderr: bool = False) -> Console:
    """A rich console; at least 120 columns when not a terminal, so tables are not cut."""
    from rich.console import Console

    console = Console(stderr=stderr)
    if not console.is_terminal and console.width < 120:
        console = Console(stderr=stderr, width=120)
    return console


def print_workers(mesh: KVMesh, console: Console | None = None) -> None:
    """The rich table of `kvmesh status`: one row per worker, then the cluster totals."""
    from rich.table import Table

    console = console or _console()
    stats = mesh.stats()
    table = Table(title=f"kvmesh workers (policy {stats.policy})")
    for col in ("worker", "role", "address", "pages used", "pages free", "cached", "requests"):
        table.add_column(
            col, justify="right" if col.startswith(("pages", "cac", "req")) else "left"
        )
    table.add_column("hit ratio", justify="right")
    for w in stats.workers:
        table.add_row(
            w.worker_id,
            w.role,
            w.address,
            str(w.pages_used),
            str(w.pages_free),
            str(w.cached_pages),
            str(w.requests),
            f"{w.page_hit_ratio:.3f}",
        )
    console.print(table)
    console.print(
        f"requests {stats.requests}  page hit ratio {stats.page_hit_ratio:.3f}  "
        f"pulled pages {stats.pulled_pages}  predicted/realized mismatches {stats.mismatches}"
    )
    line = transfer_summary(stats)
    if line:
        console.print(line)


def transfer_summary(stats: ClusterStats) -> str | None:
    """Pulls and pushes per transport over the cluster; None when torch.distributed was unused."""
    workers = stats.workers
    pulls = {t: sum(getattr(w, f"pulls_{t}") for w in workers) for t in ("grpc", "dist")}
    pushes = {t: sum(getattr(w, f"pushes_{t}") for w in workers) for t in ("grpc", "dist")}
    fallbacks = sum(w.dist_fallbacks for w in workers)
    if not (pulls["dist"] or pushes["dist"] or fallbacks):
        return None
    return (
        f"transfers: pulls grpc {pulls['grpc']} dist {pulls['dist']}  pushes grpc "
        f"{pushes['grpc']} dist {pushes['dist']}  dist fallbacks {fallbacks}"
    )


# -- start -------------------------------------------------------------------------------------


def configure_start(parser: argparse.ArgumentParser) -> None:
    _cluster_args(parser, creates=True)
    parser.add_argument(
        "--num-cpus",
        type=positive_float,
        default=None,
        help="CPUs the embedded Ray cluster advertises (default: enough for the workers)",
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="when kvmesh already runs there (or `kvmesh start` recorded one here), use its "
        "workers instead of refusing",
    )
    parser.add_argument(
        "--metrics-port",
        type=positive_int,
        default=None,
        help="the embedded cluster's Prometheus port: every actor's metrics, as ray_kvmesh_* "
        "(default: one Ray picks, printed at start)",
    )
    # Tests and scripts: stop by themselves after this many seconds instead of Ctrl-C.
    parser.add_argument("--exit-after", type=positive_float, default=None, help=argparse.SUPPRESS)


def _check_metrics_port(port: int | None, embedded: bool) -> None:
    """--metrics-port is the embedded cluster's: a running one's was set where Ray started."""
    if port is None:
        return
    if port > 65535:
        raise ConfigError(f"--metrics-port must be a TCP port (1..65535), got {port}")
    if not embedded:
        raise ConfigError(
            "--metrics-port sets the port of a cluster `kvmesh start` creates; a running Ray "
            "cluster serves its metrics where `ray start --metrics-export-port` put them"
        )


def run_start(args: argparse.Namespace) -> int:
    from kvmesh.app.embedded import connect
    from kvmesh.app.local_cluster import (
        RecordedCluster,
        read_record,
        record_path,
        remove_record,
        write_record,
    )
    from kvmesh.metrics import ray_metrics_endpoints
    from kvmesh.ray_address import address_from_environment

    cfg = cluster_config(args)
    ns = cfg.coordinator.namespace
    address = args.address or address_from_environment()
    embedded = address is None
    if embedded and (recorded := read_record(ns)) is not None:
        if not args.join:
            raise ClusterAlreadyRunning(
                f"a kvmesh cluster already runs here: Ray at {recorded.address}, started by "
                f"`kvmesh start` (pid {recorded.pid}, recorded in {record_path(ns)}); use it "
                "(`kvmesh status`), stop it (Ctrl-C where it runs), or join it with "
                "`kvmesh start --join`"
            )
        address, embedded = recorded.address, False
    _check_metrics_port(args.metrics_port, embedded)
    options: dict[str, Any] = {"worker_num_gpus": args.worker_gpus}
    if args.worker_cpus is not None:
        options["worker_num_cpus"] = args.worker_cpus
    console = _console()
    with connect(
        address,
        config=cfg,
        num_cpus=args.num_cpus,
        join_existing=args.join,
        metrics_port=args.metrics_port,
        **options,
    ) as mesh:
        record = RecordedCluster(mesh.ray_address, ns, os.getpid())
        # the kvmesh this process runs is the one `status` here should find; a join leaves
        # the record to the start that runs it
        records = embedded or not args.join
        if records:
            write_record(record)
        try:
            print_workers(mesh, console)
            for endpoint in ray_metrics_endpoints():
                console.print(f"metrics (Prometheus): {endpoint}", highlight=False)
            auth = "RAY_AUTH_MODE=token " if os.environ.get("RAY_AUTH_MODE") == "token" else ""
            console.print(
                f"kvmesh is running; Ray address: {mesh.ray_address}\n"
                f"use `kvmesh status` here, or `{auth}kvmesh status --address "
                f"{mesh.ray_address}`; Ctrl-C stops it",
                highlight=False,
            )
            deadline = None if args.exit_after is None else time.monotonic() + args.exit_after
            try:
                while deadline is None or time.monotonic() < deadline:
                    time.sleep(0.2)
            except KeyboardInterrupt:  # the normal way to stop: leave through close()
                console.print("stopping kvmesh", highlight=False)
        finally:
            if records:
                remove_record(record)
    return 0


# -- status ------------------------------------------------------------------------------------


def configure_status(parser: argparse.ArgumentParser) -> None:
    _cluster_args(parser)
    parser.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    parser.add_argument(
        "--watch", action="store_true", help="a live table, redrawn every --interval s (Ctrl-C)"
    )
    parser.add_argument(
        "--interval", type=positive_float, default=2.0, help="seconds between --watch redraws"
    )


def run_status(args: argparse.Namespace) -> int:
    with attach(args, cluster_config(args)) as mesh:
        if args.watch:
            from kvmesh.app.watch import watch

            watch(mesh, _console(), args.interval)
        elif args.json:
            print(json.dumps(mesh.stats().to_dict()))
        else:
            print_workers(mesh)
    return 0


# -- generate ----------------------------------------------------------------------------------


def _parse_tokens(raw: str) -> list[int]:
    try:
        tokens = [int(t) for t in raw.replace(",", " ").split()]
    except ValueError:
        raise InvalidInput(
            f"--tokens must be integers separated by commas or spaces, got {raw!r}"
        ) from None
    if not tokens:
        raise InvalidInput("--tokens is empty")
    return tokens


def configure_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text (byte-level tokens)")
    parser.add_argument("--tokens", default=None, help="token ids instead of text: '1,2,3'")
    parser.add_argument(
        "--max-tokens", type=non_negative_int, default=16, help="tokens to generate"
    )
    parser.add_argument("--cache-salt", default=None, help="tenant salt (isolates the cache)")
    parser.add_argument("--lora-id", type=non_negative_int, default=None, help="LoRA adapter id")
    parser.add_argument(
        "--repeat", type=positive_int, default=1, help="send the prompt this many times"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    _cluster_args(parser)


def prompt_tokens(args: argparse.Namespace, cfg: ClusterConfig) -> list[int]:
    """The prompt's token ids, checked before any cluster is reached (`InvalidInput`)."""
    from kvmesh.client.tokenizer import encode

    if (args.prompt is None) == (args.tokens is None):
        raise InvalidInput("give either a prompt text or --tokens, not both or neither")
    if args.tokens is not None:
        tokens = _parse_tokens(args.tokens)
    else:
        tokens = encode(args.prompt)
        if not tokens:
            raise InvalidInput("the prompt is empty: give some text, or token ids with --tokens")
    vocab = cfg.model.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(f"--tokens must be in [0, {vocab}) for this model, got {bad[0]}")
    return tokens


def run_generate(args: argparse.Namespace) -> int:
    cfg = cluster_config(args)
    prompt = prompt_tokens(args, cfg)
    from kvmesh.client.tokenizer import VOCAB_SIZE, decode

    console = _console()
    with attach(args, cfg) as mesh:
        for _ in range(args.repeat):
            res = mesh.generate(
                prompt, max_tokens=args.max_tokens, cache_salt=args.cache_salt, lora_id=args.lora_id
            )
            if args.json:
                print(json.dumps(result_dict(res)))
                continue
            text = decode(res.tokens) if all(t < VOCAB_SIZE for t in res.tokens) else ""
            t = res.timings
            console.print(f"tokens: {list(res.tokens)}", highlight=False)
            console.print(f"text:   {text!r}", highlight=False)
            console.print(
                f"worker {res.worker_id}: pages hit {res.pages_hit_local}, pulled "
                f"{res.pages_pulled}, computed {res.pages_computed} "
                f"(promised {res.promised_local} local + {res.promised_pull} pull)",
                highlight=False,
            )
            console.print(
                f"timings ms: queue {t.queue_ms:.1f}  pull {t.pull_ms:.1f}  prefill "
                f"{t.prefill_ms:.1f}  ttft {t.ttft_ms:.1f}  total {t.total_ms:.1f}",
                highlight=False,
            )
    return 0


def result_dict(res: GenerationResult) -> dict[str, Any]:
    """A `GenerationResult` as plain JSON-able values."""
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(res):
        v = getattr(res, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = dataclasses.asdict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


# -- replay ------------------------------------------------------------------------------------


def configure_replay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake-format trace (JSONL, .gz ok) or 'bundled'")
    parser.add_argument(
        "--time-scale",
        type=non_negative_float,
        default=1.0,
        help="send request i at time-scale x its timestamp (0: back to back)",
    )
    parser.add_argument(
        "--limit", type=positive_int, default=100, help="replay the first N requests"
    )
    parser.add_argument(
        "--pages-per-block", type=positive_int, default=1, help="pages per trace block"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4, help="cap on tokens per answer"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=4, help="requests in flight at most"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    _cluster_args(parser)


def trace_path(raw: str) -> Path | None:
    """None for the bundled trace, else an existing file (`InvalidInput` otherwise)."""
    if raw == "bundled":
        return None
    p = Path(raw)
    if not p.is_file():
        raise InvalidInput(f"trace file {raw} does not exist (or pass 'bundled')")
    return p


def run_replay(args: argparse.Namespace) -> int:
    path = trace_path(args.trace)
    cfg = cluster_config(args)
    from kvmesh.app.demo import ReplaySpec, print_reports, replay, trace_prompts
    from kvmesh.trace import load_trace

    reqs = load_trace(path, limit=args.limit)
    console = _console()
    with attach(args, cfg) as mesh:
        prompts = trace_prompts(reqs, mesh.config, args.pages_per_block, args.max_tokens)
        spec = ReplaySpec(time_scale=args.time_scale, concurrency=args.concurrency)
        report = replay(mesh, prompts, spec, label=mesh.stats().policy, console=console)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print_reports([report], console)
    return 0
