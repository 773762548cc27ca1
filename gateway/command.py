"""`kvmesh gateway`: serve the OpenAI-compatible gateway in front of running engines.

    kvmesh gateway --engine http://127.0.0.1:8001 --events tcp://127.0.0.1:5557 \\
                   --replay tcp://127.0.0.1:5558 --engine http://127.0.0.1:8002 ... \\
                   --tokenizer MODEL_DIR --block-size 32 [--policy kv_aware] [--port 8000]

``--events`` / ``--replay`` pair with ``--engine`` in order (give each engine
both, or none of them); so do ``--store-events`` / ``--store-replay``, the
event sockets of the kvmesh store beside each engine with kvmesh's connector
(``python -m kvmesh.worker.engine_store --events ... --events-replay ...``),
which ``--policy kv_mesh`` reads as what each engine can load. The hash flags must say what the engines were
started with (``--block-size``, ``--prefix-caching-hash-algo``,
PYTHONHASHSEED, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). Heavy imports (FastAPI,
uvicorn, transformers, pyzmq) happen in `run`, so ``kvmesh --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from kvmesh.arguments import non_negative_int, positive_float, positive_int, tcp_port
from kvmesh.config import CoordinatorConfig, from_env
from kvmesh.errors import ConfigError, KVMeshError
from kvmesh.logs import LogSettings, configure_logging

if TYPE_CHECKING:
    from kvmesh.gateway.app import EngineCheck, EventSource, Gateway
    from kvmesh.gateway.config import GatewayConfig


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engines")
    g.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL",
        help="an engine's HTTP base URL (repeat for each engine), e.g. http://127.0.0.1:8001",
    )
    g.add_argument(
        "--events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="the engine's --kv-events-config endpoint, in --engine order (tcp:// is bound "
        "here, ipc:// connected to)",
    )
    g.add_argument(
        "--replay",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="the engine's replay_endpoint, in --engine order (heals gaps in its events)",
    )
    g.add_argument(
        "--store-events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="the engine's kvmesh store's --events endpoint, in --engine order (kv_mesh: what "
        "the engine can load from its store; tcp:// is bound here)",
    )
    g.add_argument(
        "--store-replay",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="the engine's kvmesh store's --events-replay endpoint, in --engine order",
    )
    g.add_argument(
        "--events-connect",
        action="store_true",
        help="connect to every --events endpoint instead of binding tcp:// ones: for engines "
        "whose publisher binds (--kv-events-config endpoint tcp://*:PORT; give here "
        "tcp://ENGINE_HOST:PORT), which any number of gateway replicas can follow",
    )
    g.add_argument(
        "--events-topic",
        default="",
        help="the topic in the engines' --kv-events-config (vLLM's default: empty)",
    )
    g.add_argument(
        "--name",
        action="append",
        default=[],
        help="engine names, in --engine order (default engine-0, engine-1, ...)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: what the first engine's /v1/models says)",
    )
    h = parser.add_argument_group("hashing (as the engines were started)")
    h.add_argument(
        "--tokenizer", required=True, help="the folder holding the engines' tokenizer.json"
    )
    h.add_argument("--block-size", type=positive_int, default=16, help="the engines' --block-size")
    h.add_argument("--hash-algo", default="sha256", help="the engines' --prefix-caching-hash-algo")
    h.add_argument("--hash-seed", default=None, help="the engines' PYTHONHASHSEED, if set")
    h.add_argument(
        "--digest-hashes",
        action="store_true",
        help="the engines run with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (32-byte digests)",
    )
    r = parser.add_argument_group("routing and serving")
    r.add_argument(
        "--policy",
        default="kv_aware",
        help="kv_aware (default), round_robin, least_loaded, ..., or approx_prefix (no events: "
        "routes from its own history)",
    )
    r.add_argument(
        "--history-blocks",
        type=non_negative_int,
        default=0,
        help="approx_prefix: blocks it assumes each engine keeps (0: unbounded)",
    )
    r.add_argument(
        "--shared-prefix-blocks",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="kv_aware, approx_prefix: leading blocks every conversation shares (a system "
        "prompt); a request no engine holds more of goes to the engine that computed the "
        "fewest blocks, the rest by the policy's cost (default 0: off; set, it replaces "
        "--placement conversations)",
    )
    r.add_argument(
        "--placement",
        choices=("conversations", "cost"),  # gateway.config.PLACEMENTS, not imported here
        default=None,
        help="kv_aware's rule: 'conversations' (kv_aware's default: conversations stay on the "
        "engine holding them, new ones go where fewer blocks were stored lately) or 'cost' "
        "(prefill plus queued tokens for every request, the rule before); approx_prefix "
        "takes 'cost' unless told",
    )
    r.add_argument(
        "--decision-log",
        type=non_negative_int,
        default=4096,
        help="routing decisions kept, with their outcome, for GET /kvmesh/decisions "
        "(default 4096; 0: none)",
    )
    r.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    r.add_argument("--port", type=tcp_port, default=8000, help="port (default 8000)")
    r.add_argument(
        "--allow-remote",
        action="store_true",
        help="bind beyond loopback (put TLS and API keys in front of it)",
    )
    r.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="JSON/YAML {api_key: cache_salt}: bind each tenant's salt to its key "
        "(default KVMESH_API_KEYS_FILE / KVMESH_API_KEYS; none: salts come with requests)",
    )
    r.add_argument(
        "--request-timeout", type=positive_float, default=300.0, help="seconds (default 300)"
    )
    r.add_argument(
        "--connect-timeout", type=positive_float, default=2.0, help="seconds (default 2)"
    )
    r.add_argument(
        "--health-interval", type=positive_float, default=1.0, help="seconds (default 1)"
    )
    r.add_argument("--log-level", default="info", help="uvicorn log level (default info)")


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The `GatewayConfig` the flags describe; `ConfigError` naming the flag otherwise."""
    from kvmesh.gateway.config import EngineTarget, GatewayConfig

    urls: list[str] = args.engine
    for flag in ("events", "replay", "name", "store_events", "store_replay"):
        given = getattr(args, flag)
        if given and len(given) != len(urls):
            raise ConfigError(
                f"--{flag.replace('_', '-')} was given {len(given)} times for {len(urls)} "
                "--engine: give one per engine, in the same order"
            )
    names = args.name or [f"engine-{i}" for i in range(len(urls))]
    events = args.events or [None] * len(urls)
    replays = args.replay or [None] * len(urls)
    if args.replay and not args.events:
        raise ConfigError("--replay needs --events: it heals gaps in an engine's event stream")
    if args.store_replay and not args.store_events:
        raise ConfigError("--store-replay needs --store-events: it heals gaps in a store's events")
    store_events = args.store_events or [None] * len(urls)
    store_replays = args.store_replay or [None] * len(urls)
    targets = tuple(
        EngineTarget(n, u, e, r, se, sr)
        for n, u, e, r, se, sr in zip(
            names, urls, events, replays, store_events, store_replays, strict=True
        )
    )
    return GatewayConfig(
        targets,
        policy=args.policy,
        coordinator=from_env(CoordinatorConfig, policy=args.policy),
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        health_interval_s=args.health_interval,
        history_blocks=args.history_blocks,
        shared_prefix_blocks=args.shared_prefix_blocks,
        placement=args.placement,
        served_model=args.served_model_name,
        decision_log=args.decision_log,
    )


def build_gateway(args: argparse.Namespace) -> Gateway:
    """The gateway the flags describe, with a KV event subscriber when the policy reads events."""
    from kvmesh.coordinator.index import GlobalIndex
    from kvmesh.engine_canary import run_hash_parity_canary
    from kvmesh.engine_hash import EngineHasher
    from kvmesh.engine_subscriber import EngineEventsEndpoint, EngineSubscriber
    from kvmesh.gateway.app import Gateway
    from kvmesh.gateway.config import HISTORY_POLICY, EngineTarget, store_worker_id
    from kvmesh.gateway.tokenizer import PromptTokenizer
    from kvmesh.security import TenantPolicy

    config = gateway_config(args)
    hasher = EngineHasher(args.hash_algo, args.block_size, args.hash_seed, not args.digest_hashes)
    index = GlobalIndex()
    sources: list[EventSource] = []
    verify: EngineCheck | None = None
    followed = {t.name for t in config.engines if t.events}
    stores = {t.name: store_worker_id(t.name) for t in config.engines if t.store_events}
    if (followed or stores) and config.policy != HISTORY_POLICY:
        endpoints = [
            EngineEventsEndpoint(
                t.name,
                t.events,
                t.replay,
                args.events_topic,
                mode="connect" if args.events_connect else "auto",
            )
            for t in config.engines
            if t.events is not None
        ]
        endpoints += [
            EngineEventsEndpoint(stores[t.name], t.store_events, t.store_replay)
            for t in config.engines
            if t.store_events is not None
        ]
        subscriber = EngineSubscriber(index, endpoints)
        sources.append(subscriber)

        async def verify(target: EngineTarget) -> object:
            """The hash-parity canary, for engines whose events the gateway follows; a store
            names blocks by its engine's hashes, so it shares its engine's verdict."""
            if target.name not in followed:
                return None
            store = stores.get(target.name)
            try:
                result = await run_hash_parity_canary(
                    subscriber, target.name, target.base_url, hasher
                )
            except KVMeshError:
                reason = subscriber.quarantined(target.name)
                if store is not None and reason is not None:
                    subscriber.quarantine(store, reason)
                raise
            if store is not None:
                subscriber.release(store)
            return result

    tenants = TenantPolicy.from_file(args.api_keys) if args.api_keys else TenantPolicy.from_env()
    return Gateway(
        config,
        PromptTokenizer(args.tokenizer),
        hasher,
        index=index,
        sources=sources,
        tenants=tenants,
        verify=verify,
    )


def describe(gateway: Gateway, host: str, port: int) -> str:
    """The start-up line: where it listens, which engines, how it routes and hashes."""
    h = gateway.hasher
    engines = ", ".join(
        f"{t.name}={t.url}"
        + (f" (events {t.events})" if t.events else "")
        + (f" (store events {t.store_events})" if t.store_events else "")
        for t in gateway.config.engines
    )
    return (
        f"kvmesh gateway: http://{host}:{port} -> {engines}; policy {gateway.config.policy}; "
        f"blocks of {h.block_size} hashed with {h.algorithm.name}"
        f"{'' if h.seed is None else ' seed ' + repr(h.seed)}"
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvmesh.gateway.app import create_app
    from kvmesh.security import check_bind_address

    check_bind_address(args.host, args.allow_remote)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    level = "DEBUG" if args.log_level.lower() == "trace" else args.log_level.upper()
    # kvmesh's one log configuration (KVMESH_LOG_FORMAT=json too); --log-level sets its level
    configure_logging(dataclasses.replace(LogSettings.from_env(), level=level))
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    gateway = build_gateway(args)
    print(describe(gateway, args.host, args.port), file=sys.stderr, flush=True)
    uvicorn.run(create_app(gateway), host=args.host, port=args.port, log_level=args.log_level)
    return 0
