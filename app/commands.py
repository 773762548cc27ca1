"""`kvmesh start | status | generate | replay`: the cluster from the command line.

Each subcommand is a ``configure_<name>(parser)`` / ``run_<name>(args)`` pair
(see `kvmesh.app.cli`). Ray, torch and the client are imported inside ``run_*``
only, so ``kvmesh --help`` stays fast. Bad arguments raise a `KVMeshError`
subclass, which `kvmesh.app.cli.main` prints as one line with exit status 2.

Without ``--address`` a command starts an embedded local cluster for its own
run; with one (``auto``, ``HOST:PORT``) it joins a cluster and uses the
workers `kvmesh start` created there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.errors import ConfigError, InvalidInput

if TYPE_CHECKING:
    from kvmesh.client import KVMesh
    from kvmesh.config import ClusterConfig


# -- shared flags --------------------------------------------------------------------------


def _cluster_args(parser: argparse.ArgumentParser, *, creates: bool = True) -> None:
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto' or HOST:PORT); default: start an embedded local one",
    )
    if not creates:
        return
    g.add_argument(
        "--workers", type=int, default=None, help="worker actors to start (default: 4 embedded)"
    )
    g.add_argument(
        "--prefill-workers", type=int, default=None, help="disaggregation: prefill workers"
    )
    g.add_argument(
        "--decode-workers", type=int, default=None, help="disaggregation: decode workers"
    )
    g.add_argument("--policy", default=None, help="routing policy (default: kv_aware)")
    g.add_argument("--num-pages", type=int, default=None, help="pages per worker pool")
    g.add_argument("--worker-cpus", type=float, default=None, help="Ray CPUs per worker actor")
    g.add_argument("--worker-gpus", type=float, default=0.0, help="Ray GPUs per worker actor")
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
        "--profile",
        default=None,
        help="security profile: dev (default: loopback only) or production "
        "(Ray token auth, gRPC TLS and a bearer token; see kvmesh.security)",
    )
    g.add_argument(
        "--allow-remote",
        action="store_true",
        default=None,
        help="dev profile: let the workers' gRPC servers bind beyond loopback",
    )


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")


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
    """The `ClusterConfig` of the environment ``KVMESH_*`` and, over it, the cluster flags.

    The same `load_cluster_config` as `KVMesh.connect()` without a config: a
    variable means the same from the CLI and from Python. A flag left unset
    keeps the variable in force; a bad value names its flag or variable.
    """
    from kvmesh.settings import load_cluster_config

    for flag in ("workers", "num_pages", "worker_cpus"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag, None))
    for flag in ("prefill_workers", "decode_workers", "worker_gpus"):
        if (getattr(args, flag, 0) or 0) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0")
    prefill = getattr(args, "prefill_workers", 0) or 0
    decode = getattr(args, "decode_workers", 0) or 0
    if (prefill > 0) != (decode > 0):
        raise ConfigError("disaggregation needs both --prefill-workers and --decode-workers")

    given = {path: getattr(args, dest, None) for dest, path in CLUSTER_FLAGS.items()}
    names = {path: "--" + dest.replace("_", "-") for dest, path in CLUSTER_FLAGS.items()}
    return load_cluster_config(given, names=names)


def connect(args: argparse.Namespace, *, create_workers: bool = True) -> KVMesh:
    """Join ``--address`` or start an embedded cluster, as the flags say.

    `create_workers` False: only use workers that are already registered.
    """
    from kvmesh.client import KVMesh

    cfg = cluster_config(args)
    kwargs: dict[str, Any] = {}
    if getattr(args, "worker_cpus", None) is not None:
        kwargs["worker_num_cpus"] = args.worker_cpus
    if getattr(args, "worker_gpus", None):
        kwargs["worker_num_gpus"] = args.worker_gpus
    if getattr(args, "num_cpus", None) is not None:
        kwargs["num_cpus"] = args.num_cpus
    return KVMesh.connect(
        args.address,
        num_workers=cfg.num_workers if create_workers else 0,
        config=cfg,
        prefill_workers=cfg.prefill_workers if create_workers else 0,
        decode_workers=cfg.decode_workers if create_workers else 0,
        **kwargs,
    )


def _console(stderr: bool = False) -> Any:
    """A rich console; at least 120 columns when not a terminal, so tables are not cut."""
    from rich.console import Console

    console = Console(stderr=stderr)
    if not console.is_terminal and console.width < 120:
        console = Console(stderr=stderr, width=120)
    return console


def print_workers(mesh: KVMesh, console: Any | None = None) -> None:
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


def transfer_summary(stats: Any) -> str | None:
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
    _cluster_args(parser)
    parser.add_argument(
        "--num-cpus",
        type=float,
        default=None,
        help="CPUs the embedded Ray cluster advertises (default: enough for the workers)",
    )
    # Tests and scripts: stop by themselves after this many seconds instead of Ctrl-C.
    parser.add_argument("--exit-after", type=float, default=None, help=argparse.SUPPRESS)


def run_start(args: argparse.Namespace) -> int:
    _positive("--num-cpus", args.num_cpus)
    _positive("--exit-after", args.exit_after)
    console = _console()
    with connect(args) as mesh:
        print_workers(mesh, console)
        import os

        auth = "RAY_AUTH_MODE=token " if os.environ.get("RAY_AUTH_MODE") == "token" else ""
        console.print(
            f"kvmesh is running; Ray address: {mesh.ray_address}\n"
            f"use `{auth}kvmesh status --address {mesh.ray_address}`; Ctrl-C stops it",
            highlight=False,
        )
        deadline = None if args.exit_after is None else time.monotonic() + args.exit_after
        try:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.2)
        except KeyboardInterrupt:  # the normal way to stop: leave through close()
            console.print("stopping kvmesh", highlight=False)
    return 0


# -- status ------------------------------------------------------------------------------------


def configure_status(parser: argparse.ArgumentParser) -> None:
    _cluster_args(parser)
    parser.add_argument("--json", action="store_true", help="print the stats as one JSON object")


def run_status(args: argparse.Namespace) -> int:
    with connect(args, create_workers=args.address is None) as mesh:
        if args.json:
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
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--cache-salt", default=None, help="tenant salt (isolates the cache)")
    parser.add_argument("--lora-id", type=int, default=None, help="LoRA adapter id")
    parser.add_argument("--repeat", type=int, default=1, help="send the prompt this many times")
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    _cluster_args(parser)


def run_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.tokens is None):
        raise InvalidInput("give either a prompt text or --tokens, not both or neither")
    if args.max_tokens < 0:
        raise InvalidInput(f"--max-tokens must be >= 0, got {args.max_tokens}")
    _positive("--repeat", args.repeat)
    prompt: str | list[int] = args.prompt if args.tokens is None else _parse_tokens(args.tokens)
    from kvmesh.client.tokenizer import VOCAB_SIZE, decode

    console = _console()
    with connect(args) as mesh:
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


def result_dict(res: Any) -> dict[str, Any]:
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
        type=float,
        default=1.0,
        help="send request i at time-scale x its timestamp (0: back to back)",
    )
    parser.add_argument("--limit", type=int, default=100, help="replay the first N requests")
    parser.add_argument("--pages-per-block", type=int, default=1, help="pages per trace block")
    parser.add_argument("--max-tokens", type=int, default=4, help="cap on tokens per answer")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
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
    if args.time_scale < 0:
        raise InvalidInput(f"--time-scale must be >= 0, got {args.time_scale}")
    for flag in ("limit", "pages_per_block", "concurrency", "max_tokens"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    from kvmesh.app.demo import ReplaySpec, print_reports, replay, trace_prompts
    from kvmesh.trace import load_trace

    reqs = load_trace(path, limit=args.limit)
    console = _console()
    with connect(args) as mesh:
        prompts = trace_prompts(reqs, mesh.config, args.pages_per_block, args.max_tokens)
        spec = ReplaySpec(time_scale=args.time_scale, concurrency=args.concurrency)
        report = replay(mesh, prompts, spec, label=mesh.stats().policy, console=console)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print_reports([report], console)
    return 0
