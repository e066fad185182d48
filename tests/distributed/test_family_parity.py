"""A second encoder that only the tests know trains under the Ray runtime in three groups and equals the
single-process reference: vision (Ulysses sp=2), a toy audio encoder (dp=2), text (tp=2), disaggregated.

And an encoder of two named outputs (``tests.toy_named``: ``embeds`` float32 and ``extra`` float64 of another
width) through the p2p router under text TP 2 with Megatron SP: each text rank receives both parts of its
sequence slice's rows, and each audio rank gets the gradient of each part back (its ``extra`` head trains only
through it), every rank equal to the reference."""

from __future__ import annotations

import pytest

from dhp.config import load_config
from dhp.inputs import prepare
from dhp.models.registry import register_family
from tests.parity import assert_matches_reference, run_steps
from tests.toy_audio import TOY_FAMILY, write_audio_data
from tests.toy_named import EXTRA_DTYPE, EXTRA_WIDTH, NAMED_FAMILY


@pytest.fixture(scope="module")
def audio_overrides(demo_data, tmp_path_factory):
    register_family(TOY_FAMILY)  # the registry alone: nothing under dhp/ names the toy family
    out = tmp_path_factory.mktemp("audio")
    data = write_audio_data(demo_data.train, demo_data.root, out / "audio.jsonl")
    return [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "model.family=toy_qwen_audio", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9", "train.warmup_steps=1",
            "train.clip_grad_norm=1.0", f"output.dir={out / 'run'}", "runtime.cpus_per_worker=0.5"]


def test_three_groups_match_the_reference_on_every_replica(ray_cluster, audio_overrides):
    reference = run_steps(audio_overrides + ["runtime.backend=local"])
    stats, state, _ = run_steps(audio_overrides + [
        "runtime.backend=ray", "runtime.placement=disaggregated", "vision.parallel.sp=2",
        "audio.parallel.dp=2", "text.parallel.tp=2", "runtime.count_collectives=true",  # it reads comm_bytes
    ])
    assert_matches_reference(stats, state, reference)
    assert stats[0].timings["audio_forward"] > 0 and stats[0].timings["audio_backward"] > 0
    assert set(stats[0].imbalance) == {"vision", "audio", "text"}
    assert stats[0].comm_bytes["audio_all_reduce"] > 0  # the two audio replicas summed their gradients
    assert [len(state[m]) for m in ("vision", "audio", "text")] == [2, 2, 2]


def test_named_outputs_through_the_router_match_the_reference(ray_cluster, audio_overrides):
    register_family(NAMED_FAMILY)
    named = audio_overrides + ["model.family=toy_named_audio"]
    reference = run_steps(named + ["runtime.backend=local"], steps=2)
    stats, state, initial = run_steps(named + [
        "runtime.backend=ray", "runtime.placement=disaggregated", "audio.parallel.dp=2", "text.parallel.tp=2",
        "text.parallel.sequence_parallel=true"], steps=2)
    assert_matches_reference(stats, state, reference)
    start = initial["audio"][0]["extra.weight"]
    want = reference[1]["audio"][0]["extra.weight"] - start  # the head reached only through the extra gradient
    assert want.abs().max() > 1e-5
    for rank in state["audio"]:  # moved as the reference's on every rank (a dropped gradient: not at all)
        assert (rank["extra.weight"] - start - want).abs().max() < 1e-2 * want.abs().max()
    run = prepare(load_config(None, named + ["runtime.backend=local"]))  # the steps' samples (no Ray)
    cfg, family, width = run.inputs.model_cfg, run.inputs.family, 4 * run.inputs.model_cfg.text.hidden_size
    for step, stat in enumerate(stats):  # each row crosses once each way, every named part counted, none padded
        infos = [run.dataset.info(i) for i in run.planner.plan(step).sample_ids]
        rows = {m: sum(family.module(m).num_placeholders(x, cfg) for x in infos) for m in ("vision", "audio")}
        assert rows["audio"] > 0
        extra = EXTRA_WIDTH * EXTRA_DTYPE.itemsize  # the float64 part
        by = stat.router_bytes_by_direction
        assert by["forward"] == rows["vision"] * (8 + width) + rows["audio"] * (8 + width + extra)
        assert by["backward"] == rows["vision"] * width + rows["audio"] * (width + extra)
