"""What a run is made of: config, model family and config, tokenizer, data files, starting weights.

Shared by the driver loop, both backends and the workers (a leaf of the
trainer: it imports no backend), so none of them imports another's file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dhp.config import Config, ConfigError
from dhp.data.llava import SFTDataset
from dhp.data.sampler import BatchPlanner, encoder_window
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError, DhpError, ModelError
from dhp.models.registry import resolve_family
from dhp.models.spec import FamilySpec


@dataclass
class RunInputs:
    cfg: Config
    family: FamilySpec
    model_cfg: Any  # the family's model config
    tokenizer_dir: Path
    train_path: Path
    eval_path: Path | None

    @property
    def positions(self) -> Any:
        """A sample's position ids in the family's rotary layout (picklable, for workers); None: Qwen2.5-VL's."""
        hook = self.family.position_ids
        return None if hook is None else functools.partial(hook, self.model_cfg)


def resolve_inputs(cfg: Config) -> RunInputs:
    """Fill in the demo data set and tokenizer where the config leaves them unset; read the model config."""
    data = cfg.data
    family = resolve_family(cfg.model.family, cfg.model.hf_path, cfg.model.preset)
    train_path, eval_path = _demo_file(data.path, family), _demo_file(data.eval_path, family)
    tokenizer_dir = Path(data.tokenizer) if data.tokenizer else None
    if tokenizer_dir is None and (str(data.path or "")).startswith(DEMO_PREFIX):
        tokenizer_dir = family.demo_data() / "tokenizer"
    if train_path is None:  # the family's demo set (Qwen2.5-VL: digits; Qwen2.5-Omni: digits and dial tones)
        if family.demo_data is None:
            raise ConfigError(f"data.path: set it to a training data file (the {family.name} family has no demo set)")
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


def _demo_file(value: str | None, family: FamilySpec) -> Path | None:
    """``data.path`` / ``data.eval_path`` as a path; ``demo:NAME`` is NAME in the family's cached demo set."""
    if not value:
        return None
    if not value.startswith(DEMO_PREFIX):
        return Path(value)
    if family.demo_data is None:
        raise ConfigError(f"{value}: the {family.name} family has no demo set; give a data file")
    path = family.demo_data() / value[len(DEMO_PREFIX):]
    if not path.is_file():
        raise DataError(f"{value}: the demo set ({path.parent}) has no {path.name}")
    return path


def dataset_spec(inputs: RunInputs, path: Path) -> dict:
    """What a worker needs to open the same data set and address samples by the same ids."""
    return {"data_cfg": replace(inputs.cfg.data, path=str(path)), "tokenizer_dir": str(inputs.tokenizer_dir),
            "path": str(path), "validated": None, "positions": inputs.positions}


def open_dataset(spec: dict) -> SFTDataset:
    """The data set, validated when opened: a bad sample raises DataError naming file and sample
    (``data.on_error=raise``) or is dropped and counted (``skip``). With ``spec["validated"]`` (the
    driver's result, handed to workers) the image headers are not read again, and every worker
    indexes exactly the samples the driver planned with."""
    return SFTDataset(spec["data_cfg"], Tokenizer(spec["tokenizer_dir"]), path=spec["path"],
                      validated=spec["validated"], positions=spec.get("positions"))


def check_modalities(family: FamilySpec, dataset: SFTDataset) -> None:
    """Every kind of media in the data has an encoder in the family (an audio clip given to Qwen2.5-VL would
    otherwise be read as plain tokens)."""
    read = {m for enc in family.encoders for m in enc.modalities}
    if "audio" in read:
        return
    with_audio = [dataset.source_index(i) for i in range(len(dataset)) if dataset.info(i).audio_frames]
    if with_audio:
        raise DataError(f"{dataset.file}: {len(with_audio)} sample(s) carry audio (the first: sample {with_audio[0]}) "
                        f"but the {family.name} family has no audio encoder; set model.family=qwen2_5_omni, or "
                        "drop the audio")


def module_costs(family: FamilySpec, model_cfg: Any, dataset: SFTDataset) -> dict[str, list[float]]:
    """Per module, each sample's cost (what the module's group balances); 0 where an encoder has nothing to do.

    The language model's cost falls back to the token count, an encoder's to its placeholder count."""
    infos = [dataset.info(i) for i in range(len(dataset))]
    out: dict[str, list[float]] = {}
    for enc in family.encoders:
        tokens = [enc.info_tokens(info, model_cfg) if enc.info_tokens else
                  info.token_counts.get(enc.token_id(model_cfg), 0) for info in infos]
        out[enc.name] = [(float(enc.cost(info, model_cfg)) if enc.cost else float(n)) if n else 0.0
                         for info, n in zip(infos, tokens, strict=True)]
    lang = family.language
    out[lang.name] = [float(lang.cost(info, model_cfg)) if lang.cost else float(info.num_tokens) for info in infos]
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
    spec: dict
    planner: BatchPlanner


def prepare(cfg: Config) -> Prepared:
    """Everything before the first step that needs no worker: inputs, validated data, the plan."""
    inputs = resolve_inputs(cfg)
    spec = dataset_spec(inputs, inputs.train_path)
    dataset = open_dataset(spec)
    check_modalities(inputs.family, dataset)
    spec["validated"] = dataset.validation  # workers reuse it instead of reading every header again
    return Prepared(inputs, dataset, spec, make_planner(inputs, dataset))
