"""Typed config: YAML + dotted overrides, errors that name the key."""

from __future__ import annotations

import pytest

from dhp.cli import default_config_path
from dhp.config import ConfigError, load_config


def test_embedded_default_loads():
    cfg = load_config(default_config_path())
    assert cfg.model.preset == "tiny"
    assert cfg.runtime.backend in ("local", "ray")


def test_overrides_are_typed(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1.0e-3\n")
    cfg = load_config(f, ["train.lr=3e-4", "train.steps=7", "vision.trainable=false", "vision.parallel.dp=2",
                          "data.on_error=skip", "train.betas=[0.9, 0.95]"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.steps == 7
    assert cfg.vision.trainable is False
    assert cfg.vision.parallel.dp == 2
    assert cfg.data.on_error == "skip"
    assert cfg.train.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown key train.lrr"),
        ("train.steps=ten", "train.steps: expected an integer"),
        ("train.lr=abc", "train.lr: expected a number"),
        ("data.on_error=ignore", "data.on_error: expected one of"),
        ("vision.trainable=maybe", "vision.trainable: expected true or false"),
        ("train.steps=0", "train.steps: must be > 0"),
        ("runtime.backend=mpi", "runtime.backend"),
        ("bogus.key=1", "unknown key bogus"),
        ("train", "not of the form key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.yaml")


def test_nothing_trainable_is_rejected():
    with pytest.raises(ConfigError, match="nothing to train"):
        load_config(None, ["vision.trainable=false", "merger.trainable=false", "text.trainable=false"])
