"""What a run is made of: config, model family and config, tokenizer, data files, starting weights.

Shared by the driver loop, both backends and the workers (a leaf of the
trainer: it imports no backend), so none of them imports another's file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dhp.config import Config, ConfigError, DataConfig
from dhp.data.llava import SFTDataset, UnreadMedia, ValidationResult
from dhp.data.mix import MixedDataset, expand, is_mix, parse_sources
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
        return Path(value)  # (several sources, "a.jsonl:0.3,b/*.parquet:0.7", survive as one Path: dhp.data.mix)
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
    index_dir: str | None = None  # the driver's stored index of the file (memory-mapped by each worker)
    index_digest: str | None = None  # its digest: what a node that does not see index_dir checks its own against


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
    driver's result, handed to workers) or ``spec.index_dir`` (its stored index) the media headers are not read
    again, and every worker indexes exactly the samples the driver planned with. Media the family reads not
    (audio under a vision model): a DataError naming the families that do."""
    try:
        if is_mix(spec.path):
            return _open_mix(spec)
        return SFTDataset(spec.data_cfg, Tokenizer(spec.tokenizer_dir), path=spec.path, validated=spec.validated,
                          processor=spec.processor, index_dir=spec.index_dir, index_digest=spec.index_digest)
    except UnreadMedia as e:
        raise DataError(_unread_message(spec.family_name, e)) from None


def _open_mix(spec: DatasetSpec) -> MixedDataset:
    """Several sources (files, globs, weights: ``dhp.data.mix``) as one data set, each file with its own index."""
    sources = parse_sources(spec.path)
    tok = Tokenizer(spec.tokenizer_dir)
    files = [[SFTDataset(replace(spec.data_cfg, path=str(f)), tok, path=f, processor=spec.processor)
              for f in expand(pattern)] for pattern, _ in sources]
    return MixedDataset(files, [w for _, w in sources], spec.data_cfg.mix_seed, spec.path)


def indexed_fingerprint(dataset: SFTDataset | MixedDataset, skipped: list[int]) -> str:
    """What a resume checks of a data set that is no single file (an HF datasets directory, a mix): its files'
    index fingerprints (size, mtime, head and tail: ``dhp.data.sources.fingerprint``), the usable and the skipped
    samples."""
    import hashlib
    import json

    parts = dataset.parts if isinstance(dataset, MixedDataset) else [dataset]
    blob = json.dumps([[ds.index.fingerprint for ds in parts], len(dataset), skipped]).encode()
    return hashlib.sha256(blob).hexdigest()


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
    where an encoder has nothing to do. Kept beside the data set's index (``costs-KEY.npz``, keyed by the family,
    its code and the model config), so a second start does not compute them again."""
    return {m: v.tolist() for m, v in _kept("costs", family, model_cfg, dataset, _compute_costs).items()}


def sample_flops(family: Family, model_cfg: Any, dataset: SFTDataset,
                 trains: dict[str, bool]) -> dict[str, list[float]]:
    """``dhp.observe.flops.sample_flops`` of every sample of ``dataset`` (per module, its model FLOPs: forward,
    plus backward where ``trains[module]``), from each sample's (forward, backward) FLOPs kept beside the index as
    the costs are (``flops-KEY.npz``): a second start reads them back instead of visiting every sample."""
    flops = _kept("flops", family, model_cfg, dataset, _compute_flops)
    return {m.name: (flops[f"{m.name}.forward"] + (flops[f"{m.name}.backward"] if trains.get(m.name, True) else 0.0))
            .tolist() for m in family.modules}


def _kept(what: str, family: Family, model_cfg: Any, dataset: Any,
          compute: Callable[[Family, Any, Any], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-sample figures (``compute``'s: arrays by name) of ``dataset``, read from ``WHAT-KEY.npz`` beside its
    index when there, else computed and stored there (a read-only cache: computed at every start)."""
    stored = _costs_file(family, model_cfg, dataset, what)
    if stored is not None and stored.is_file():
        try:
            with np.load(stored) as z:
                if all(len(z[m]) == len(dataset) for m in z.files):
                    return {m: z[m] for m in z.files}
        except (OSError, ValueError, KeyError):
            pass  # a damaged file: computed again
    out = compute(family, model_cfg, dataset)
    if stored is not None:
        try:
            tmp = stored.with_name(f".{stored.name}.{os.getpid()}.tmp.npz")
            np.savez(tmp, **out)
            os.replace(tmp, stored)
        except OSError:
            pass
    return out


def _costs_file(family: Family, model_cfg: Any, dataset: Any, what: str = "costs") -> Path | None:
    """Where the ``what`` figures of ``dataset`` under this family and model config are kept, or None (no stored
    index)."""
    directory = getattr(dataset, "index_dir", None)
    if directory is None:
        return None
    import hashlib
    import inspect
    import json

    from dhp.data.index import stable

    code = hashlib.sha256()
    folders = sorted({Path(inspect.getfile(c)).parent for c in (*type(family).__mro__, Family)
                      if c.__module__.startswith("dhp.")})
    for folder in folders:  # the family's cost code (its classes' packages): a change computes them again
        for f in sorted(folder.glob("*.py")):
            code.update(f.read_bytes())
    key = json.dumps({"family": family.name, "model": stable(model_cfg), "code": code.hexdigest()}, sort_keys=True)
    return Path(directory) / f"{what}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"


def _compute_costs(family: Family, model_cfg: Any, dataset: SFTDataset) -> dict[str, np.ndarray]:
    """Each module's cost of every sample (one visit per sample: its ``info``, then every module's cost)."""
    n = len(dataset)
    out = {m.name: np.zeros(n, np.float64) for m in (*family.encoders, family.language)}
    for i in range(n):
        info = dataset.info(i)
        for enc in family.encoders:
            if enc.num_placeholders(info, model_cfg):
                out[enc.name][i] = float(enc.cost(info, model_cfg))
        out[family.language.name][i] = float(family.language.cost(info, model_cfg))
    return out


def _compute_flops(family: Family, model_cfg: Any, dataset: Any) -> dict[str, np.ndarray]:
    """Each module's (forward, backward) FLOPs of every sample (``Module.flops``), as ``NAME.forward`` and
    ``NAME.backward``."""
    n = len(dataset)
    out = {f"{m.name}.{part}": np.zeros(n, np.float64) for m in family.modules for part in ("forward", "backward")}
    for i in range(n):
        info = dataset.info(i)
        for m in family.modules:
            out[f"{m.name}.forward"][i], out[f"{m.name}.backward"][i] = m.flops(info, model_cfg)
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
    # workers reuse the driver's validation instead of reading every header again: its stored index (mapped, a few
    # bytes to send) or, where none could be stored, the result itself
    if dataset.index_dir is not None:
        spec = replace(spec, index_dir=str(dataset.index_dir), index_digest=dataset.index.digest())
    elif isinstance(dataset, SFTDataset):
        spec = replace(spec, validated=dataset.validation)  # (a mix: each file's index is in the cache)
    return Prepared(inputs, dataset, spec, make_planner(inputs, dataset))
