"""The CLI's help names every built-in family's presets and every embedded config: both lists are written out in
``dhp.cli`` (the registry imports torch and the families, which a ``--help`` should not wait for), so this holds
them to the registry and to the package's files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dhp.cli import EMBEDDED_NAMES, PRESET_NAMES, config_source, default_config_path, main, parse_command_line
from dhp.config import load_config
from dhp.errors import UsageError
from dhp.models.registry import builtin_names, get_family


@pytest.mark.parametrize("command", ["plan", "info"])
def test_the_help_lists_every_builtin_preset(command: str, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal's width, and may break at a hyphen
    presets = [p for name in builtin_names() for p in get_family(name).presets]
    assert sorted(p.strip() for p in PRESET_NAMES.split("|")) == sorted(presets)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help's lines
    assert all(p in shown for p in presets), [p for p in presets if p not in shown]


def test_every_embedded_config_loads_by_name(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)  # a pip install: no configs/ folder beside the user
    shipped = sorted(p.stem for p in default_config_path().parent.glob("*.yaml"))
    assert sorted(EMBEDDED_NAMES) == shipped
    families = {}
    for name in EMBEDDED_NAMES:
        path, overrides = config_source(name, ["train.steps=7"])
        cfg = load_config(path, overrides)
        assert cfg.train.steps == 7 and Path(path).name == f"{name}.yaml"
        families[name] = cfg.model.family
    assert families["omni_demo"] == "qwen2_5_omni" and families["qwen3_vl_demo"] == "qwen3_vl"
    (tmp_path / "omni_demo.yaml").write_text("train:\n  steps: 3\n")  # a file of that name here wins
    assert load_config(*config_source("omni_demo.yaml", [])).train.steps == 3
    (tmp_path / "demo").mkdir()  # a folder (a run's output) named as an embedded config: the config
    assert config_source("demo", []) == (default_config_path(), [])
    with pytest.raises(UsageError, match="is a directory, not a YAML config file"):
        config_source(str(tmp_path / "demo"), [])
    assert config_source(None, ["train.lr=1"]) == (None, ["train.lr=1"])
    assert config_source("train.lr=1", ["train.steps=2"]) == (None, ["train.lr=1", "train.steps=2"])


def test_an_unknown_config_name_lists_the_embedded_ones(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as e:
        config_source("omni_dmo", [])
    assert "omni_dmo does not exist" in str(e.value) and all(n in str(e.value) for n in EMBEDDED_NAMES)
    with pytest.raises(UsageError):
        config_source("sub/omni_demo.yaml", [])  # a path is a path: never the embedded one


def test_overrides_may_follow_the_flags() -> None:
    args = parse_command_line(["bench", "demo", "--steps", "3", "train.lr=1e-4", "--layouts", "dhp", "a.b=2"])
    assert (args.config, args.overrides, args.steps, args.layouts) == ("demo", ["train.lr=1e-4", "a.b=2"], 3, "dhp")
    args = parse_command_line(["train", "demo", "x.y=1", "--debug", "y.z=2"])
    assert args.overrides == ["x.y=1", "y.z=2"] and args.debug
    args = parse_command_line(["data", "check", "--debug", "data.max_length=4", "data.min_pixels=9"])
    assert config_source(args.config, args.overrides) == (None, ["data.max_length=4", "data.min_pixels=9"])
    for argv in (["bench", "demo", "--stepz", "2", "a.b=1"], ["plan", "tiny", "--gpus", "2", "a.b=1"]):
        with pytest.raises(SystemExit) as e:  # an unknown flag, or an override where a command takes none
            parse_command_line(argv)
        assert e.value.code == 2


def test_version_names_dhp_and_what_it_runs_on(capsys: Any) -> None:
    import platform

    import ray
    import torch

    import dhp

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"dhp {dhp.__version__} (torch {torch.__version__}, ray {ray.__version__}, transformers ")
    assert line.endswith(f"python {platform.python_version()})")
