"""The `kvmesh` command.

Subcommands are a registry: a name maps to the module that implements it,
imported only when that subcommand runs (so `kvmesh --help` does not pay for
Ray or torch). Each module provides ``configure(parser)`` and ``run(args) -> int``.
Errors a user can act on (`KVMeshError`) print as one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvmesh.errors import KVMeshError
from kvmesh.logs import configure_logging

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "kvmesh.app.demo",
        "the main job: embedded cluster, trace slice, kv_aware vs round_robin",
    ),
    "start": ("kvmesh.app.commands", "start an embedded cluster or join one with --address"),
    "status": (
        "kvmesh.app.commands",
        "workers, pages used/free and hit ratio of a running cluster",
    ),
    "generate": ("kvmesh.app.commands", "run one prompt through the cluster"),
    "replay": ("kvmesh.app.commands", "replay a trace through a real cluster"),
    "simulate": (
        "kvmesh.app.simulate",
        "replay a trace offline against simulated workers and policies",
    ),
    "config": (
        "kvmesh.app.config_table",
        "the settings in force and where each came from; --table writes docs/configuration.md",
    ),
    "bench": (
        "kvmesh.benchmarks.cli",
        "benchmarks: pool, router, transfer, load, tiers, capacity, connector, engines",
    ),
    "gateway": (
        "kvmesh.gateway.command",
        "OpenAI-compatible gateway in front of vLLM engines, routing on their KV events",
    ),
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="kvmesh", description="Distributed prefix (KV) cache for LLM serving clusters."
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_OneLineParser
    )
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        configure = getattr(mod, f"configure_{name}", None) or mod.configure
        configure(p)
        p.set_defaults(_module=module, _name=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    mod = importlib.import_module(args._module)
    run = getattr(mod, f"run_{args._name}", None) or mod.run
    try:
        configure_logging()  # KVMESH_LOG_FORMAT / KVMESH_LOG_LEVEL (a bad value: one line)
        return int(run(args) or 0)
    except KVMeshError as exc:
        print(f"kvmesh {args._name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvmesh {args._name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
