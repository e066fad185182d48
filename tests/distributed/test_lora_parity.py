"""LoRA under dhp's layouts equals the single-process reference (CPU, gloo, real Ray actors), the base frozen.

One reference (text LoRA, vision trained whole) for every layout: text TP 2 with Megatron sequence parallelism
(column-parallel bases: A replicated, B split; row-parallel: A split, B replicated, the partial sums through
the base's reduce-scatter), vision Ulysses SP 2 beside text LoRA (disaggregated), and ZeRO-3 (FSDP2) of both
modules with LoRA on both (its own reference). Every rank's weights equal the reference's, the adapters (and the
whole vision module where it trains) moved, and every frozen base weight is bit-identical to its initial value
on every rank. SGD with momentum, as in ``test_ray_parity.py`` (its update is linear in the gradient). The
shapes are the demo's tiniest, 3 steps: B is zero at init, so the adapters' A moves from step 2 on only.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_ray_parity import SGD, run, worst_rank_difference

TEXT_LORA = ["text.lora.r=4", "text.lora.alpha=8"]
VISION_LORA = ["vision.lora.r=4", "vision.lora.alpha=8", "merger.trainable=true"]


@pytest.fixture(scope="module")
def overrides(demo_data, tmp_path_factory):
    return [
        f"data.path={demo_data.train}",
        f"data.tokenizer={demo_data.tokenizer}",
        "data.max_pixels=12544",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.warmup_steps=1",
        "train.clip_grad_norm=1.0",
        f"output.dir={tmp_path_factory.mktemp('run')}",
        *SGD,
    ]


def assert_lora_matches(got, ref, lora_modules: tuple[str, ...]) -> None:
    stats, state, _ = got
    ref_stats, ref_state, initial = ref
    assert [s.loss for s in stats] == pytest.approx([s.loss for s in ref_stats], rel=1e-5)
    assert [s.grad_norm for s in stats] == pytest.approx([s.grad_norm for s in ref_stats], rel=1e-4)
    assert worst_rank_difference(state, ref_state) < 1e-5
    prefix = {"vision": "visual", "text": "language"}
    for module, ranks in state.items():
        start = {k[len(prefix[module]) + 1:]: v for k, v in initial.items() if k.startswith(prefix[module] + ".")}
        want = ref_state[module][0]
        adapters = [k for k in want if ".lora_" in k]
        moved = max((want[k] - start[k]).abs().max().item() for k in (adapters or want))
        assert moved > 1e-4, module  # the adapters (or the whole module) trained: equal weights mean something
        if module not in lora_modules:
            assert not adapters, module
            continue
        assert adapters, module
        assert max((want[k] - start[k]).abs().max().item() for k in adapters if ".lora_A." in k) > 1e-5
        for rank, rank_state in enumerate(ranks):  # the frozen base, bit for bit, on every rank
            frozen = [k for k in rank_state if ".lora_" not in k and not k.startswith("merger.")]
            assert frozen and all(torch.equal(rank_state[k], start[k]) for k in frozen), (module, rank)


@pytest.fixture(scope="module")
def text_reference(overrides):
    return run(overrides + TEXT_LORA, "local")


LAYOUTS = {
    "text_tp2_sequence_parallel": ["text.parallel.tp=2", "text.parallel.sequence_parallel=true",
                                   "runtime.placement=collocated"],
    "vision_sp2_full_text_lora_disaggregated": ["vision.parallel.sp=2", "runtime.placement=disaggregated"],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_text_lora_layouts_match_reference(ray_cluster, text_reference, overrides, name):
    assert_lora_matches(run(overrides + TEXT_LORA + LAYOUTS[name], "ray"), text_reference, ("text",))


def test_zero3_lora_on_both_modules_matches_reference(ray_cluster, overrides):
    both = overrides + TEXT_LORA + VISION_LORA
    ref = run(both, "local")
    zero3 = ["vision.parallel.dp=2", "vision.parallel.zero=3", "text.parallel.dp=2", "text.parallel.zero=3",
             "runtime.placement=disaggregated"]
    assert_lora_matches(run(both + zero3, "ray"), ref, ("vision", "text"))
