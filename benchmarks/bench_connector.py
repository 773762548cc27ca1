"""`kvmesh bench connector`: the connector's data path, shared memory against gRPC.

A real store process (`kvmesh.worker.engine_store`, started by
`StoreProcess`) and, in this process, the engine's side of the connector
(`kvmesh.connector.block_path.BlockPath`) over real torch tensors shaped like
the engine's paged KV cache (per layer ``[blocks, kv_heads, block_size,
2 x head_dim]``, read from ``--model``'s config.json, the engine tests'
tiny Llama by default). Each repeat saves ``--blocks`` new blocks (distinct
digests, so the store takes every one) and loads them back into other engine
blocks, once over the store's shared-memory arena and once over gRPC, in
alternating order, and checks the loaded bytes equal the saved ones:

- ``stage``: the engine step's part of a save (copy out of the KV cache: into
  staging slots, sealed, or into bytes);
- ``send``: the saver thread's part (gRPC: seal and send the bytes; shared
  memory: name the slots), the store proving every digest and taking the
  pages into its pool;
- ``load``: what the engine waits for before its forward (``Locate``, copy
  from the mapping, seal checks over the copied bytes; or ``FetchPages``,
  unseal and copy).

After ``--warmup`` untimed rounds, medians of ``--repeats`` in ms per run and GB/s of block bytes, and gRPC /
shared memory for each (both measured in the same run, on this machine: the
store and this process share its cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvmesh.arguments import non_negative_int, positive_int
from kvmesh.connector.block_path import BlockPath, KVLayers
from kvmesh.connector.blocks import BlockRun, block_run
from kvmesh.connector.store_client import StoreClient
from kvmesh.connector.store_launcher import DTYPE_BYTES, StoreProcess, engine_block_nbytes
from kvmesh.engine_hash import EngineExtraKeys, EngineHasher
from kvmesh.errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PATHS = ("shm", "grpc")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=positive_int, default=31, help="blocks per save / load")
    parser.add_argument("--block-size", type=positive_int, default=32, help="tokens per block")
    parser.add_argument("--repeats", type=positive_int, default=15, help="runs per figure")
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=2,
        help="untimed runs first (the first touch of the arena's pages faults them in)",
    )
    parser.add_argument(
        "--model", default=".engine-model", help="model folder whose config.json shapes the KV"
    )
    parser.add_argument("--layers", type=positive_int, default=None, help="override: layers")
    parser.add_argument("--kv-heads", type=positive_int, default=None, help="override: KV heads")
    parser.add_argument("--head-dim", type=positive_int, default=None, help="override: head dim")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="override: dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def kv_shape(args: argparse.Namespace) -> tuple[int, int, int, str]:
    """(layers, kv heads, head dim, dtype): the flags where given, else the model's config.json.

    With the model's own shape, a block's bytes are checked against
    `engine_block_nbytes`, which sizes the store's pages for the engine.
    """
    path = Path(args.model) / "config.json"
    config: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
    head_dim = config.get("head_dim")
    if head_dim is None and "hidden_size" in config:
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    layers = args.layers or config.get("num_hidden_layers")
    heads, head_dim = args.kv_heads or heads, args.head_dim or head_dim
    dtype = args.dtype or str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if layers is None or heads is None or head_dim is None:
        raise ConfigError(f"no {path}: give --layers, --kv-heads and --head-dim")
    if dtype not in DTYPES:
        raise ConfigError(f"KV dtype {dtype!r}: choose one of {sorted(DTYPES)} (--dtype)")
    shape = (int(layers), int(heads), int(head_dim), dtype)
    nbytes = shape[0] * 2 * args.block_size * shape[1] * shape[2] * DTYPE_BYTES[dtype]
    overridden = args.layers or args.kv_heads or args.head_dim or args.dtype
    if (
        config
        and not overridden
        and nbytes != engine_block_nbytes(Path(args.model), args.block_size)
    ):
        raise ConfigError(f"{path} sizes a block two ways; pass the shape as flags")
    return shape


def _runs(blocks: int, block_size: int, count: int) -> list[BlockRun]:
    """`count` requests of `blocks` full blocks each, with distinct digests."""
    hasher = EngineHasher("sha256", block_size, int_hashes=False)
    keys = EngineExtraKeys()
    out = []
    for n in range(count):
        tokens = [(n * 7919 + i * 131) % 50_000 for i in range(blocks * block_size)]
        digests = list(hasher.hash_blocks(tokens, keys).digests)
        extra = [keys.for_block(i * block_size, (i + 1) * block_size) for i in range(blocks)]
        out.append(block_run(digests, tokens, extra, 0, blocks, block_size))
    return out


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; the `--json` object."""
    layers_n, heads, head_dim, dtype = kv_shape(args)
    blocks, size = args.blocks, args.block_size
    shape = (2 * blocks, heads, size, 2 * head_dim)
    gen = torch.Generator().manual_seed(0)
    source = [torch.randn(shape, generator=gen).to(DTYPES[dtype]) for _ in range(layers_n)]
    target = [torch.zeros(shape, dtype=DTYPES[dtype]) for _ in range(layers_n)]
    block_nbytes = KVLayers(source).block_nbytes
    rounds = args.warmup + args.repeats
    runs = _runs(blocks, size, 2 * rounds)
    times: dict[str, dict[str, list[float]]] = {
        p: {"stage": [], "send": [], "load": []} for p in PATHS
    }
    with StoreProcess(
        block_nbytes=block_nbytes,
        block_size=size,
        pages=4 * blocks,
        staging_pages=max(2 * blocks, 16),
        log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-bench-connector-")),
    ) as store:
        paths: dict[str, BlockPath] = {}
        for name in PATHS:
            client = StoreClient(store.page_address, store.control_address, timeout_s=30.0)
            paths[name] = BlockPath(client, KVLayers(source), size, shm=name == "shm")
            paths[name].connect()
            loader = BlockPath(client, KVLayers(target), size, shm=name == "shm")
            loader.connect()
            paths[name + "-load"] = loader
        if paths["shm"].mapped is None:
            raise ConfigError("the store's shared-memory arena could not be mapped here")
        saved_ids, load_ids = list(range(blocks)), list(range(blocks, 2 * blocks))
        for r in range(rounds):
            order = PATHS if r % 2 == 0 else PATHS[::-1]
            for i, name in enumerate(order):
                run = runs[2 * r + i]
                path, loader = paths[name], paths[name + "-load"]
                start = time.perf_counter()
                pending = path.stage(run, saved_ids)
                times[name]["stage"].append(_ms_since(start))
                if pending is None:
                    raise ConfigError("no free staging slots: raise the store's --staging-pages")
                start = time.perf_counter()
                inserted = path.send(pending)
                times[name]["send"].append(_ms_since(start))
                if inserted != [True] * blocks:
                    raise ConfigError(f"the store did not take every new block: {inserted}")
                for t in target:
                    t.zero_()
                start = time.perf_counter()
                loaded = loader.load(run.digests, load_ids)
                times[name]["load"].append(_ms_since(start))
                if loaded.blocks != blocks or not all(
                    torch.equal(s[:blocks], t[blocks:]) for s, t in zip(source, target, strict=True)
                ):
                    raise ConfigError(f"{name}: the load did not bring the saved bytes: {loaded}")
                if r < args.warmup:
                    for timed in times[name].values():
                        timed.pop()
        for path in paths.values():
            path.close()
            path.client.close()
    run_bytes = blocks * block_nbytes
    result: dict[str, Any] = {
        "blocks": blocks,
        "block_bytes": block_nbytes,
        "run_mib": run_bytes / 2**20,
        "repeats": args.repeats,
        "kv_shape": {"layers": layers_n, "kv_heads": heads, "head_dim": head_dim, "dtype": dtype},
        "load_average": os.getloadavg()[0],
    }
    for name in PATHS:
        figures = {k: statistics.median(v) for k, v in times[name].items()}
        figures["save"] = statistics.median(
            a + b for a, b in zip(times[name]["stage"], times[name]["send"], strict=True)
        )
        for k, ms in figures.items():
            result[f"{name}_{k}_ms"] = ms
            result[f"{name}_{k}_gb_s"] = run_bytes / (ms / 1000.0) / 1e9
    for k in ("stage", "send", "save", "load"):
        result[f"grpc_over_shm_{k}"] = result[f"grpc_{k}_ms"] / result[f"shm_{k}_ms"]
    return result


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    k = result["kv_shape"]
    print(
        f"connector data path: {result['blocks']} blocks of {result['block_bytes'] / 1024:.0f} KiB "
        f"({result['run_mib']:.1f} MiB a run; {k['layers']} layers, {k['kv_heads']} KV heads, "
        f"head_dim {k['head_dim']}, {k['dtype']}), median of {result['repeats']}, "
        f"load average {result['load_average']:.1f}"
    )
    print(f"  {'':6} {'shm ms':>9} {'GB/s':>6} {'gRPC ms':>9} {'GB/s':>6} {'gRPC/shm':>9}")
    for part in ("stage", "send", "save", "load"):
        print(
            f"  {part:6} {result[f'shm_{part}_ms']:9.2f} {result[f'shm_{part}_gb_s']:6.2f} "
            f"{result[f'grpc_{part}_ms']:9.2f} {result[f'grpc_{part}_gb_s']:6.2f} "
            f"{result[f'grpc_over_shm_{part}']:8.1f}x"
        )
    return 0
