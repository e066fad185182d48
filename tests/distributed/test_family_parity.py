"""A second encoder that only the tests know trains under the Ray runtime in three groups and equals the
single-process reference: vision (Ulysses sp=2), a toy audio encoder (dp=2), text (tp=2), disaggregated."""

from __future__ import annotations

import pytest

from dhp.backends import make_backend
from dhp.config import load_config
from dhp.inputs import prepare
from dhp.models.registry import register_family
from tests.toy_audio import TOY_FAMILY, write_audio_data

STEPS = 3


def run(overrides: list[str]):
    cfg = load_config(None, overrides)
    run_ = prepare(cfg)
    planner = run_.planner
    backend = make_backend(run_.inputs, run_.dataset, run_.spec)
    try:
        initial = backend.rank_state_dicts()
        stats = [backend.run_step(planner.plan(s)) for s in range(STEPS)]
        return stats, backend.rank_state_dicts(), initial
    finally:
        backend.shutdown()


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
    ref_stats, ref_state, initial = run(audio_overrides + ["runtime.backend=local"])
    stats, state, _ = run(audio_overrides + [
        "runtime.backend=ray", "runtime.placement=disaggregated", "vision.parallel.sp=2",
        "audio.parallel.dp=2", "text.parallel.tp=2",
    ])
    assert [s.loss for s in stats] == pytest.approx([s.loss for s in ref_stats], rel=1e-5)
    assert [s.supervised_tokens for s in stats] == [s.supervised_tokens for s in ref_stats]
    assert stats[0].timings["audio_forward"] > 0 and stats[0].timings["audio_backward"] > 0
    assert set(stats[0].imbalance) == {"vision", "audio", "text"}
    assert stats[0].comm_bytes["audio_all_reduce"] > 0  # the two audio replicas summed their gradients
    assert [len(state[m]) for m in ("vision", "audio", "text")] == [2, 2, 2]
    for module, ranks in state.items():
        want, start = ref_state[module][0], initial[module][0]
        moved = max((want[k] - start[k]).abs().max().item() for k in want)
        assert moved > 1e-4, module  # every module trained, so equal weights mean something
        for rank, got in enumerate(ranks):  # every replica / rank of every group
            assert got.keys() == want.keys()
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-5, (module, rank, worst)
