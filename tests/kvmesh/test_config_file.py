"""One configuration path: defaults < config file < KVMESH_* environment < explicit values,
and the one generated table (docs/configuration.md) that documents every field.

No Ray here: the CLI's and the Python API's loaders are called as they are
called before anything starts; tests/kvmesh/test_config_actors.py proves the
file and the environment reach the actors of a running cluster.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.app.cli import main
from kvmesh.app.commands import cluster_config, configure_start, configure_status
from kvmesh.app.config_table import (
    README_BEGIN,
    README_END,
    README_PATH,
    TABLE_PATH,
    readme_table,
    render_readme_table,
    render_table,
    undocumented,
)
from kvmesh.config import cluster_settings
from kvmesh.errors import ConfigError, InvalidSetting
from kvmesh.settings import file_layer, load_cluster_config, settings_for

ROOT = Path(__file__).resolve().parents[2]

TOML = """\
num_workers = 2

[coordinator]
policy = "round_robin"
temperature = 0.5

[model]
seed = 7
"""

YAML = """\
num_workers: 2
coordinator:
  policy: round_robin
  temperature: 0.5
model:
  seed: 7
"""


@pytest.fixture(params=[("cluster.toml", TOML), ("cluster.yaml", YAML)], ids=["toml", "yaml"])
def config_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    name, text = request.param
    path = tmp_path / name
    path.write_text(text)
    return path


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the table -------------------------------------------------------------------------------


def test_the_committed_configuration_table_is_the_generated_one() -> None:
    committed = (ROOT / TABLE_PATH).read_text(encoding="utf-8")
    assert committed == render_table(), (
        "docs/configuration.md drifted from kvmesh/config.py: run `kvmesh config --table`"
    )


def test_every_setting_has_a_description_in_the_table() -> None:
    assert undocumented() == [], "give these fields a comment in kvmesh/config.py"
    table = render_table()
    for path, info in cluster_settings().items():
        assert f"| `{path}` | `{info.env}` |" in table


def test_kvmesh_config_table_writes_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "configuration.md"
    assert main(["config", "--table", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render_table()
    missing = tmp_path / "no-such-folder" / "configuration.md"
    assert main(["config", "--table", "--output", str(missing)]) == 2
    [err] = capsys.readouterr().err.splitlines()[-1:]
    assert err == f"kvmesh config: error: cannot write {missing}: No such file or directory"


def test_the_readme_shows_the_generated_table() -> None:
    readme = (ROOT / README_PATH).read_text(encoding="utf-8")
    assert readme.count(README_BEGIN) == 1 and readme.count(README_END) == 1
    assert readme_table(readme) == render_readme_table(), (
        "README.md's configuration table drifted from kvmesh/config.py: run `kvmesh config --table`"
    )
    for path, info in cluster_settings().items():
        assert f"| `{path}` | `{info.env}` |" in readme_table(readme)


def test_a_type_that_holds_a_bar_does_not_split_its_table_row() -> None:
    row = next(line for line in render_table().splitlines() if "`transfer.tls_ca`" in line)
    assert row.replace("\\|", "").count("|") == 6  # five cells


README_AROUND = "# A project\n\nprose before\n\n{table}\nprose after, kept as it is\n"


def test_kvmesh_config_table_rewrites_only_what_lies_between_the_readmes_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    stale = f"{README_BEGIN}\n| an old row |\n{README_END}"
    (tmp_path / "README.md").write_text(README_AROUND.format(table=stale))
    assert main(["config", "--table"]) == 0
    readme = (tmp_path / "README.md").read_text()
    fresh = f"{README_BEGIN}\n{render_readme_table()}{README_END}"
    assert readme == README_AROUND.format(table=fresh)
    assert (tmp_path / TABLE_PATH).read_text() == render_table()
    assert main(["config", "--table"]) == 0  # again: nothing changes
    assert (tmp_path / "README.md").read_text() == readme


def test_the_table_written_elsewhere_leaves_the_readme_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    stale = README_AROUND.format(table=f"{README_BEGIN}\nold\n{README_END}")
    (tmp_path / "README.md").write_text(stale)
    assert main(["config", "--table", "--output", "elsewhere.md"]) == 0
    assert (tmp_path / "README.md").read_text() == stale
    other = tmp_path / "OTHER.md"
    other.write_text(stale)
    assert main(["config", "--table", "--output", "-", "--readme", str(other)]) == 0
    assert readme_table(other.read_text()) == render_readme_table()


def test_a_readme_without_the_markers_is_one_error_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# no markers here\n")
    assert main(["config", "--table"]) == 2
    [err] = capsys.readouterr().err.splitlines()
    assert err.startswith("kvmesh config: error: README.md has no generated table to update")
    assert README_BEGIN in err and README_END in err
    assert (tmp_path / "README.md").read_text() == "# no markers here\n"
    assert not (tmp_path / TABLE_PATH).exists()


# -- the file layer --------------------------------------------------------------------------


def test_a_toml_or_yaml_file_sets_top_level_fields_and_sections(config_file: Path) -> None:
    cfg = load_cluster_config(config_file=config_file, env={})
    assert cfg.num_workers == 2
    assert (cfg.coordinator.policy, cfg.coordinator.temperature) == ("round_robin", 0.5)
    assert cfg.model.seed == 7
    assert cfg.pool.num_pages == cluster_settings()["pool.num_pages"].default


def test_the_environment_wins_over_the_file_and_explicit_values_over_both(
    config_file: Path,
) -> None:
    env = {"KVMESH_POLICY": "random", "KVMESH_MODEL_SEED": "9"}
    cfg = load_cluster_config(config_file=config_file, env=env)
    assert (cfg.coordinator.policy, cfg.model.seed, cfg.num_workers) == ("random", 9, 2)
    cfg = load_cluster_config(
        {"coordinator.policy": "least_loaded"}, config_file=config_file, env=env
    )
    assert cfg.coordinator.policy == "least_loaded"


def test_kvmesh_config_names_the_file_and_a_flag_names_another(
    config_file: Path, tmp_path: Path
) -> None:
    assert load_cluster_config(env={"KVMESH_CONFIG": str(config_file)}).model.seed == 7
    other = _write(tmp_path, "other.toml", "[model]\nseed = 11\n")
    env = {"KVMESH_CONFIG": str(config_file)}
    assert load_cluster_config(config_file=other, env=env).model.seed == 11


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.toml", "[coordinator]\npolicyy = 'kv_aware'\n", "a.toml: coordinator.policyy: unknown"),
        ("a.toml", "policy = 'kv_aware'\n", "did you mean coordinator.policy?"),
        (
            "a.toml",
            "[coordinatr]\npolicy = 'kv_aware'\n",
            "a.toml: coordinatr: unknown section; did you mean coordinator?",
        ),
        ("a.yaml", "pool: 12\n", "a.yaml: pool: must be a table of pool settings"),
        ("a.yaml", "pool:\n  num_pages: '64'\n", "a.yaml: pool.num_pages='64': must be an integer"),
        ("a.yaml", "pool:\n  num_pages: 1\n", "a.yaml: pool.num_pages=1: must be at least 2"),
        ("a.toml", "[model]\nseed = -1\n", "a.toml: model.seed=-1: must be >= 0"),
        ("a.toml", "[coordinator]\npolicy = 'fastest'\n", "unknown routing policy 'fastest'"),
        ("a.toml", "[coordinator\n", "is not valid toml"),
        ("a.yaml", "- 1\n- 2\n", "must hold a table of settings"),
        ("a.ini", "x = 1\n", "a config file is TOML (.toml) or YAML (.yaml, .yml)"),
    ],
)
def test_a_bad_file_is_one_error_naming_the_key(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(ConfigError) as bad:
        load_cluster_config(config_file=path, env={})
    assert message in str(bad.value)
    assert "\n" not in str(bad.value)


def test_a_missing_file_is_named_by_where_it_was_given(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"^KVMESH_CONFIG='.*nope.toml': cannot read it"):
        load_cluster_config(env={"KVMESH_CONFIG": missing})
    with pytest.raises(ConfigError, match=r"^--config='.*nope.toml': cannot read it"):
        load_cluster_config(config_file=missing, env={})


def test_an_empty_yaml_file_sets_nothing(tmp_path: Path) -> None:
    assert file_layer(_write(tmp_path, "empty.yaml", "")) == {}


# -- entry points: the CLI and the Python API read the same layers -------------------------


def test_the_cli_reads_the_file_the_environment_and_its_flags_in_that_order(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    configure_start(parser)
    monkeypatch.delenv("KVMESH_POLICY", raising=False)
    monkeypatch.setenv("KVMESH_CONFIG", str(config_file))
    cfg = cluster_config(parser.parse_args([]))
    assert (cfg.num_workers, cfg.coordinator.policy, cfg.model.seed) == (2, "round_robin", 7)
    monkeypatch.setenv("KVMESH_NUM_WORKERS", "3")
    assert cluster_config(parser.parse_args([])).num_workers == 3
    assert cluster_config(parser.parse_args(["--workers", "5"])).num_workers == 5
    monkeypatch.delenv("KVMESH_CONFIG")
    monkeypatch.delenv("KVMESH_NUM_WORKERS")
    status = argparse.ArgumentParser()
    configure_status(status)
    flagged = cluster_config(status.parse_args(["--config", str(config_file)]))
    assert flagged.coordinator.policy == "round_robin"


def test_the_python_api_reads_the_file_as_the_cli_does(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVMESH_POLICY", "KVMESH_MODEL_SEED", "KVMESH_NUM_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    assert settings_for(config_file=config_file).coordinator.policy == "round_robin"
    monkeypatch.setenv("KVMESH_CONFIG", str(config_file))
    assert settings_for().model.seed == 7
    with pytest.raises(ConfigError, match="either config or config_file"):
        settings_for(load_cluster_config(env={}), config_file)


def test_kvmesh_config_prints_each_value_and_where_it_came_from(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVMESH_CONFIG", raising=False)
    monkeypatch.setenv("KVMESH_MODEL_SEED", "9")
    monkeypatch.setenv("KVMESH_AUTH_TOKEN", "a-secret-token-of-32-characters!")
    assert main(["config", "--config", str(config_file)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["num_workers"].endswith(f"[{config_file.name}: num_workers]")
    assert "9  [KVMESH_MODEL_SEED]" in lines["model.seed"]
    assert "[default]" in lines["pool.num_pages"]
    assert "a-secret" not in lines["transfer.auth_token"]
    assert "(set)" in lines["transfer.auth_token"]


def test_kvmesh_config_refuses_a_bad_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "bad.toml", "[pool]\nnum_pagez = 3\n")
    assert main(["config", "--config", str(path)]) == 2
    [err] = capsys.readouterr().err.splitlines()
    assert err.startswith(
        "kvmesh config: error: bad.toml: pool.num_pagez: unknown setting; did you mean "
        "pool.num_pages"
    )


def test_an_unknown_setting_error_is_an_invalid_setting(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.toml", "[pool]\nsize = 3\n")
    with pytest.raises(InvalidSetting):
        load_cluster_config(config_file=path, env={})
