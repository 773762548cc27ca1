"""Security policy: deployment profiles, bind addresses and tenant binding.

Pure (no Ray, no gRPC): the client, the CLI and the workers call these checks
before they start anything, and tests call them directly.

Profiles (`PROFILES`, a name -> check registry):

- ``dev`` (the default) allows plaintext and no tokens, but only on
  loopback: a bind address beyond 127.0.0.0/8 or ::1 is refused unless
  `SecurityConfig.allow_remote` says so;
- ``production`` refuses to start unless Ray token authentication is on
  (``RAY_AUTH_MODE=token`` in the environment) and kvmesh's gRPC uses TLS
  (certificate and key; mutual TLS with a cluster CA unless
  `require_mtls` is off) and a bearer token of at least
  `MIN_TOKEN_CHARS` characters; when the hash config is given, it must be
  SHA-256 with a seed other than the built-in default.

Every refusal is one `ConfigError` that lists each missing piece with the
variable to set. The settings these checks read come from
`kvmesh.settings.load_cluster_config`, the same for the CLI and the Python
API; `check_environment_profile` keeps a config built by code from lowering
``KVMESH_PROFILE=production``.

Tenants (`TenantPolicy`): pages of different ``cache_salt`` never match
(`kvmesh.hashing`), so the salt is the tenant boundary. Whoever chooses the
salt chooses the tenant; by default that is the caller (the salt comes with
the request). An operator can bind salts to API keys instead: then the
salt comes from the key, a salt sent by the caller is ignored, and an
unknown key is `Unauthenticated`. The policy belongs in the process that
hashes a request's pages for untrusted callers (the gateway in front of
`kvmesh.client.KVMesh`), because the page hashes are computed there.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvmesh.config import DEFAULT_SEED, ClusterConfig, HashConfig, SecurityConfig, TransferConfig
from kvmesh.errors import ConfigError, InvalidInput, Unauthenticated

RAY_AUTH_MODE_VAR = "RAY_AUTH_MODE"
API_KEYS_VAR = "KVMESH_API_KEYS"
"""Inline JSON ``{api_key: cache_salt}`` (for small setups and tests)."""
API_KEYS_FILE_VAR = "KVMESH_API_KEYS_FILE"
"""Path of a JSON or YAML file ``{api_key: cache_salt}`` (or ``{api_keys: {...}}``)."""

MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})

_GENERATE_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


# ------------------------------------------------------------------ bind addresses


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine: 127.0.0.0/8, ::1 or ``localhost``.

    Any other name, and the wildcards ``0.0.0.0`` / ``::`` / ``""``, are not
    loopback (a name could resolve anywhere, so it is never trusted).
    """
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_bind_address(host: str, allow_remote: bool) -> None:
    """Refuse to bind beyond loopback unless `allow_remote` (``ConfigError`` says how)."""
    if not isinstance(host, str):
        raise ConfigError(f"a bind address must be a string, got {type(host).__name__}")
    if allow_remote or is_loopback(host):
        return
    shown = host or "(empty: every interface)"
    raise ConfigError(
        f"refusing to bind {shown}: the dev profile binds loopback only. Set "
        "KVMESH_ALLOW_REMOTE=1 (SecurityConfig.allow_remote) to serve other hosts, and use "
        "the production profile (TLS, tokens) on any network you do not control"
    )


# ---------------------------------------------------------------------- profiles


def _file_problem(path: str, what: str, var: str) -> str | None:
    if not Path(path).is_file():
        return f"{what} {path!r} is not a readable file (set {var} to an existing PEM file)"
    return None


def _production_problems(
    transfer: TransferConfig,
    env: Mapping[str, str],
    require_mtls: bool,
    hashing: HashConfig | None,
) -> list[str]:
    problems: list[str] = []
    mode = env.get(RAY_AUTH_MODE_VAR, "")
    if mode.strip().lower() != "token":
        problems.append(
            f"Ray token authentication is off ({RAY_AUTH_MODE_VAR}={mode or '<unset>'}): set "
            f"{RAY_AUTH_MODE_VAR}=token on every node, with the cluster token in RAY_AUTH_TOKEN "
            "or RAY_AUTH_TOKEN_PATH (Ray pickles actor arguments: whoever reaches Ray runs code)"
        )
    tls = (
        ("TLS certificate", transfer.tls_cert, "tls_cert"),
        ("TLS key", transfer.tls_key, "tls_key"),
    )
    for what, path, name in tls:
        var = "KVMESH_" + name.upper()
        if not path:
            problems.append(f"kvmesh gRPC has no {what}: set {var} (TransferConfig.{name})")
        elif (bad := _file_problem(path, what, var)) is not None:
            problems.append(bad)
    if require_mtls:
        if not transfer.tls_ca:
            problems.append(
                "kvmesh gRPC does not require client certificates: set KVMESH_TLS_CA to the "
                "cluster CA (mutual TLS), or SecurityConfig.require_mtls=False to accept "
                "server-only TLS"
            )
        elif (bad := _file_problem(transfer.tls_ca, "TLS CA", "KVMESH_TLS_CA")) is not None:
            problems.append(bad)
    if transfer.transport == "dist":
        problems.append(
            "transport='dist' moves pages over torch.distributed (gloo/NCCL) without TLS or a "
            "token, and its rendezvous store listens on every interface: set "
            "KVMESH_TRANSPORT=grpc (TransferConfig.transport)"
        )
    token = transfer.auth_token or ""
    if len(token) < MIN_TOKEN_CHARS:
        state = "unset" if not token else f"only {len(token)} characters"
        problems.append(
            f"kvmesh gRPC bearer token is {state}: set KVMESH_AUTH_TOKEN to a random secret of "
            f"at least {MIN_TOKEN_CHARS} characters ({_GENERATE_HINT})"
        )
    if hashing is not None:
        if hashing.algo != "sha256":
            problems.append(
                f"page hash {hashing.algo!r} is not collision resistant against an adversary: "
                "set HashConfig.algo='sha256'"
            )
        if hashing.seed == DEFAULT_SEED:
            problems.append(
                "the page-hash seed is the built-in default: set HashConfig.seed "
                "(ClusterConfig.hash.seed) to a per-cluster secret, the same on every node"
            )
    return problems


def _check_dev(
    transfer: TransferConfig,
    env: Mapping[str, str],
    *,
    allow_remote: bool,
    require_mtls: bool,
    hashing: HashConfig | None,
) -> None:
    check_bind_address(transfer.host, allow_remote)


def _check_production(
    transfer: TransferConfig,
    env: Mapping[str, str],
    *,
    allow_remote: bool,
    require_mtls: bool,
    hashing: HashConfig | None,
) -> None:
    problems = _production_problems(transfer, env, require_mtls, hashing)
    if problems:
        raise ConfigError(
            "the production profile refuses to start:\n  - " + "\n  - ".join(problems)
        )


ProfileCheck = Callable[..., None]

PROFILES: dict[str, ProfileCheck] = {"dev": _check_dev, "production": _check_production}
"""Registry of deployment profiles by name: each checks a config and raises `ConfigError`."""


def check_profile(
    profile: str,
    transfer: TransferConfig,
    env: Mapping[str, str] = os.environ,
    *,
    allow_remote: bool = False,
    require_mtls: bool = True,
    hashing: HashConfig | None = None,
) -> None:
    """Raise `ConfigError` unless `transfer` (and `env`, `hashing`) satisfy `profile`.

    ``dev``: loopback binds only, unless `allow_remote`. ``production``: see
    the module docstring; it binds wherever it is told. Reads `env` only,
    changes nothing.
    """
    check = PROFILES.get(profile)
    if check is None:
        raise ConfigError(f"unknown security profile {profile!r}; choose one of {sorted(PROFILES)}")
    check(transfer, env, allow_remote=allow_remote, require_mtls=require_mtls, hashing=hashing)


def check_cluster(config: ClusterConfig, env: Mapping[str, str] = os.environ) -> None:
    """`check_profile` for a whole cluster config (its `SecurityConfig`, transfer and hashing)."""
    sec = config.security
    check_profile(
        sec.profile,
        config.transfer,
        env,
        allow_remote=sec.allow_remote,
        require_mtls=sec.require_mtls,
        hashing=config.hash,
    )
    if sec.profile == "dev" and config.coordinator.api_port >= 0:
        # the coordinator's routing API binds by the page service's rule (docs/scale.md)
        check_bind_address(config.coordinator.api_host, sec.allow_remote)


PROFILE_VAR = "KVMESH_PROFILE"


def check_environment_profile(config: ClusterConfig, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a config that runs below the production profile the environment asks for.

    A config built by code is used as it is, except that it cannot lower the
    operator's ``KVMESH_PROFILE=production``: a program that passes a plain
    `ClusterConfig()` would otherwise start a development cluster (plaintext,
    no token, the built-in seed) on a host set up for production.
    """
    wanted = env.get(PROFILE_VAR, "").strip()
    if wanted == "production" and config.security.profile != "production":
        raise ConfigError(
            f"{PROFILE_VAR}=production is set but the config asks for the "
            f"{config.security.profile!r} profile: build the config with "
            "kvmesh.settings.load_cluster_config() (it reads the environment) or set "
            f"SecurityConfig(profile='production'); unset {PROFILE_VAR} for a development run"
        )


# ----------------------------------------------------------------------- tenants


def _key_digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


class TenantPolicy:
    """The operator's API key -> ``cache_salt`` map; empty means salts are not bound.

    Only SHA-256 digests of the keys are kept, so a dump of the process does
    not hold usable keys and a lookup compares digests, not secrets. Several
    keys may share a salt (one tenant, several keys).
    """

    __slots__ = ("_salts",)

    def __init__(self, salts_by_key: Mapping[str, str] | None = None) -> None:
        salts: dict[bytes, str] = {}
        for key, salt in (salts_by_key or {}).items():
            if not isinstance(key, str) or not key:
                raise ConfigError("an API key must be a non-empty string")
            if not isinstance(salt, str) or not salt:
                raise ConfigError(
                    f"the cache_salt of API key ...{key[-4:]} must be a non-empty string, "
                    f"got {salt!r}"
                )
            salts[_key_digest(key)] = salt
        self._salts = salts

    @property
    def bound(self) -> bool:
        """Whether salts come from API keys (True) or from the requests (False)."""
        return bool(self._salts)

    def __len__(self) -> int:
        return len(self._salts)

    def __repr__(self) -> str:  # never the keys or salts
        return f"TenantPolicy({len(self._salts)} API keys)"

    def resolve_salt(self, api_key: str | None, requested_salt: str | None) -> str | None:
        """The salt a request gets.

        Bound: the key's salt, whatever the caller asked for; no key or an
        unknown one raises `Unauthenticated`. Not bound: `requested_salt`.
        """
        if requested_salt is not None and not isinstance(requested_salt, str):
            raise InvalidInput(
                f"cache_salt must be a string or None, got {type(requested_salt).__name__}"
            )
        if not self._salts:
            return requested_salt
        if not isinstance(api_key, str) or not api_key:
            raise Unauthenticated(
                "this cluster binds cache salts to API keys: send the tenant's API key"
            )
        salt = self._salts.get(_key_digest(api_key))
        if salt is None:
            raise Unauthenticated("unknown API key: ask the operator for a key of your tenant")
        return salt

    # -- loading ---------------------------------------------------------------

    @classmethod
    def from_data(cls, data: Any, source: str = "API key map") -> TenantPolicy:
        """From parsed JSON/YAML: ``{key: salt}`` or ``{"api_keys": {key: salt}}``."""
        if isinstance(data, Mapping) and isinstance(data.get("api_keys"), Mapping):
            data = data["api_keys"]
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{source} must map API keys to cache salts, got {type(data).__name__}"
            )
        return cls(data)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantPolicy:
        """Read a ``.json`` or ``.yaml``/``.yml`` file (YAML through ``safe_load`` only)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {str(p)!r}: {exc.strerror}") from None
        try:
            if p.suffix.lower() in (".yaml", ".yml"):
                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"API key file {str(p)!r} does not parse: {exc}") from None
        return cls.from_data(data, f"API key file {str(p)!r}")

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] = os.environ, security: SecurityConfig | None = None
    ) -> TenantPolicy:
        """From `SecurityConfig.api_keys_file`, else ``KVMESH_API_KEYS_FILE``, else
        ``KVMESH_API_KEYS`` (inline JSON); none of them: not bound."""
        path = security.api_keys_file if security is not None else None
        path = path or env.get(API_KEYS_FILE_VAR) or None
        inline = env.get(API_KEYS_VAR) or None
        if path and inline:
            raise ConfigError(
                f"both an API key file ({path!r}) and {API_KEYS_VAR} are set: keep one"
            )
        if path:
            return cls.from_file(path)
        if inline:
            try:
                data = json.loads(inline)
            except ValueError as exc:
                raise ConfigError(f"{API_KEYS_VAR} is not valid JSON: {exc}") from None
            return cls.from_data(data, API_KEYS_VAR)
        return cls()
