"""The planner's micro-batch of real samples (``dhp bench --profile`` prices a config's own data, ``docs/plan.md``):
a ``SampleBatch`` measures exactly as the samples it holds, an encoder takes the ones that carry its media, and a
config's step is priced on its own plan's rounds and samples."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from dhp.models.qwen2_5_vl.config import tiny
from dhp.plan.measure import (
    GroupJob,
    SampleBatch,
    _map_tensors,
    family_of,
    measure,
    media_of,
    shape_sample,
    synthetic_samples,
)
from dhp.plan.ops import merged

CFG = tiny(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
FIGURES = ("flops", "peak", "activations", "retained", "router", "comm", "step_comm")


def as_batch(samples: list) -> SampleBatch:
    """Samples made under the planner's shape mode (media fake) as a ``SampleBatch`` (media meta)."""
    return SampleBatch.of([_map_tensors(s, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                                        if is_fake(t) else t) for s in samples])


def figures(job: GroupJob) -> dict:
    r = measure(job, CFG)
    return {**{k: getattr(r, k) for k in FIGURES}, "ops": merged(r.ops)}


@pytest.mark.parametrize("module,par", [("text", dict(inner=2, inner_kind="tp")),
                                        ("vision", dict(inner=2, inner_kind="sp"))])
def test_a_batch_of_the_synthetic_samples_measures_as_the_synthetic_job(module: str, par: dict) -> None:
    """The same samples, given as a batch: every figure equal (FLOPs, peaks, collectives, the whole op tally)."""
    job = GroupJob(module, media=media_of({"vision": 64}), text_tokens=24, micro_batch_size=3, device="cpu", **par)
    batch = as_batch(synthetic_samples(job, CFG, family_of()))
    assert figures(replace(job, batch=batch)) == figures(job)


def test_an_encoder_takes_the_samples_of_its_batch_that_carry_its_media() -> None:
    """A text-only sample in the micro-batch: the vision rank encodes the others only, the language model packs
    all of them (its FLOPs grow with the text-only sample's tokens)."""
    family = family_of()
    job = GroupJob("vision", media=media_of({"vision": 64}), text_tokens=24, micro_batch_size=2, device="cpu")
    images = synthetic_samples(job, CFG, family)
    (text_only,) = synthetic_samples(replace(job, media=(), micro_batch_size=1), CFG, family, media={})
    with_text = as_batch([images[0], text_only, images[1]])
    assert figures(replace(job, batch=with_text)) == figures(replace(job, batch=as_batch(images)))
    lm = GroupJob("text", media=media_of({"vision": 64}), text_tokens=24, device="cpu")
    assert measure(replace(lm, batch=with_text), CFG).flops > measure(replace(lm, batch=as_batch(images)), CFG).flops


def test_a_loaded_sample_keeps_its_metadata_and_holds_no_media_data(demo_data) -> None:
    """``shape_sample``: the pixels a meta tensor of their shape, the grid and the ids as loaded."""
    from dhp.config import load_config
    from dhp.inputs import prepare

    ds = prepare(load_config(None, [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}"])).dataset
    i = next(i for i in range(len(ds)) if ds.info(i).image_grids)
    full, meta = ds.get(i), ds.get(i, pixels=False)
    s = shape_sample(full, meta)
    assert s.pixel_values.is_meta and s.pixel_values.shape == full.pixel_values.shape
    assert torch.equal(s.image_grid_thw, full.image_grid_thw) and torch.equal(s.input_ids, full.input_ids)
    (back,) = SampleBatch.of([s]).samples()
    assert back.pixel_values.is_meta and torch.equal(back.labels, full.labels)


def test_bench_prices_a_configs_own_step(demo_overrides) -> None:
    """``predict_config(step=...)``: the step's plan (its rounds), a real micro-batch per group; the vision
    group's micro-batch is its samples that carry images, and its step counts only those."""
    from dhp.config import load_config
    from dhp.inputs import prepare
    from dhp.observe.devices import get_device
    from dhp.plan.predict import predict_config, real_batches
    from dhp.plan.profile import roofline

    cfg = load_config(None, [*demo_overrides, "runtime.backend=ray", "vision.parallel.sp=2", "text.parallel.tp=2"])
    family = family_of()
    plan, batches, load_s = real_batches(cfg, family, 1)
    prepared = prepare(cfg)
    assert plan.sample_ids == prepared.planner.plan(1).sample_ids
    text_ids = [s.index for s in batches["text"].samples()]
    assert text_ids == list(plan.rounds[0].replicas("text")[0])
    vision = batches["vision"].samples()
    assert vision and all(prepared.dataset.info(s.index).image_grids for s in vision)
    p = predict_config(cfg, roofline(get_device("h100")), step=1)
    assert p["predicted_step_s"] > 0 and p["sample"]["step"] == 1
    first = next(rnd for rnd in plan.rounds if any(rnd.replicas("vision")))
    assert sorted(s.index for s in vision) == sorted(max(first.replicas("vision"), key=len))
    assert [c for c in p["calls"]["vision"] if c[0] == "forward"] == [["forward", j] for j in range(len(plan.rounds))]
    # the loaders: timed per sample on the step's own samples, each group's, and replayed beside the calls
    assert set(load_s) == {"vision", "text"} and all(v > 0 for v in load_s.values())
    assert all(p["groups"][g]["loader_s"] > 0 and p["groups"][g]["data_wait_s"] >= 0 for g in ("vision", "text"))
