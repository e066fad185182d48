"""The planner's step time for a training config as it stands (``dhp bench --profile``, ``benchmarks/plan_check.py``).

A config's layout (``planner.config_jobs``) on its own data: the data set's mean sample (per encoder the mean
of its input tokens over the samples that carry it, placeholders x the family's input tokens per placeholder;
the mean text besides the placeholders), ``train.micro_batch_size`` of them per micro-batch and
``train.global_batch_size`` per step, the config's placement, ``runtime.encoders_ahead`` and encoder window,
priced on a device profile and replayed as the runtime runs it (``dhp.plan.schedule``: on a CPU profile the
ranks running at a moment share the host's cores). A mean sample prices the mean of matmul work, not
attention's (quadratic in each sample's length): on data of even sizes (the demo's) the two agree; on mixed
lengths the prediction is low for attention-bound encoders.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dhp.plan.measure import GroupJob
from dhp.plan.profile import Profile

_SHAPES: dict[str, tuple[Any, Any, dict[str, int], int]] = {}


def data_shape(cfg: Any, limit: int = 512) -> tuple[Any, Any, dict[str, int], int]:
    """(family, model config, ``{encoder: mean input tokens}``, mean text tokens) of the config's training data
    (its first ``limit`` samples, from the data set's index: no media decoded)."""
    from dhp.inputs import dataset_spec, open_dataset, resolve_inputs
    from dhp.plan.measure import synthetic_samples

    key = repr((cfg.model, cfg.data, limit))  # the layouts of one bench share their data: read once
    if key in _SHAPES:
        return _SHAPES[key]
    inputs = resolve_inputs(cfg)
    family, model_cfg = inputs.family, inputs.model_cfg
    ds = open_dataset(dataset_spec(inputs, inputs.train_path))
    infos = [ds.info(i) for i in range(min(limit, len(ds)))]
    media, placeholders = {}, [0.0] * len(infos)
    for enc in family.encoders:
        counts = [enc.num_placeholders(info, model_cfg) for info in infos]
        carrying = [c for c in counts if c]
        if not carrying:
            continue
        (s,) = synthetic_samples(GroupJob(enc.name, media=((enc.name, 4096),), text_tokens=0), model_cfg, family)
        per = 4096 / max(1, enc.num_placeholders(s, model_cfg))  # input tokens per placeholder
        media[enc.name] = max(1, round(per * sum(counts) / len(infos)))
        placeholders = [p + c for p, c in zip(placeholders, counts, strict=True)]
    text = sum(info.num_tokens - p for info, p in zip(infos, placeholders, strict=True)) / max(1, len(infos))
    _SHAPES[key] = family, model_cfg, media, max(1, round(text))
    return _SHAPES[key]


def predict_config(cfg: Any, profile: Profile, workers: int = 1) -> dict[str, Any]:
    """``{"predicted_step_s", "critical_path", "pricing", "groups": {group: breakdown}, "calls": {group: [[kind,
    round], ...]}}`` of one config."""
    from dhp.observe.devices import get_device
    from dhp.plan.planner import Pricing, Row, config_jobs, evaluate, measure_all

    family, model_cfg, media, text = data_shape(cfg)
    device = "cuda" if profile.device_type == "cuda" else "cpu"
    jobs = config_jobs(cfg, family, media, text, device=device, micro_batch_size=cfg.train.micro_batch_size)
    jobs = {k: replace(j, text_tokens=text) for k, j in jobs.items()}
    results = measure_all(list(jobs.values()), model_cfg, workers=workers, family=family)
    placement = cfg.runtime.placement if cfg.runtime.placement in ("collocated", "disaggregated") else "collocated"
    gpus = sum(j.ranks for j in jobs.values()) if placement == "disaggregated" else max(j.ranks for j in jobs.values())
    row = Row("config", media, False, jobs, placement=placement, encoders_ahead=cfg.runtime.encoders_ahead,
              encoder_window=cfg.runtime.encoder_window)
    row = evaluate(row, results, get_device("h100"), gpus, 1e9, text, family, model_cfg, pricing=Pricing(profile),
                   samples=cfg.train.global_batch_size)
    calls = {g: [[c.kind, c.round] for c, _, _ in row.replay.spans if c.group == g and c.round >= 0]
             for g in jobs}  # each group's calls in the order it runs them (the trace's order, ``dhp.plan.schedule``)
    return {"predicted_step_s": row.step_time_s, "critical_path": row.critical_path, "pricing": row.pricing,
            "sample": {"media_tokens": media, "text_tokens": text}, "groups": row.groups, "calls": calls}
