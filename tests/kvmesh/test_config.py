"""Configuration: defaults, environment variables, clear errors."""

from __future__ import annotations

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
