"""What a run is made of: config, model family and config, tokenizer, data files, starting weights.

Shared by the driver loop, both backends and the workers (a leaf of the
trainer: it imports no backend), so none of them imports another's file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dhp.config import Config, ConfigError, DataConfig
from dhp.data.llava import SFTDataset, UnreadMedia, ValidationResult
from dhp.data.processor import Processor
from dhp.data.sampler import BatchPlanner, encoder_window
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError, DhpError, ModelError
from dhp.models.registry import resolve_family
from dhp.models.spec import Family


@dataclass
class RunInputs:
    cfg: Config
    family: Family
    model_cfg: Any  # the family's model config
    tokenizer_dir: Path
    train_path: Path
    eval_path: Path | None

    def processor(self, data_cfg: Any = None) -> Processor:
        """The family's processor of the run's data (picklable: it goes to the workers inside the dataset spec)."""
        return self.family.processor(data_cfg or self.cfg.data, Tokenizer(self.tokenizer_dir), self.model_cfg)


def resolve_inputs(cfg: Config) -> RunInputs:
    """Fill in the demo data set and tokenizer where the config leaves them unset; read the model config."""
    data = cfg.data
    family = resolve_family(cfg.model.family, cfg.model.hf_path, cfg.model.preset)
    train_path, eval_path = _demo_file(data.path, family), _demo_file(data.eval_path, family)
    tokenizer_dir = Path(data.tokenizer) if data.tokenizer else None
    if tokenizer_dir is None and (str(data.path or "")).startswith(DEMO_PREFIX):
        tokenizer_dir = family.demo_data() / "tokenizer"
    if train_path is None:  # the family's demo set (Qwen2.5-VL: digits; Qwen2.5-Omni: digits and dial tones)
        demo = family.demo_data()
        train_path, eval_path = demo / "train.jsonl", eval_path or demo / "eval.jsonl"
        tokenizer_dir = tokenizer_dir or demo / "tokenizer"
    if tokenizer_dir is None:
        if not cfg.model.hf_path:
            raise ConfigError("data.tokenizer: set it to a directory with tokenizer.json (or set model.hf_path)")
        tokenizer_dir = Path(cfg.model.hf_path)
    try:
        model_cfg = family.model_config(cfg, Tokenizer(tokenizer_dir))
    except DhpError:
        raise
    except (ValueError, FileNotFoundError, KeyError) as e:  # the model config or tokenizer does not fit
        raise ModelError(str(e).strip("'\"")) from None
    # no weight is read here: each worker reads its own shards of model.hf_path (dhp.engine.materialize)
    return RunInputs(cfg, family, model_cfg, tokenizer_dir, train_path, eval_path)


DEMO_PREFIX = "demo:"  # data.path=demo:video_train.jsonl: a file of the family's demo set, generated on first use


def _demo_file(value: str | None, family: Family) -> Path | None:
    """``data.path`` / ``data.eval_path`` as a path; ``demo:NAME`` is NAME in the family's cached demo set."""
    if not value:
        return None
    if not value.startswith(DEMO_PREFIX):
        return Path(value)
    path = family.demo_data() / value[len(DEMO_PREFIX):]  # (no demo set: the family raises ConfigError)
    if not path.is_file():
        raise DataError(f"{value}: the demo set ({path.parent}) has no {path.name}")
    return path


@dataclass(frozen=True)
class DatasetSpec:
    """What a worker needs to open the same data set and address samples by the same ids: the data config, the
    tokenizer, the family's processor, and (once the driver validated the file) its validation result."""

    data_cfg: DataConfig
    tokenizer_dir: str
    path: str
    processor: Processor
    family_name: str
    validated: ValidationResult | None = None


@dataclass(frozen=True)
class EngineInit:
    """What every worker builds its engine from, sent once after its process groups are up. Weights are not in
    it: each rank materializes, or reads from ``model.hf_path``, its own shards."""

    family: Family
    model_cfg: Any
    cfg: Config
    device: str  # "cuda" or "cpu"
    data_plane: str  # the transport between groups the runtime chose ("p2p", "ray", "ipc")
    dataset: DatasetSpec


def dataset_spec(inputs: RunInputs, path: Path) -> DatasetSpec:
    """The ``DatasetSpec`` of ``path`` under the run's data config, not yet validated."""
    data_cfg = replace(inputs.cfg.data, path=str(path))
    return DatasetSpec(data_cfg, str(inputs.tokenizer_dir), str(path), inputs.processor(data_cfg), inputs.family.name)


def open_dataset(spec: DatasetSpec) -> SFTDataset:
    """The data set, validated when opened: a bad sample raises DataError naming file and sample
    (``data.on_error=raise``) or is dropped and counted (``skip``). With ``spec.validated`` (the
    driver's result, handed to workers) the media headers are not read again, and every worker
    indexes exactly the samples the driver planned with. Media the family reads not (audio under a vision
    model): a DataError naming the families that do."""
    try:
        return SFTDataset(spec.data_cfg, Tokenizer(spec.tokenizer_dir), path=spec.path, validated=spec.validated,
                          processor=spec.processor)
    except UnreadMedia as e:
        raise DataError(_unread_message(spec.family_name, e)) from None


def _unread_message(family: str, e: UnreadMedia) -> str:
    """Which registered families read the media kind the data carries."""
    from dhp.models.registry import family_names, get_family

    readers = [n for n in family_names() if n != family
               and any(e.kind in enc.modalities for enc in get_family(n).encoders)]
    fix = f"set model.family={' or '.join(readers)}, or drop the {e.kind}" if readers else f"drop the {e.kind}"
    first = e.samples[0]
    return (f"{e.file}: {len(e.samples)} sample(s) carry {e.kind} (the first: sample {first}) but the {family} "
            f"family has no {e.kind} encoder; {fix}")


def module_costs(family: Family, model_cfg: Any, dataset: SFTDataset) -> dict[str, list[float]]:
    """Per module, each sample's cost (what the module's group balances: its forward FLOPs, ``Module.cost``); 0
    where an encoder has nothing to do."""
    infos = [dataset.info(i) for i in range(len(dataset))]
    out: dict[str, list[float]] = {}
    for enc in family.encoders:
        out[enc.name] = [float(enc.cost(info, model_cfg)) if enc.num_placeholders(info, model_cfg) else 0.0
                         for info in infos]
    lang = family.language
    out[lang.name] = [float(lang.cost(info, model_cfg)) for info in infos]
    return out


def make_planner(inputs: RunInputs, dataset: SFTDataset) -> BatchPlanner:
    """The run's batch plan: each module's costs, its dp, the batch sizes and the seed of the config."""
    cfg = inputs.cfg
    costs = module_costs(inputs.family, inputs.model_cfg, dataset)
    dp = {m: cfg.module(m).parallel.dp for m in costs}
    lang = inputs.family.language.name
    per_round = cfg.train.micro_batch_size * dp[lang]
    window = encoder_window(cfg.runtime.encoder_window, cfg.runtime.placement,
                            [dp[m] for m in costs if m != lang], per_round,
                            max(1, cfg.train.global_batch_size // per_round))
    return BatchPlanner(costs, dp, cfg.train.global_batch_size, cfg.train.micro_batch_size, seed=cfg.train.seed,
                        language=lang, encoder_window=window)


@dataclass
class Prepared:
    """A run's inputs, its validated data set (with the spec workers open it by) and its batch plan."""

    inputs: RunInputs
    dataset: SFTDataset
    spec: DatasetSpec
    planner: BatchPlanner


def prepare(cfg: Config) -> Prepared:
    """Everything before the first step that needs no worker: inputs, validated data, the plan."""
    inputs = resolve_inputs(cfg)
    spec = dataset_spec(inputs, inputs.train_path)
    dataset = open_dataset(spec)
    spec = replace(spec, validated=dataset.validation)  # workers reuse it instead of reading every header again
    return Prepared(inputs, dataset, spec, make_planner(inputs, dataset))
