"""A mistyped ``KVMESH_*`` variable is refused, naming the closest known names, wherever the
environment layer is read (`kvmesh.config.env_layer`, `kvmesh.config.from_env`): by the CLI,
the Python API's settings and the components that read one section.

Names here are mistyped on purpose; the repository scan below skips this file.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from kvmesh.app.cli import main
from kvmesh.app.config_table import render_readme_table, render_table
from kvmesh.config import CoordinatorConfig, cluster_settings, env_layer, from_env
from kvmesh.environment import OTHER_VARIABLES, unknown_variables
from kvmesh.errors import InvalidSetting
from kvmesh.settings import load_cluster_config, settings_for

ROOT = Path(__file__).resolve().parents[2]
FIELD_VARIABLES = frozenset(info.env for info in cluster_settings().values())


def test_a_mistyped_variable_is_refused_naming_it_and_the_closest_name() -> None:
    with pytest.raises(InvalidSetting) as caught:
        load_cluster_config(env={"KVMESH_POLCY": "round_robin"})
    assert caught.value.setting == "KVMESH_POLCY"
    assert str(caught.value).startswith(
        "KVMESH_POLCY: not a variable kvmesh reads (did you mean KVMESH_POLICY?); "
        "fix the name or unset it"
    )


def test_the_refusal_never_shows_the_value_a_mistyped_secret_holds() -> None:
    with pytest.raises(InvalidSetting) as caught:
        load_cluster_config(env={"KVMESH_AUTH_TOKN": "s3cret-token-of-32-characters!!!"})
    assert "KVMESH_AUTH_TOKEN" in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_every_unknown_variable_is_named_at_once() -> None:
    env = {"KVMESH_SEDE": "x", "KVMESH_NUM_WORKRS": "2", "KVMESH_ZZZZZZZZ": "1"}
    with pytest.raises(InvalidSetting) as caught:
        load_cluster_config(env=env)
    message = str(caught.value)
    assert caught.value.setting == "KVMESH_NUM_WORKRS, KVMESH_SEDE, KVMESH_ZZZZZZZZ"
    assert "KVMESH_NUM_WORKRS: did you mean KVMESH_NUM_WORKERS" in message
    assert "KVMESH_SEDE: did you mean KVMESH_SEED" in message
    assert "KVMESH_ZZZZZZZZ: no known name is close" in message


def test_field_variables_the_other_known_variables_and_foreign_names_pass(
    tmp_path: Path,
) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text("num_workers = 3\n")
    env = {name: "1" for name in OTHER_VARIABLES}
    env |= {"KVMESH_CONFIG": str(config), "KVMESH_POLICY": "random", "RAY_ADDRESS": ""}
    env |= {"KVMESHX": "1", "kvmesh_policy": "1", "MY_KVMESH_POLICY": "1"}
    cfg = load_cluster_config(env=env)
    assert (cfg.num_workers, cfg.coordinator.policy) == (3, "random")
    assert unknown_variables(env, FIELD_VARIABLES, "KVMESH_") == []


def test_the_environment_layer_refuses_before_reading_any_value() -> None:
    with pytest.raises(InvalidSetting, match="KVMESH_TRANSPORT"):
        env_layer({"KVMESH_TRANSPORTS": "dist", "KVMESH_POLICY": "random"})


def test_a_component_reading_its_section_refuses_a_mistyped_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVMESH_TEMPRATURE", "0.5")
    with pytest.raises(InvalidSetting, match=r"did you mean KVMESH_TEMPERATURE\?"):
        from_env(CoordinatorConfig)
    monkeypatch.delenv("KVMESH_TEMPRATURE")
    monkeypatch.setenv("KVMESH_TEMPERATURE", "0.5")
    assert from_env(CoordinatorConfig).temperature == 0.5


def test_the_python_api_refuses_a_mistyped_variable() -> None:
    with pytest.raises(InvalidSetting, match="KVMESH_PROFILE"):
        settings_for(env={"KVMESH_PROFLE": "production"})


def test_the_cli_refuses_a_mistyped_variable_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVMESH_NUM_WORKRS", "2")
    assert main(["config"]) == 2
    [err] = capsys.readouterr().err.splitlines()
    assert err.startswith(
        "kvmesh config: error: KVMESH_NUM_WORKRS: not a variable kvmesh reads "
        "(did you mean KVMESH_NUM_WORKERS or KVMESH_NUM_LAYERS?)"
    )


def test_the_generated_tables_list_every_variable_that_is_not_a_setting() -> None:
    docs, readme = render_table(), render_readme_table()
    for name in OTHER_VARIABLES:
        assert f"| `{name}` |" in docs
        assert f"| `{name}` |" in readme


# -- every variable the repository names is one kvmesh knows ---------------------------------

NAME = re.compile(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b")
SCANNED = {".py", ".sh", ".md", ".toml", ".yaml", ".yml", ".example", ".cfg", ".ini", ""}


def _repository_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the files to scan are git's")
    here = Path(__file__).resolve()
    files = [ROOT / name for name in listed]
    return [
        p
        for p in files
        if p.suffix in SCANNED and p.is_file() and not p.is_symlink() and p.resolve() != here
    ]


def _named_variables(path: Path) -> set[str]:
    """The ``KVMESH_*`` names in `path`: in Python, only inside strings (a module constant
    called ``KVMESH_CALL`` is no variable); elsewhere, anywhere in the text."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        return set(NAME.findall(text))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return set(NAME.findall(text))
    return {n for t in tokens if t.type == tokenize.STRING for n in NAME.findall(t.string)}


def test_every_variable_the_repository_names_is_a_setting_or_a_known_variable() -> None:
    unknown: dict[str, list[str]] = {}
    for path in _repository_files():
        for name in _named_variables(path) - FIELD_VARIABLES - OTHER_VARIABLES.keys():
            unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert unknown == {}, (
        "kvmesh refuses these variables: make each a config field or add it, with its "
        "meaning, to kvmesh.environment.OTHER_VARIABLES (then run `kvmesh config --table`)"
    )
