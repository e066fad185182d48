"""A second encoder that only the tests know trains under the Ray runtime in three groups and equals the
single-process reference: vision (Ulysses sp=2), a toy audio encoder (dp=2), text (tp=2), disaggregated."""

from __future__ import annotations

import pytest

from dhp.models.registry import register_family
from tests.parity import assert_matches_reference, run_steps
from tests.toy_audio import TOY_FAMILY, write_audio_data


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
