"""The CLI's help names every built-in family's presets: the list is written out in ``dhp.cli`` (the registry
imports torch and the families, which a ``--help`` should not wait for), so this holds it to the registry."""

from __future__ import annotations

from typing import Any

import pytest

from dhp.cli import PRESET_NAMES, main
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
