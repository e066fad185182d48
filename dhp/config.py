"""The typed run configuration: YAML file + dotted ``key=value`` overrides, validated once at load.

Every key has a type and a default here; an unknown key or a value of the wrong
type is an error that names the key (``train.lr: expected a float, got 'abc'``).
Nothing else in dhp reads raw dictionaries.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key and how to fix it."""


@dataclass
class ModelConfig:
    preset: str = "tiny"  # tiny | 3b | 7b | 32b | 72b (ignored when hf_path is set)
    hf_path: str | None = None  # a Hugging Face checkpoint directory to start from


@dataclass
class DataConfig:
    path: str | None = None  # LLaVA JSON/JSONL; unset: the demo set, generated into the cache
    eval_path: str | None = None  # held-out split for the end-of-training evaluation
    image_root: str | None = None  # image paths are relative to this (default: the data file's folder)
    tokenizer: str | None = None  # a directory with tokenizer.json (default: hf_path, else the demo one)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_length: int = 2048
    on_error: Literal["raise", "skip"] = "raise"
    eval_samples: int = 200  # at most this many held-out samples are evaluated
    max_new_tokens: int = 8  # greedy decoding length in evaluation


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 4
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd (with momentum) mostly for exact-parity tests
    momentum: float = 0.9  # sgd only
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad_norm: float = 1.0  # <= 0 disables clipping
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # local backend; auto: cuda when available
    log_every: int = 1
    eval_at_end: bool = True


@dataclass
class ParallelConfig:
    dp: int = 1
    sp: int = 1
    tp: int = 1
    zero: Literal[0, 1, 3] = 0
    sequence_parallel: bool = False


@dataclass
class ModuleConfig:
    """One module group (vision encoder or language model): training switches and its parallel layout."""

    trainable: bool = True
    lr_scale: float = 1.0
    activation_checkpointing: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class MergerConfig:
    trainable: bool = True
    lr_scale: float = 1.0


@dataclass
class OutputConfig:
    dir: str = "outputs/run"
    save_final: bool = True  # write a Hugging Face checkpoint at the end


@dataclass
class RuntimeConfig:
    backend: Literal["local", "ray"] = "local"
    placement: Literal["collocated", "disaggregated"] = "collocated"
    ray_address: str | None = None  # unset: RAY_ADDRESS or a new local Ray; "auto" or host:port to join
    vision_ahead: int = 1  # micro-batches the vision group may run ahead (disaggregated)
    transport: Literal["auto", "direct", "object_store"] = "auto"
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0  # 0: CPU training (gloo)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    vision: ModuleConfig = field(default_factory=ModuleConfig)
    merger: MergerConfig = field(default_factory=MergerConfig)
    text: ModuleConfig = field(default_factory=ModuleConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def validate(self) -> None:
        t = self.train
        _check(t.steps > 0, "train.steps", "must be > 0")
        _check(t.micro_batch_size > 0, "train.micro_batch_size", "must be > 0")
        _check(t.global_batch_size > 0, "train.global_batch_size", "must be > 0")
        _check(t.lr > 0, "train.lr", "must be > 0")
        _check(0 <= t.warmup_steps, "train.warmup_steps", "must be >= 0")
        _check(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
        _check(self.data.max_length > 0, "data.max_length", "must be > 0")
        _check(0 < self.data.min_pixels <= self.data.max_pixels, "data.min_pixels",
               f"must be > 0 and <= data.max_pixels ({self.data.max_pixels})")
        for name in ("vision", "text"):
            p: ParallelConfig = getattr(self, name).parallel
            for k in ("dp", "sp", "tp"):
                _check(getattr(p, k) >= 1, f"{name}.parallel.{k}", "must be >= 1")
        _check(self.runtime.vision_ahead >= 0, "runtime.vision_ahead", "must be >= 0")
        if not (self.vision.trainable or self.merger.trainable or self.text.trainable):
            raise ConfigError("vision.trainable, merger.trainable and text.trainable are all false: nothing to train")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


# ---- loading ------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """A validated Config from a YAML file (or the defaults) and ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, train: ...)")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-4)")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else None)
    cfg = _build(Config, raw, prefix="")
    cfg.validate()
    return cfg


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a section (mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}; valid keys in {prefix.rstrip('.') or 'the top level'}: "
            f"{', '.join(sorted(names))}"
        )
    kwargs = {}
    for name in names & set(raw):
        kwargs[name] = _coerce(hints[name], raw[name], prefix + name)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x
