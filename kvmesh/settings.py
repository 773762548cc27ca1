"""The cluster's settings, read one way by every entry point.

The CLI (`kvmesh.app.commands`), the Python API (`kvmesh.app.connect`) and the demo
build their `ClusterConfig` with `load_cluster_config`, in layers, a later one
winning: the defaults, then a config file (``--config`` / ``KVMESH_CONFIG``,
TOML or YAML, `file_layer`), then the ``KVMESH_*`` environment, then their
explicit values (flags, arguments). So ``KVMESH_PROFILE``, ``KVMESH_AUTH_TOKEN``,
``KVMESH_TLS_*``, ``KVMESH_SEED``, ``KVMESH_MODEL_SEED``, ``KVMESH_DEVICE`` ...
mean the same wherever they are set, and docs/configuration.md (generated
from the dataclasses, `kvmesh config --table`) lists every one. The Ray actors never read the environment: Ray places them on any node,
whose environment is not the operator's shell, so they take the config the
driver loaded as an argument (`WorkerSpec.config`, the coordinator's
`CoordinatorConfig`).

Checks come in two places, and both run before Ray starts:

- a section's own ``__post_init__`` (`kvmesh.config`): types, ranges, fields
  that must agree;
- `validate_cluster_config` here: names only a component's registry knows
  (routing policy, page hash, transport, dtype, device, profile, tier) and
  the transfer server's own limits. Such a check runs only when a value it
  reads differs from its default (defaults are checked once by a test), so a
  default config loads without importing torch or gRPC.

Every bad value is one `InvalidSetting` naming the variable, flag or field it
came from; the CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import difflib
import importlib
import os
import tomllib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvmesh.config import (
    ClusterConfig,
    Setting,
    build_cluster_config,
    cluster_settings,
    env_layer,
    explicit_layer,
    merge_layers,
    name_sources,
)
from kvmesh.errors import ConfigError, InvalidSetting
from kvmesh.security import check_environment_profile


def _same(value: str) -> str:
    return value


def _device_type(device: str) -> str:
    """``cuda:1`` -> ``cuda``; a device index that is not a number makes the name unknown."""
    kind, colon, index = device.partition(":")
    return kind if not colon or index.isdigit() else device


@dataclass(frozen=True, slots=True)
class RegistryCheck:
    """A field whose value must name an entry of a component's registry."""

    path: str  # "coordinator.policy"
    registry: str  # "module:attribute" of the registry (a dict or tuple of names)
    what: str  # "routing policy", for the message
    key: Callable[[str], str] = _same  # the registry key a value stands for


@dataclass(frozen=True, slots=True)
class SectionCheck:
    """A component's own check of a section (raises `ConfigError`), over the fields it reads."""

    paths: tuple[str, ...]
    function: str  # "module:function", called with the section


REGISTRY_CHECKS: tuple[RegistryCheck, ...] = (
    RegistryCheck("hash.algo", "kvmesh.hashing:HASH_FUNCTIONS", "page hash"),
    RegistryCheck("coordinator.policy", "kvmesh.coordinator.policies:REGISTRY", "routing policy"),
    RegistryCheck("coordinator.default_tier", "kvmesh.coordinator.index:TIER_NAMES", "tier"),
    RegistryCheck("transfer.transport", "kvmesh.worker.peers:TRANSPORTS", "transport"),
    RegistryCheck("model.dtype", "kvmesh.worker.model:DTYPES", "model dtype"),
    RegistryCheck("model.device", "kvmesh.worker.devices:DEVICE_KINDS", "device", key=_device_type),
    RegistryCheck("security.profile", "kvmesh.security:PROFILES", "security profile"),
)
"""Registry of name checks: field path -> the registry its value must be a key of."""

SECTION_CHECKS: tuple[SectionCheck, ...] = (
    SectionCheck(
        ("transfer.max_message_bytes", "transfer.chunk_bytes"),
        "kvmesh.worker.transfer_server:chunk_size",
    ),
    SectionCheck(
        tuple(p for p in cluster_settings() if p.startswith("transfer.grpc_")),
        "kvmesh.worker.transfer_server:grpc_tuning_options",
    ),
)
"""The transfer server's own checks (message room for a chunk, HTTP/2 frame bounds)."""


def _resolve(ref: str) -> Any:
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _value(config: ClusterConfig, path: str) -> Any:
    obj: Any = config
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _changed(config: ClusterConfig, paths: Collection[str]) -> list[str]:
    settings = cluster_settings()
    return [p for p in paths if _value(config, p) != settings[p].default]


def validate_cluster_config(
    config: ClusterConfig,
    given: Mapping[str, Setting] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    everything: bool = False,
) -> None:
    """Refuse, with one `InvalidSetting` naming the setting, what the sections cannot check.

    `given` (path -> `Setting`) says where values came from, so the error names
    the variable or flag; without it the field is named. `everything` runs the
    checks of default values too (tests). Then `check_environment_profile`: an
    explicit config cannot lower ``KVMESH_PROFILE=production``.
    """
    settings = cluster_settings()
    sources = given or {}
    for rc in REGISTRY_CHECKS:
        if not everything and not _changed(config, (rc.path,)):
            continue
        value = _value(config, rc.path)
        registry = _resolve(rc.registry)
        if rc.key(value) not in registry:
            info = settings[rc.path]
            bad = InvalidSetting(
                f"{info.qualified}={value!r}",
                f"unknown {rc.what} {value!r}; choose one of {sorted(registry)}",
                (info.qualified,),
            )
            raise name_sources(bad, sources)
    for sc in SECTION_CHECKS:
        changed = list(sc.paths) if everything else _changed(config, sc.paths)
        if not changed:
            continue
        section = _value(config, sc.paths[0].partition(".")[0])
        try:
            _resolve(sc.function)(section)
        except InvalidSetting:
            raise
        except ConfigError as exc:
            fields = tuple(settings[p].qualified for p in changed)
            shown = ", ".join(
                f"{f}={_value(config, p)!r}" for f, p in zip(fields, changed, strict=True)
            )
            raise name_sources(InvalidSetting(shown, str(exc), fields), sources) from None
    check_environment_profile(config, os.environ if env is None else env)


CONFIG_FILE_VARIABLE = "KVMESH_CONFIG"
"""The environment variable naming a config file (the ``--config`` flag wins over it)."""

_READERS: dict[str, Callable[[str], Any]] = {
    ".toml": tomllib.loads,
    ".yaml": yaml.safe_load,
    ".yml": yaml.safe_load,
}
"""Config file suffix -> its parser (text -> plain values); nothing that builds objects."""


def _unknown(source: str, key: str, known: Collection[str]) -> InvalidSetting:
    # `policy` at the top level means `coordinator.policy`: a field's own name finds it too
    by_name = [k for k in known if k.rpartition(".")[2] == key.rpartition(".")[2]]
    close = by_name or difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return InvalidSetting(f"{source}: {key}", f"unknown setting{hint}", ())


def file_layer(path: str | Path, source: str = "--config") -> dict[str, Setting]:
    """The settings a TOML or YAML config file gives, by field path.

    The file holds the top-level fields (``num_workers = 2``) and one table per
    section, named as in `ClusterConfig` (``[coordinator]`` ``policy =
    "kv_aware"``); docs/configuration.md lists them. An unknown section or key
    is refused naming it and the closest names; values keep the file's types
    and each section checks them, naming ``<file>: <section>.<key>``. Raises
    `ConfigError` (missing file, unknown suffix, a syntax error) naming `source`.
    """
    p = Path(path)
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise ConfigError(
            f"{source}={str(path)!r}: a config file is TOML (.toml) or YAML (.yaml, .yml)"
        )
    try:
        data = reader(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{source}={str(path)!r}: cannot read it: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        where = " ".join(str(exc).split())
        raise ConfigError(f"{source}={str(path)!r} is not valid {p.suffix[1:]}: {where}") from None
    data = {} if data is None else data  # an empty YAML file
    if not isinstance(data, dict):
        raise ConfigError(f"{source}={str(path)!r}: the file must hold a table of settings")
    settings = cluster_settings()
    sections = {path.partition(".")[0] for path in settings if "." in path}
    layer: dict[str, Setting] = {}
    for key, value in data.items():
        key = str(key)
        if key in sections:
            if not isinstance(value, dict):
                raise InvalidSetting(f"{p.name}: {key}", f"must be a table of {key} settings", ())
            items = [(f"{key}.{sub}", v) for sub, v in value.items()]
        elif isinstance(value, dict):
            close = difflib.get_close_matches(key, sections, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; sections: {sorted(sections)}"
            raise InvalidSetting(f"{p.name}: {key}", f"unknown section{hint}", ())
        else:
            items = [(key, value)]
        for field_path, v in items:
            if field_path not in settings:
                raise _unknown(p.name, field_path, settings)
            layer[field_path] = Setting(v, f"{p.name}: {field_path}")
    return layer


def load_cluster_config(
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    names: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> ClusterConfig:
    """The `ClusterConfig` of defaults < config file < ``KVMESH_*`` environment <
    `overrides`, checked.

    `config_file` (the ``--config`` flag, an argument) names a TOML or YAML
    file; without it ``KVMESH_CONFIG`` in `env` may name one.

    `overrides` maps field paths (``"coordinator.policy"``, ``"num_workers"``, see
    `kvmesh.config.cluster_settings`) to values; None means "not given".
    `names` says how the caller calls them in errors (``{"coordinator.policy":
    "--policy"}``). `env` defaults to this process's environment. Raises one
    `InvalidSetting` (a `ConfigError`) naming the first bad setting; nothing is
    started. The security profile itself (`kvmesh.security.check_cluster`) is
    checked where a cluster starts (`kvmesh.app.connect`), since it reads Ray's
    variables too.
    """
    environment = os.environ if env is None else env
    files: dict[str, Setting] = {}
    if config_file is not None:
        files = file_layer(config_file, "--config")
    elif environment.get(CONFIG_FILE_VARIABLE):
        files = file_layer(environment[CONFIG_FILE_VARIABLE], CONFIG_FILE_VARIABLE)
    given = merge_layers(files, env_layer(environment), explicit_layer(overrides or {}, names))
    config = build_cluster_config(given)
    validate_cluster_config(config, given, env=env)
    return config


def settings_for(
    config: ClusterConfig | None = None,
    config_file: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> ClusterConfig:
    """The settings the Python API runs with: `config` as given (checked; it cannot lower
    ``KVMESH_PROFILE=production``), else `load_cluster_config` with `config_file`."""
    if config is None:
        return load_cluster_config(env=env, config_file=config_file)
    if config_file is not None:
        raise ConfigError("give either config or config_file, not both")
    validate_cluster_config(config, env=env)
    return config
