"""The ``KVMESH_*`` environment variables kvmesh reads, so that a mistyped one is refused.

Every ``KVMESH_*`` variable either sets a config field (one per field,
`kvmesh.config.cluster_settings`) or is one of `OTHER_VARIABLES`, read outside
the config layers (the config file's name, logging, the state directory, test
knobs). Any other name is a typo or a leftover: ``KVMESH_POLICY`` misspelled
would leave the default policy in force without a word. So the readers of the
environment layer (`kvmesh.config.env_layer`, `kvmesh.config.from_env`) refuse
it, naming the closest known variables, before anything starts.

A variable kvmesh starts reading becomes a field or goes into
`OTHER_VARIABLES`; tests/kvmesh/test_config_environment.py scans the
repository for names that are neither, and docs/configuration.md lists both.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from types import MappingProxyType

from kvmesh.errors import InvalidSetting

OTHER_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        "KVMESH_CONFIG": "the config file (TOML or YAML), when `--config` is not given",
        "KVMESH_STATE_DIR": "where `kvmesh start` records the local cluster it runs "
        "(default `~/.cache/kvmesh`)",
        "KVMESH_LOG_FORMAT": "`text` (default) or `json`: one object per line",
        "KVMESH_LOG_LEVEL": "`DEBUG`, `INFO`, `WARNING` (default), `ERROR` or `CRITICAL`",
        "KVMESH_API_KEYS": "inline JSON `{api_key: cache_salt}` binding tenants' salts to "
        "their keys (small setups and tests; `security.api_keys_file` for a file)",
        "KVMESH_ENGINE_PYTHON": "the Python of the vLLM venv the real-engine tests and "
        "benchmarks start (default `.venv-engine/bin/python`, scripts/setup-engine-venv.sh)",
        "KVMESH_ENGINE_MODEL": "the model folder those engines serve (default `.engine-model`)",
        "KVMESH_SOAK_S": "how long tests/reliability/test_soak.py runs, seconds (default 60)",
        "KVMESH_CONNECTOR_TIMINGS": "a folder where each vLLM process running kvmesh's KV "
        "connector writes its metrics (hook wall times) for benchmarks/connector_overhead.py",
    }
)
"""The ``KVMESH_*`` variables that are not config fields -> what each is for."""


def unknown_variables(
    env: Mapping[str, str], field_variables: Collection[str], prefix: str
) -> list[str]:
    """The names in `env` that start with `prefix` and kvmesh never reads, sorted."""
    return sorted(
        name
        for name in env
        if name.startswith(prefix) and name not in field_variables and name not in OTHER_VARIABLES
    )


def _closest(name: str, known: Collection[str], prefix: str) -> list[str]:
    # Compared without the shared prefix, which would make every pair look alike.
    tails = {k.removeprefix(prefix): k for k in known}
    found = difflib.get_close_matches(name.removeprefix(prefix), tails, n=3)
    return [tails[t] for t in found]


def refuse_unknown_variables(
    env: Mapping[str, str], field_variables: Collection[str], prefix: str
) -> None:
    """Raise one `InvalidSetting` naming every `prefix` variable of `env` that is neither in
    `field_variables` nor in `OTHER_VARIABLES`, each with its closest known names. Values
    are never shown (a misspelled ``KVMESH_AUTH_TOKEN`` holds a secret). O(len(env))."""
    unknown = unknown_variables(env, field_variables, prefix)
    if not unknown:
        return
    known = {*field_variables, *OTHER_VARIABLES}
    hints = []
    for name in unknown:
        close = _closest(name, known, prefix)
        hints.append(f"did you mean {' or '.join(close)}?" if close else "no known name is close")
    if len(unknown) == 1:
        what = f"not a variable kvmesh reads ({hints[0]})"
    else:
        each = "; ".join(f"{n}: {h}" for n, h in zip(unknown, hints, strict=True))
        what = f"not variables kvmesh reads ({each})"
    raise InvalidSetting(
        ", ".join(unknown),
        f"{what}; fix the name or unset it (docs/configuration.md lists every variable)",
    )


__all__ = ["OTHER_VARIABLES", "refuse_unknown_variables", "unknown_variables"]
