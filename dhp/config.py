"""The typed run configuration: YAML file + dotted ``key=value`` overrides, validated once at load.

Every key has a type and a default here; an unknown key or a value of the wrong
type is an error that names the key (``train.lr: expected a float, got 'abc'``).
Nothing else in dhp reads raw dictionaries.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from dhp.errors import ConfigError, DataError, ModelError


@dataclass
class ModelConfig:
    family: str | None = None  # a registered family (qwen2_5_vl) or package.module:ATTR; unset: from hf_path
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
    video_fps: float = 2.0  # frames sampled per second of a video file (Qwen2.5-VL's rule, docs/video.md)
    video_min_frames: int = 4  # a clip with fewer frames is an error (named), or skipped
    video_max_frames: int = 768
    video_max_pixels: int = 768 * 28 * 28  # per frame (min: data.min_pixels)
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)  # per clip: each frame gets its share
    max_audio_seconds: float = 30.0  # a longer audio clip is an error (named), or skipped; at most 30 (Whisper's)
    max_length: int = 2048
    # the language model's packed micro-batch padded to a multiple of this many tokens (dhp.data.batch.pack): unset,
    # 64 where it runs under tensor parallelism (DTensor caches its sharding decisions by shape: lengths that repeat
    # hit that cache), else 1 (no padding)
    pad_to_multiple_of: int | None = None
    on_error: Literal["raise", "skip"] = "raise"
    loader_workers: int = 2  # threads per encoder worker decoding its next rounds ahead (Ray backend); 0: none
    # the data set's index (docs/data.md): validated once, over this many processes (0: one per CPU core), and kept
    # under $DHP_CACHE/index keyed by the file's fingerprint and the settings (index_cache=false: validate every start)
    index_workers: int = 0
    index_cache: bool = True
    # lazy: the index from file headers (a start costs what headers costs), every image read through (PIL's verify) in
    # the background before its step, a bad one raised or replaced by data.on_error (dhp.data.lazy, docs/data.md);
    # full: every image read through when the index is built (paid once per file + settings); headers: sizes only, a
    # damaged file is then found when a worker decodes it (the run stops naming it)
    validate: Literal["lazy", "full", "headers"] = "lazy"
    media_timeout_s: float = 60.0  # the longest one request for a medium in an object store may take (then an error)
    mix_seed: int = 0  # which samples a weighted mix (data.path="a.jsonl:0.3,b.parquet:0.7") repeats or drops
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
    # compute dtype; auto: bfloat16 on CUDA, float32 on CPU (and bfloat16 under a pure-bf16 precision);
    # the driver's start line says which (``compute_dtype``)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # what the weights and the optimizer state are held in (docs/memory.md gives the bytes of each):
    # fp32_master: float32 parameters, gradients and AdamW state, bfloat16 autocast compute when dtype is bfloat16;
    # bf16: pure bfloat16 parameters, gradients and AdamW state, updates stochastically rounded (dhp.optim);
    # bf16_plain: the same without the compensation (round to nearest: small updates are lost; for comparison)
    precision: Literal["fp32_master", "bf16", "bf16_plain"] = "fp32_master"
    compile: bool = False  # torch.compile each block (decoder layer, vision block) of every module
    # packed attention's kernel: varlen (FlashAttention's variable-length kernels over the packed sequence: CUDA,
    # bfloat16), sdpa (segments of equal length batched through SDPA: the CPU's, the reference), auto (varlen
    # where it runs, else sdpa)
    attention: Literal["auto", "sdpa", "varlen"] = "auto"
    # cross entropy through lm_head this many tokens at a time (the float32 logits [tokens, vocab] are never
    # whole; the head's forward is recomputed in the backward); 0: whole logits, as transformers does.
    # Not under text tensor parallelism, whose vocab-parallel loss holds only a vocabulary shard.
    loss_chunk_tokens: int = 1024
    device: Literal["auto", "cpu", "cuda"] = "auto"  # local backend; auto: cuda when available
    log_every: int = 1
    eval_at_end: bool = True
    checkpoint_every: int = 0  # steps between checkpoints in output.dir/checkpoints/ (0: none but the last)
    keep_checkpoints: int = 2  # complete checkpoints kept (older ones go once a newer one is complete); 0: all
    resume: str = "auto"  # auto: the newest complete checkpoint in output.dir; none; or a checkpoint path
    # a resumed run whose schedule keys (steps, lr, warmup, ...) differ from the checkpoint's: refuse (naming them)
    # or allow (go on with this run's values from the checkpoint's step; the log says what changed)
    resume_changes: Literal["refuse", "allow"] = "refuse"
    checkpoint_on_exit: bool = True  # Ctrl-C / SIGTERM: finish the step, write a checkpoint, exit


def compute_dtype(train: TrainConfig, device_type: str) -> str:
    """``train.dtype`` resolved where the device is known: ``auto`` is bfloat16 on CUDA (and under a pure-bf16
    ``train.precision``), float32 on the CPU."""
    if train.dtype != "auto":
        return train.dtype
    return "bfloat16" if device_type == "cuda" or train.precision != "fp32_master" else "float32"


@dataclass
class ParallelConfig:
    dp: int = 1
    sp: int = 1
    tp: int = 1
    zero: Literal[0, 1, 3] = 0
    sequence_parallel: bool = False


@dataclass
class ResourcesConfig:
    """Where a module group's workers run and what each one reserves (Ray's names; docs/cluster.md).

    Unset numbers take the run's defaults (``runtime.cpus_per_worker``, ``runtime.gpus_per_worker``)."""

    num_cpus: float | None = None  # CPUs per worker; unset: runtime.cpus_per_worker
    num_gpus: float | None = None  # GPUs per worker; unset: runtime.gpus_per_worker
    accelerator_type: str | None = None  # a node's accelerator (Ray's accelerator_type:<name> resource), e.g. H100
    label_selector: dict[str, str] = field(default_factory=dict)  # node labels: {pool: vision}, "!x", "in(a,b)"
    custom: dict[str, float] = field(default_factory=dict)  # custom node resources per worker: {vision_pool: 1}
    strategy: Literal["pack", "spread"] = "pack"  # the group's workers on as few nodes as fit, or on many


@dataclass
class LoRAConfig:
    """``<module>.lora``: train LoRA adapters on the module's Linears, its base frozen (``docs/lora.md``).

    ``r`` > 0 turns it on (0: the module trains whole, as ``trainable`` says). ``target_modules`` as PEFT takes
    it, on the checkpoint's module names: a list of names (``[q_proj, v_proj]``: each matches a module whose
    name ends with it), a regex the whole name must match, or ``all-linear`` (every Linear but ``lm_head``).
    Names separated by commas (``q_proj,v_proj``, LLaMA-Factory's ``lora_target``) are that list: a module name
    has no comma, so as one regex the string would match nothing."""

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str) and "," in self.target_modules:
            self.target_modules = [t.strip() for t in self.target_modules.split(",") if t.strip()]

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass
class ModuleConfig:
    """One module group (an encoder or the language model): training switches and its parallel layout.

    The config has one such section per module of the model family, named by the module's role
    (``vision``, ``audio``, ``text``)."""

    trainable: bool = True
    lr_scale: float = 1.0
    activation_checkpointing: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)  # its workers' node pool (Ray backend)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters only, the base frozen (r > 0)


@dataclass
class MergerConfig:
    """The encoders' projectors (parameters the family marks as such: Qwen2.5-VL's merger)."""

    trainable: bool = True
    lr_scale: float = 1.0


@dataclass
class OutputConfig:
    dir: str = "outputs/run"
    save_final: bool = True  # write a Hugging Face checkpoint at the end
    overwrite: bool = False  # allow a new run in a directory that holds another run
    tensorboard: bool = False  # metrics as TensorBoard scalars in output.dir/tensorboard (needs dhp[tensorboard])
    trace_steps: int | list[int] = 0  # output.dir/trace.json (Chrome trace): N: the N steps after the first; or a list


@dataclass
class RuntimeConfig:
    backend: Literal["local", "ray"] = "local"
    placement: Literal["collocated", "disaggregated"] = "collocated"
    ray_address: str | None = None  # unset: RAY_ADDRESS or a new local Ray; "auto" or host:port to join
    encoders_ahead: int = 1  # micro-batches the encoder groups may run ahead of the text group (disaggregated)
    # rounds whose samples each encoder spreads over its replicas and encodes at once (their activations held
    # until their text rounds): 0 (auto) is enough for every replica to get a sample under collocated placement,
    # 1 under disaggregated; lower it where the encoder's activations of that many rounds do not fit
    encoder_window: int = 0
    transport: Literal["auto", "direct", "object_store"] = "auto"
    cpus_per_worker: float = 1.0
    # auto: one GPU per worker when the Ray cluster has GPUs for every worker (a layout that does not fit is
    # refused), none where it has no GPU (CPU, gloo); a number: that share of a GPU per worker (0: CPU)
    gpus_per_worker: float | Literal["auto"] = "auto"
    max_failures: int = 0  # worker failures a run survives (restart every group, resume the newest checkpoint)
    # a restart on a cluster that lost nodes: seconds to wait for the layout to fit again before the run stops
    # with the command that resumes it (docs/cluster.md)
    capacity_wait_s: float = 120.0
    collective_timeout_s: float = 600.0  # a collective waiting longer than this fails instead of hanging
    peak_tflops: float | None = None  # peak FLOP/s per device for MFU (unset: the device table; CPU: measured)
    empty_cache_between_turns: Literal["auto", "always", "never"] = "auto"  # auto: collocated groups on CUDA
    # count the bytes every collective moves (comm_<module>_<kind>_bytes in metrics.jsonl): a dispatch mode that
    # puts every op of the step through Python, so only where asked (dhp bench turns it on); Ray backend
    count_collectives: bool = False
    # Python's garbage collector in the Ray workers (dhp.runtime.gc_policy): freeze start-up's objects (so no
    # collection walks them again); every N steps a collection on every rank at the step's end, automatic
    # collection off (0: Python's automatic collection)
    gc_freeze: bool = True
    gc_every_steps: int = 0


FIXED_SECTIONS = ("model", "data", "train", "merger", "output", "runtime")


def _default_modules() -> dict[str, ModuleConfig]:
    return {"vision": ModuleConfig(), "text": ModuleConfig()}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    merger: MergerConfig = field(default_factory=MergerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    modules: dict[str, ModuleConfig] = field(default_factory=_default_modules)  # one section per module role

    def __getattr__(self, name: str) -> ModuleConfig:
        """``cfg.vision``, ``cfg.text``, ``cfg.audio``: the module sections, by role."""
        modules = self.__dict__.get("modules", {})
        if name in modules:
            return modules[name]
        raise AttributeError(f"config has no section {name!r} (module sections: {', '.join(modules)})")

    def module(self, name: str) -> ModuleConfig:
        """The section of module ``name`` (defaults when the family has the module but the config omits it)."""
        return self.modules.get(name) or ModuleConfig()

    def validate(self, family: Any = None) -> None:
        t = self.train
        _check(t.steps > 0, "train.steps", "must be > 0")
        _check(t.micro_batch_size > 0, "train.micro_batch_size", "must be > 0")
        _check(t.global_batch_size > 0, "train.global_batch_size", "must be > 0")
        _check(t.lr > 0, "train.lr", "must be > 0")
        _check(t.log_every > 0, "train.log_every", "must be > 0 (print every N steps)")
        _check(0 <= t.warmup_steps, "train.warmup_steps", "must be >= 0")
        _check(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
        _check(self.data.max_length > 0, "data.max_length", "must be > 0")
        _check(self.data.pad_to_multiple_of is None or self.data.pad_to_multiple_of > 0, "data.pad_to_multiple_of",
               "must be > 0 (1: no padding), or unset (64 under tensor parallelism, else 1)")
        _check(self.data.eval_samples >= 0, "data.eval_samples", "must be >= 0 (0: no evaluation)")
        _check(0 < self.data.min_pixels <= self.data.max_pixels, "data.min_pixels",
               f"must be > 0 and <= data.max_pixels ({self.data.max_pixels})")
        _check(0 < self.data.max_audio_seconds <= 30, "data.max_audio_seconds",
               "must be in (0, 30]: the audio encoder reads at most one 30-second Whisper window per clip")
        _check(self.runtime.encoders_ahead >= 0, "runtime.encoders_ahead", "must be >= 0")
        _check(self.runtime.encoder_window >= 0, "runtime.encoder_window", "must be >= 0 (0: auto)")
        _check(self.data.loader_workers >= 0, "data.loader_workers", "must be >= 0 (0: load in the worker's thread)")
        _check(self.data.index_workers >= 0, "data.index_workers", "must be >= 0 (0: one process per CPU core)")
        _check(self.data.media_timeout_s > 0, "data.media_timeout_s", "must be > 0 (seconds)")
        _check(t.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0 (0: no periodic checkpoints)")
        _check(t.keep_checkpoints >= 0, "train.keep_checkpoints", "must be >= 0 (0: keep all)")
        _check(t.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", "must be >= 0 (0: the whole logits at once)")
        _check(t.precision == "fp32_master" or t.dtype != "float32", "train.precision",
               f"{t.precision} holds bfloat16 weights and computes in bfloat16: it needs train.dtype=bfloat16 (or "
               "auto), not float32")
        _check(self.runtime.max_failures >= 0, "runtime.max_failures", "must be >= 0")
        _check(self.runtime.capacity_wait_s >= 0, "runtime.capacity_wait_s", "must be >= 0 seconds")
        _check(self.runtime.collective_timeout_s > 0, "runtime.collective_timeout_s", "must be > 0 seconds")
        _check(self.runtime.gc_every_steps >= 0, "runtime.gc_every_steps",
               "must be >= 0 (0: Python's automatic collection)")
        trace = self.output.trace_steps
        _check((trace >= 0) if isinstance(trace, int) else all(s >= 1 for s in trace), "output.trace_steps",
               "must be >= 0 (the N steps after the first) or a list of step numbers >= 1")
        _check(self.runtime.peak_tflops is None or self.runtime.peak_tflops > 0, "runtime.peak_tflops", "must be > 0")
        presets = tuple(getattr(family, "presets", ()) or ())
        if presets and not self.model.hf_path and self.model.preset not in presets:
            raise ConfigError(f"model.preset: unknown preset {self.model.preset!r} of the {family.name} family; "
                              f"choose one of {', '.join(presets)}, or set model.hf_path to a checkpoint directory")
        for name, m in self.modules.items():
            _check_module(name, m, family.module(name) if family is not None else None, self.runtime.backend)
        if not (any(m.trainable for m in self.modules.values()) or self.merger.trainable):
            raise ConfigError(f"{', '.join(f'{n}.trainable' for n in self.modules)} and merger.trainable are all "
                              "false: nothing to train")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name != "modules"}
        out.update({name: dataclasses.asdict(m) for name, m in self.modules.items()})
        return out


def _check_module(name: str, m: ModuleConfig, spec: Any, backend: str) -> None:
    """A module's layout: sizes, what its family supports, and no setting that would silently do nothing."""
    p = m.parallel
    for k in ("dp", "sp", "tp"):
        _check(getattr(p, k) >= 1, f"{name}.parallel.{k}", "must be >= 1")
    _check(m.lr_scale > 0, f"{name}.lr_scale", "must be > 0")
    _check_lora(name, m)
    _check_resources(name, m.resources)
    if backend == "local" and m.resources != ResourcesConfig():
        raise ConfigError(f"{name}.resources: places the group's workers on a Ray cluster; the local backend runs "
                          "one process: set runtime.backend=ray, or drop it")
    if p.sp > 1 and p.tp > 1:
        raise ConfigError(f"{name}.parallel: choose sp (Ulysses) or tp, not both")
    if spec is not None:
        for kind in ("sp", "tp"):
            if getattr(p, kind) > 1 and kind not in spec.inner:
                supported = " or ".join(("dp", *spec.inner))
                raise ConfigError(f"{name}.parallel.{kind}: the {name} module supports {supported} only"
                                  + (" (the language model uses tp and parallel.sequence_parallel)"
                                     if kind == "sp" and "tp" in spec.inner else ""))
    if p.sequence_parallel:
        if spec is not None and not spec.sequence_parallel:
            raise ConfigError(f"{name}.parallel.sequence_parallel: the {name} module has no Megatron sequence "
                              f"parallelism" + (f"; use {name}.parallel.sp (Ulysses)" if spec and "sp" in spec.inner
                                                 else ""))
        if p.tp == 1:
            raise ConfigError(f"{name}.parallel.sequence_parallel: it splits activations across the tp ranks and "
                              f"does nothing with {name}.parallel.tp=1; set tp > 1 or drop it")
    if p.zero and p.dp * p.sp == 1:
        raise ConfigError(f"{name}.parallel.zero={p.zero}: ZeRO shards over the data-parallel (and sp) ranks and "
                          f"does nothing with {name}.parallel.dp=1; set dp > 1 or zero=0")
    if backend == "local" and (p.dp, p.sp, p.tp) != (1, 1, 1):
        raise ConfigError(f"{name}.parallel: the local backend runs one process; set runtime.backend=ray for "
                          "dp/sp/tp/zero")


def _check_lora(name: str, m: ModuleConfig) -> None:
    lora = m.lora
    _check(lora.r >= 0, f"{name}.lora.r", "must be >= 0 (0: no LoRA, the module trains whole)")
    _check(lora.alpha > 0, f"{name}.lora.alpha", "must be > 0")
    _check(0.0 <= lora.dropout < 1.0, f"{name}.lora.dropout", "must be in [0, 1)")
    _check(bool(lora.target_modules), f"{name}.lora.target_modules",
           "must name modules (a list, a regex, or all-linear)")
    if lora.enabled and not m.trainable:
        raise ConfigError(f"{name}.lora.r={lora.r}: adapters on a frozen module ({name}.trainable=false) would not "
                          f"train; set {name}.trainable=true or {name}.lora.r=0")
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        try:
            re.compile(lora.target_modules)
        except re.error as e:
            raise ConfigError(f"{name}.lora.target_modules: not a regex ({e}); give a list of names, a regex or "
                              "all-linear") from None


def _check_resources(name: str, r: ResourcesConfig) -> None:
    for key in ("num_cpus", "num_gpus"):
        value = getattr(r, key)
        _check(value is None or value >= 0, f"{name}.resources.{key}", "must be >= 0 (unset: the runtime's default)")
    if r.num_gpus is not None and r.num_gpus > 1:
        _check(r.num_gpus == int(r.num_gpus), f"{name}.resources.num_gpus", "above 1 must be a whole number")
    for res, amount in r.custom.items():
        _check(amount > 0, f"{name}.resources.custom.{res}", "must be > 0 (a worker's share of that node resource)")
        _check(res not in ("CPU", "GPU", "memory"), f"{name}.resources.custom.{res}",
               "is a built-in resource: use num_cpus / num_gpus")


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


# ---- loading ------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                check_files: bool = True) -> Config:
    """A validated Config from a YAML file (or the defaults) and ``key=value`` overrides.

    With ``check_files`` the files and directories the config names are checked too (``check_files_exist``):
    a wrong path fails here, before anything starts."""
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
    cfg = build_config(raw)
    if check_files:
        from dhp.storage import localize_inputs

        check_files_exist(localize_inputs(cfg))  # URL inputs (s3://...) read from a local copy
    return cfg


HF_DIR_HINT = "a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"


def check_files_exist(cfg: Config) -> None:
    """The files and directories the config names exist and hold what dhp reads from them.

    Raises DataError (data.*), ModelError (model.hf_path, data.tokenizer) or ConfigError naming the key and
    the fix. Relative paths are relative to the current directory."""
    d, m = cfg.data, cfg.model
    for key in ("path", "eval_path"):
        value = getattr(d, key)
        if value is None or str(value).startswith("demo:"):  # demo:NAME: the family's demo set, made on first use
            continue
        from dhp.data_path import check_sources, is_mix

        if is_mix(value):  # several sources, a glob, weights (dhp/data_path.py)
            check_sources(str(value))
            continue
        p = Path(value)
        if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            continue  # a data set saved by HF datasets (save_to_disk)
        if p.is_dir():
            raise DataError(f"data.{key}: {p} is a directory; give the JSON, JSONL, parquet or Arrow file of the "
                            "samples, or a directory saved by HF datasets (save_to_disk)")
        if not p.is_file():
            raise DataError(f"data.{key}: {_missing(p)}; give a JSON, JSONL, parquet or Arrow file of samples, or an "
                            "HF datasets directory (README: data forms)")
    remote_root = "://" in str(d.image_root)  # a URL prefix: checked by dhp.storage.localize_inputs
    if d.image_root is not None and not remote_root and not Path(d.image_root).is_dir():
        raise DataError(f"data.image_root: {_not_dir(Path(d.image_root))}; set it to the folder the samples' image "
                        "paths are relative to (unset: the data file's folder)")
    if m.hf_path is not None:
        p = Path(m.hf_path)
        if not p.is_dir():
            raise ModelError(f"model.hf_path: {_not_dir(p)}; give {HF_DIR_HINT}" + _hub_hint(m.hf_path))
        if not (p / "config.json").is_file():
            raise ModelError(f"model.hf_path: {p} has no config.json, so it is no Hugging Face checkpoint; give the "
                             "directory that holds config.json, *.safetensors and tokenizer.json, or unset "
                             "model.hf_path to start from model.preset")
        if not (p / "model.safetensors").is_file() and not (p / "model.safetensors.index.json").is_file() \
                and not any(p.glob("*.safetensors")):
            raise ModelError(f"model.hf_path: {p} has no *.safetensors weights; give {HF_DIR_HINT} (a .bin-only "
                             "checkpoint must be converted to safetensors first)")
    if d.tokenizer is not None:
        p = Path(d.tokenizer)
        if not (p / "tokenizer.json").is_file():
            what = _missing(p) if not p.exists() else f"{p} has no tokenizer.json"
            raise ModelError(f"data.tokenizer: {what}; give a directory with the model's tokenizer.json (the "
                             "Hugging Face checkpoint directory you start from holds one)")
    elif m.hf_path is not None:  # the checkpoint's own tokenizer is used
        if not (Path(m.hf_path) / "tokenizer.json").is_file():
            raise ModelError(f"model.hf_path: {m.hf_path} has no tokenizer.json (it is read from there when "
                             "data.tokenizer is unset); set data.tokenizer to a directory with the model's "
                             "tokenizer.json")
    elif d.path is not None and not d.path.startswith("demo:"):
        raise ConfigError("data.tokenizer: your data set (data.path) needs the model's tokenizer; set data.tokenizer "
                          "to a directory with tokenizer.json, or model.hf_path to a checkpoint that has one (for "
                          "the demo data set: `dhp data demo DIR` writes its tokenizer to DIR/tokenizer)")


def _hub_hint(value: str) -> str:
    """For ``owner/name`` that is no local directory: Hub ids are not downloaded by dhp; how to fetch one."""
    parts = value.split("/")
    if len(parts) != 2 or not all(parts) or value.startswith((".", "~")) or Path(parts[0]).exists():
        return ""
    return (f". {value!r} looks like a Hugging Face Hub id: dhp reads local directories only; download it first "
            f"(`huggingface-cli download {value} --local-dir {parts[1]}`) and set model.hf_path={parts[1]}")


def _not_dir(p: Path) -> str:
    return f"{p} is a file, not a directory" if p.exists() else _missing(p)


def _missing(p: Path) -> str:
    return f"{p} does not exist" + ("" if p.is_absolute() else f" (relative to the current directory {Path.cwd()})")


def build_config(raw: dict[str, Any]) -> Config:
    """A validated Config from a raw mapping: fixed sections, then one section per module of the model family."""
    from dhp.models.registry import UnknownFamily, resolve_family

    fixed = {k: v for k, v in raw.items() if k in FIXED_SECTIONS}
    cfg = _build(Config, fixed, prefix="")
    try:
        family = resolve_family(cfg.model.family, cfg.model.hf_path, cfg.model.preset)
    except UnknownFamily as e:
        raise ConfigError(str(e)) from None
    modules = family.module_names
    for key in raw:
        if key not in FIXED_SECTIONS and key not in modules:
            value = raw[key]
            module_like = isinstance(value, dict) and set(value) <= {f.name for f in dataclasses.fields(ModuleConfig)}
            if key == "modules" or not module_like:
                raise ConfigError(f"unknown key {key}{_did_you_mean(key, (*FIXED_SECTIONS, *modules))}; valid keys in "
                                  f"the top level: {', '.join(sorted((*FIXED_SECTIONS, *modules)))}")
            raise ConfigError(f"{key}: the model family {family.name} has no {key} module{_did_you_mean(key, modules)} "
                              f"(its modules: {', '.join(modules)}); remove the section or choose another "
                              "model.family")
    cfg.modules = {name: _build(ModuleConfig, raw.get(name), prefix=f"{name}.") for name in modules}
    cfg.validate(family)
    return cfg


def _did_you_mean(key: str, valid: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean train.steps?)`` for a misspelt key, where one valid key is close; else nothing."""
    close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.75)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


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
            f"unknown key {prefix}{unknown[0]}{_did_you_mean(unknown[0], names, prefix)}; valid keys in "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(names))}"
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
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(args[0], k, key): _coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
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


def config_from_dict(data: dict[str, Any]) -> Config:
    """The inverse of ``Config.to_dict`` (a dumped config.yaml read back)."""
    return build_config(data)


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x
