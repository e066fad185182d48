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


@pytest.mark.parametrize("override, suggestion", [
    ("train.stpes=3", "unknown key train.stpes (did you mean train.steps?)"),
    ("runtime.gc_frezze=false", "unknown key runtime.gc_frezze (did you mean runtime.gc_freeze?)"),
    ("text.paralel.tp=2", "unknown key text.paralel (did you mean text.parallel?)"),
    ("trian.steps=3", "unknown key trian (did you mean train?)"),
    ("vison.parallel.dp=2", "has no vison module (did you mean vision?)"),
])
def test_a_misspelt_key_gets_the_close_one(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert suggestion in str(err.value)


def test_a_key_like_none_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.zzz=1"])
    assert "did you mean" not in str(err.value) and "valid keys in train: " in str(err.value)


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


def test_preset_is_checked_at_load_time():
    with pytest.raises(ConfigError, match="model.preset: unknown preset 'huge'.*tiny, 3b"):
        load_config(None, ["model.preset=huge"])
    assert load_config(None, ["model.preset=7b"]).model.preset == "7b"


def test_named_files_are_checked_at_load_time(tmp_path):
    from dhp.errors import DataError, ModelError

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cases = [
        (["data.path=" + str(tmp_path / "none.jsonl")], DataError, "data.path: .*none.jsonl does not exist"),
        ([f"data.path={tmp_path}"], DataError, "data.path: .* is a directory"),
        ([f"data.path={data}", f"data.tokenizer={tok}", f"data.eval_path={tmp_path / 'e.jsonl'}"], DataError,
         "data.eval_path: .*e.jsonl does not exist"),
        ([f"data.path={data}", f"data.tokenizer={tok}", f"data.image_root={tmp_path / 'imgs'}"], DataError,
         "data.image_root: .*imgs does not exist"),
        ([f"data.path={data}"], ConfigError, "data.tokenizer: your data set"),
        ([f"data.path={data}", f"data.tokenizer={tmp_path}"], ModelError, "data.tokenizer: .* has no tokenizer.json"),
        ([f"model.hf_path={tmp_path / 'nope'}"], ModelError, "model.hf_path: .*nope does not exist"),
        ([f"model.hf_path={ckpt}"], ModelError, "model.hf_path: .*ckpt has no config.json"),
    ]
    for overrides, cls, message in cases:
        with pytest.raises(cls, match=message):
            load_config(None, overrides)
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_config(None, [f"model.hf_path={ckpt}", "model.family=qwen2_5_vl"])
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="has no tokenizer.json"):
        load_config(None, [f"model.hf_path={ckpt}", "model.family=qwen2_5_vl"])
    cfg = load_config(None, [f"model.hf_path={ckpt}", "model.family=qwen2_5_vl", f"data.tokenizer={tok}",
                             f"data.path={data}"])
    assert cfg.model.hf_path == str(ckpt)
    assert load_config(None, ["data.path=/nowhere.jsonl"], check_files=False).data.path == "/nowhere.jsonl"


def test_one_base_config():
    """No argument: the embedded demo. Otherwise the code defaults, then the file (or `demo`), then overrides."""
    import dataclasses

    from dhp.cli import _config, build_parser
    from dhp.config import Config

    def cfg(*argv):
        return _config(build_parser().parse_args(["train", *argv]))

    demo = load_config(default_config_path())
    assert cfg().to_dict() == demo.to_dict()
    defaults = Config()
    assert cfg("train.steps=5").runtime.backend == defaults.runtime.backend
    assert dataclasses.replace(cfg("train.steps=5").train, steps=defaults.train.steps) == defaults.train
    assert cfg("demo", "train.steps=5").to_dict() == load_config(default_config_path(), ["train.steps=5"]).to_dict()


@pytest.mark.parametrize("placement,mode,device,expected", [
    ("collocated", "auto", "cuda", True),  # two processes' caching allocators on one GPU
    ("collocated", "auto", "cuda:0", True),
    ("disaggregated", "auto", "cuda", False),  # a GPU per group: nothing to hand back
    ("disaggregated", "always", "cuda", True),
    ("collocated", "never", "cuda", False),
    ("collocated", "always", "cpu", False),  # no CUDA cache on a CPU run
])
def test_collocated_workers_empty_their_cuda_cache_between_turns(placement, mode, device, expected):
    from dhp.backends.ray_workers import empties_cache_between_turns

    cfg = load_config(default_config_path(), [f"runtime.placement={placement}",
                                               f"runtime.empty_cache_between_turns={mode}"])
    assert empties_cache_between_turns(cfg, device) is expected


def test_empty_cache_mode_is_checked_at_load_time():
    with pytest.raises(ConfigError, match="runtime.empty_cache_between_turns"):
        load_config(default_config_path(), ["runtime.empty_cache_between_turns=sometimes"])
