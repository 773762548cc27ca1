"""Configuration: defaults, environment variables, clear errors."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.config import CoordinatorConfig, HashConfig, PoolConfig, from_env
from kvmesh.errors import ConfigError


def test_environment_overrides_defaults_and_flags_override_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVMESH_PAGE_SIZE", "32")
    monkeypatch.setenv("KVMESH_ALGO", "xxh3_128")
    cfg = from_env(HashConfig)
    assert cfg.page_size == 32 and cfg.algo == "xxh3_128"
    assert from_env(HashConfig, page_size=64).page_size == 64


def test_booleans_and_floats_parse_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_ENABLE_CACHING", "off")
    monkeypatch.setenv("KVMESH_TEMPERATURE", "0.5")
    assert from_env(PoolConfig).enable_caching is False
    assert from_env(CoordinatorConfig).temperature == 0.5


def test_bad_values_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_PAGE_SIZE", "many")
    with pytest.raises(ConfigError, match="KVMESH_PAGE_SIZE"):
        from_env(HashConfig)
    with pytest.raises(ConfigError):
        HashConfig(page_size=0)
    with pytest.raises(ConfigError, match="null page"):
        PoolConfig(num_pages=1)


def test_a_none_override_leaves_the_environment_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_POLICY", "round_robin")
    assert from_env(CoordinatorConfig, policy=None).policy == "round_robin"


def test_the_hash_seed_and_the_model_and_router_seeds_have_separate_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvmesh.config import ModelConfig

    monkeypatch.setenv("KVMESH_SEED", "cluster-secret")
    monkeypatch.setenv("KVMESH_MODEL_SEED", "7")
    monkeypatch.setenv("KVMESH_ROUTER_SEED", "9")
    assert from_env(HashConfig).seed == "cluster-secret"
    assert from_env(ModelConfig).seed == 7
    assert from_env(CoordinatorConfig).seed == 9


# -- one loader for every entry point (kvmesh.settings) ---------------------------------------


def test_every_field_has_its_own_variable_and_a_known_type() -> None:
    from kvmesh.config import _ACCEPTS, cluster_settings

    settings = cluster_settings()
    variables = [info.env for info in settings.values()]
    assert len(set(variables)) == len(variables)  # a variable sets one field
    assert all(info.type in _ACCEPTS for info in settings.values())
    assert settings["hash.seed"].env == "KVMESH_SEED"
    assert settings["model.seed"].env == "KVMESH_MODEL_SEED"
    assert settings["model.device"].env == "KVMESH_DEVICE"
    assert settings["num_workers"].env == "KVMESH_NUM_WORKERS"


def test_every_default_passes_every_registry_and_transfer_check() -> None:
    from kvmesh.config import ClusterConfig
    from kvmesh.settings import validate_cluster_config

    validate_cluster_config(ClusterConfig(), env={}, everything=True)


def test_layers_stack_defaults_then_environment_then_explicit_values() -> None:
    from kvmesh.settings import load_cluster_config

    env = {"KVMESH_POLICY": "round_robin", "KVMESH_MODEL_SEED": "7", "KVMESH_DEVICE": "cuda:1"}
    cfg = load_cluster_config(env=env)
    assert (cfg.coordinator.policy, cfg.model.seed, cfg.model.device) == (
        "round_robin",
        7,
        "cuda:1",
    )
    assert cfg.hash.seed == HashConfig().seed  # untouched fields keep their defaults
    flagged = load_cluster_config({"coordinator.policy": "random", "model.seed": None}, env=env)
    assert (flagged.coordinator.policy, flagged.model.seed) == ("random", 7)


def test_an_empty_variable_leaves_an_optional_setting_unset() -> None:
    from kvmesh.settings import load_cluster_config

    cfg = load_cluster_config(env={"KVMESH_TLS_CA": "", "KVMESH_AUTH_TOKEN": ""})
    assert cfg.transfer.tls_ca is None and cfg.transfer.auth_token is None


def test_an_error_names_the_flag_or_variable_the_value_came_from() -> None:
    from kvmesh.errors import InvalidSetting
    from kvmesh.settings import load_cluster_config

    with pytest.raises(InvalidSetting, match=r"^--num-pages=1: .*null page.*PoolConfig\.num_pages"):
        load_cluster_config({"pool.num_pages": 1}, env={}, names={"pool.num_pages": "--num-pages"})
    with pytest.raises(InvalidSetting, match=r"^KVMESH_NUM_PAGES='1': "):
        load_cluster_config(env={"KVMESH_NUM_PAGES": "1"})
    with pytest.raises(InvalidSetting, match=r"^PoolConfig\.num_pages=1: must be at least 2"):
        load_cluster_config({"pool.num_pages": 1}, env={})
    with pytest.raises(InvalidSetting, match=r"^KVMESH_ROUTER_SEED='x': is not an integer"):
        load_cluster_config(env={"KVMESH_ROUTER_SEED": "x"})


def test_an_unknown_setting_is_refused_with_the_closest_names() -> None:
    from kvmesh.settings import load_cluster_config

    with pytest.raises(ConfigError, match=r"unknown setting 'pool.num_page'.*pool\.num_pages"):
        load_cluster_config({"pool.num_page": 64}, env={})


@pytest.mark.parametrize(
    ("section", "changes", "field"),
    [
        ("HashConfig", {"page_size": "16"}, "page_size"),
        ("PoolConfig", {"enable_caching": 1}, "enable_caching"),
        ("TransferConfig", {"port": True}, "port"),
        ("TransferConfig", {"auth_token": 1234}, "auth_token"),
        ("ClusterConfig", {"pool": "small"}, "pool"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(
    section: str, changes: dict[str, Any], field: str
) -> None:
    import kvmesh.config
    from kvmesh.errors import InvalidSetting

    with pytest.raises(InvalidSetting, match=rf"^{section}\.{field}=.*: must be "):
        getattr(kvmesh.config, section)(**changes)


@pytest.mark.parametrize(
    ("section", "changes", "field"),
    [
        ("TransferConfig", {"port": 70000}, "port"),
        ("TransferConfig", {"deadline_s": 0.0}, "deadline_s"),
        ("TransferConfig", {"retries": -1}, "retries"),
        ("CoordinatorConfig", {"pull_cost": 1.5}, "pull_cost"),
        ("CoordinatorConfig", {"temperature": float("nan")}, "temperature"),
        ("ModelConfig", {"num_heads": 6, "num_kv_heads": 4}, "num_heads"),
        ("ModelConfig", {"seed": 2**70}, "seed"),
        ("ClusterConfig", {"num_workers": -1}, "num_workers"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_the_field(
    section: str, changes: dict[str, Any], field: str
) -> None:
    import kvmesh.config
    from kvmesh.errors import InvalidSetting

    with pytest.raises(InvalidSetting, match=rf"^{section}\.{field}=") as bad:
        getattr(kvmesh.config, section)(**changes)
    assert bad.value.fields == (f"{section}.{field}",)


def test_the_cli_reads_the_model_seed_and_device_like_the_python_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from kvmesh.app.commands import cluster_config, configure_status
    from kvmesh.settings import load_cluster_config

    monkeypatch.setenv("KVMESH_MODEL_SEED", "7")
    monkeypatch.setenv("KVMESH_DEVICE", "cuda")
    monkeypatch.setenv("KVMESH_AUTH_TOKEN", "t0k3n-of-the-cluster-32-chars-xx")
    parser = argparse.ArgumentParser()
    configure_status(parser)
    from_cli = cluster_config(parser.parse_args([]))
    assert (from_cli.model.seed, from_cli.model.device) == (7, "cuda")
    assert from_cli == load_cluster_config()


def test_an_explicit_config_cannot_lower_the_environments_production_profile() -> None:
    from kvmesh.config import ClusterConfig, SecurityConfig
    from kvmesh.security import check_environment_profile

    with pytest.raises(ConfigError, match="KVMESH_PROFILE=production is set"):
        check_environment_profile(ClusterConfig(), {"KVMESH_PROFILE": "production"})
    production = ClusterConfig(security=SecurityConfig(profile="production"))
    check_environment_profile(production, {"KVMESH_PROFILE": "production"})
    check_environment_profile(ClusterConfig(), {"KVMESH_PROFILE": "dev"})
    check_environment_profile(production, {})
