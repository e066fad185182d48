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
                          "runtime.backend=ray",
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


def test_log_every_zero_is_rejected():
    """It used to pass validation and then divide by zero at the first step."""
    with pytest.raises(ConfigError, match="train.log_every"):
        load_config(None, ["train.log_every=0"])


@pytest.mark.parametrize(
    "overrides, key",
    [
        # silent no-ops: each now refused, naming the key
        (["runtime.backend=local", "vision.parallel.sequence_parallel=true"], "vision.parallel.sequence_parallel"),
        (["runtime.backend=ray", "vision.parallel.tp=2", "vision.parallel.sequence_parallel=true"],
         "vision.parallel.sequence_parallel"),
        (["runtime.backend=ray", "text.parallel.sequence_parallel=true"], "text.parallel.sequence_parallel"),
        (["runtime.backend=ray", "text.parallel.zero=1"], "text.parallel.zero=1"),
        (["runtime.backend=ray", "vision.parallel.zero=3"], "vision.parallel.zero=3"),
        (["runtime.backend=ray", "text.parallel.tp=2", "text.parallel.zero=3"], "text.parallel.zero=3"),
        (["runtime.backend=local", "text.parallel.dp=2"], "text.parallel"),
        (["runtime.backend=ray", "text.parallel.sp=2"], "text.parallel.sp"),
        (["runtime.backend=ray", "vision.parallel.sp=2", "vision.parallel.tp=2"], "vision.parallel"),
    ],
)
def test_settings_that_would_do_nothing_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_useful_layouts_still_load():
    cfg = load_config(None, ["runtime.backend=ray", "text.parallel.tp=2", "text.parallel.sequence_parallel=true",
                             "vision.parallel.sp=2", "vision.parallel.zero=3", "text.parallel.dp=2",
                             "text.parallel.zero=1"])
    assert cfg.text.parallel.sequence_parallel and cfg.vision.parallel.zero == 3


def test_module_sections_follow_the_family():
    cfg = load_config(None, [])
    assert list(cfg.modules) == ["vision", "text"]  # the family's modules, encoders first
    with pytest.raises(ConfigError, match="audio: the model family qwen2_5_vl has no audio module"):
        load_config(None, ["audio.parallel.dp=2"])
    with pytest.raises(ConfigError, match="model.family: unknown family 'nope'"):
        load_config(None, ["model.family=nope"])


def test_config_round_trips_through_its_dump(tmp_path):
    from dhp.config import dump_config

    cfg = load_config(None, ["runtime.backend=ray", "vision.parallel.sp=2", "text.lr_scale=0.5"])
    dump_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again.to_dict() == cfg.to_dict()
