"""The planner's step time for a training config as it stands (``dhp bench --profile``, ``benchmarks/plan_check.py``).

A config's layout (``planner.config_jobs``), its placement, ``runtime.encoders_ahead`` and encoder window, priced
on a device profile and replayed as the runtime runs it (``dhp.plan.schedule``: on a CPU profile the ranks
running at a moment share the host's cores), on its own data:

* ``step`` given (what ``dhp bench`` does: its first measured step): that step's plan by the trainer's own
  planner (its rounds; each group's samples, an encoder's being those that carry its media), and per group one
  micro-batch of the step's real samples (``real_batches``: their host metadata as loaded, their media as shapes)
  in place of the family's synthetic ones: mixed lengths, several images to a sample, text-only samples priced
  as they are (attention is quadratic per sample, and the ops a micro-batch dispatches grow with its segments);
  and the loaders' seconds per sample of each group, timed on those samples' loads: the replay runs
  the loaders beside the calls (on a CPU host, on the same cores) and makes a forward wait for its samples;
* without it, the data set's mean sample (per encoder the mean of its input tokens over the samples that carry
  it, placeholders x the family's input tokens per placeholder; the mean text besides the placeholders),
  ``train.micro_batch_size`` of them per micro-batch and ``train.global_batch_size`` per step for every group;
  loading not priced.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from dhp.plan.measure import GroupJob, SampleBatch, shape_sample
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


def real_batches(cfg: Any, family: Any, step: int) -> tuple[Any, dict[str, SampleBatch], dict[str, float]]:
    """(step ``step``'s plan, by the trainer's own planner over the config's data; per module group a micro-batch of
    it as a ``SampleBatch``; per group the mean seconds of those samples' loads, timed as its loaders make them,
    after one untimed load: with the media for an encoder, ids and placeholders only for the language model): the
    language model's first round (its first replica's samples), and each encoder's busiest replica in the first
    round whose replicas hold any of its samples (those that carry its media)."""
    from dhp.inputs import prepare

    prepared = prepare(cfg)
    plan = prepared.planner.plan(step)
    ds = prepared.dataset
    out, load_s = {}, {}
    for name in family.module_names:
        language = name == family.language.name
        if language:
            ids = list(plan.rounds[0].replicas(name)[0])
        else:
            ids = next((list(max(rnd.replicas(name), key=len)) for rnd in plan.rounds if any(rnd.replicas(name))), [])
        if ids:  # untimed: a process's first load opens the files and sets up the decoders, once per run
            ds.get(ids[0], pixels=not language)
        t0 = time.perf_counter()
        loaded = [ds.get(i, pixels=not language) for i in ids]  # as the group's loaders load them
        if ids:
            load_s[name] = (time.perf_counter() - t0) / len(ids)
        out[name] = SampleBatch.of(loaded if language else
                                   [shape_sample(s, ds.get(i, pixels=False)) for i, s in zip(ids, loaded, strict=True)])
    return plan, out, load_s


def predict_config(cfg: Any, profile: Profile, workers: int = 1, step: int | None = None) -> dict[str, Any]:
    """``{"predicted_step_s", "critical_path", "pricing", "groups": {group: breakdown}, "calls": {group: [[kind,
    round], ...]}}`` of one config. ``step``: price that step of the config's own data (its plan's rounds, a
    micro-batch of its real samples per group: ``real_batches``); None: the data set's mean sample, every group
    taking every sample (``data_shape``)."""
    from dhp.observe.devices import get_device
    from dhp.plan.planner import Pricing, Row, config_jobs, evaluate, measure_all

    family, model_cfg, media, text = data_shape(cfg)
    device = "cuda" if profile.device_type == "cuda" else "cpu"
    jobs = config_jobs(cfg, family, media, text, device=device, micro_batch_size=cfg.train.micro_batch_size)
    jobs = {k: replace(j, text_tokens=text) for k, j in jobs.items()}
    plan, load_s = None, {}
    if step is not None:
        plan, batches, load_s = real_batches(cfg, family, step)
        jobs = {k: replace(j, batch=batches[k], micro_batch_size=max(1, batches[k].size)
                           if k != family.language.name else j.micro_batch_size) for k, j in jobs.items()}
    results = measure_all(list(jobs.values()), model_cfg, workers=workers, family=family)
    placement = cfg.runtime.placement if cfg.runtime.placement in ("collocated", "disaggregated") else "collocated"
    gpus = sum(j.ranks for j in jobs.values()) if placement == "disaggregated" else max(j.ranks for j in jobs.values())
    row = Row("config", media, False, jobs, placement=placement, encoders_ahead=cfg.runtime.encoders_ahead,
              encoder_window=cfg.runtime.encoder_window, load_s=load_s, loader_workers=cfg.data.loader_workers)
    row = evaluate(row, results, get_device("h100"), gpus, 1e9, text, family, model_cfg, pricing=Pricing(profile),
                   samples=cfg.train.global_batch_size, plan=plan)
    # each group's calls in the order it runs them (the trace's order, ``dhp.plan.schedule``; its loads aside)
    calls = {g: [[c.kind, c.round] for c, _, _ in row.replay.spans if c.group == g and c.round >= 0
                 and c.kind != "load"] for g in jobs}
    return {"predicted_step_s": row.step_time_s, "critical_path": row.critical_path, "pricing": row.pricing,
            "sample": {"media_tokens": media, "text_tokens": text, "step": step}, "groups": row.groups,
            "calls": calls}
