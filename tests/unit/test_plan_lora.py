"""The planner's LoRA rows: a fake run of a LoRA module holds gradients and optimizer state for the adapters only
and its frozen base in the compute dtype (2 bytes a parameter in bf16), against closed forms from the module's
own parameter counts; `dhp plan --lora` plans such rows and prints the keys that train them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from dhp.cli import main
from dhp.errors import UsageError
from dhp.models.registry import get_family
from dhp.parallel.lora import apply_lora, is_adapter, parts_by_weights
from dhp.plan.command import lora_of
from dhp.plan.measure import GroupJob, measure

RANK = 4


def _counts(model_cfg: Any) -> tuple[int, int]:
    """(base, adapter) parameter elements of the text module with LoRA rank RANK on every Linear."""
    family = get_family("qwen2_5_vl")
    spec = family.module("text")
    with torch.device("meta"):
        module = spec.build(model_cfg)
    apply_lora(module, RANK, 16.0, 0.0, "all-linear", parts_by_weights(family.weights, spec.weight_prefix, module,
                                                                       model_cfg))
    named = dict(module.named_parameters())  # tied weights once
    adapters = sum(p.numel() for n, p in named.items() if is_adapter(n))
    return sum(p.numel() for p in named.values()) - adapters, adapters


def test_lora_rows_hold_state_for_the_adapters_only_and_a_bf16_base() -> None:
    from dhp.plan.command import model_config

    _, model_cfg = model_config("tiny")
    base, adapters = _counts(model_cfg)
    assert 0 < adapters < base
    job = GroupJob("text", static=True, device="cpu", dtype="float32")
    full, lora = measure(job, model_cfg), measure(GroupJob(**{**job.__dict__, "lora_rank": RANK}), model_cfg)
    assert full.grads == 4 * base and full.optimizer == 8 * base
    assert lora.grads == 4 * adapters  # float32 gradients of the adapters alone
    assert lora.optimizer == 8 * adapters  # AdamW's two moments, the adapters alone
    assert lora.weights - full.weights == 4 * adapters  # float32 compute: the base stays as it is
    # bf16 compute (float32 master weights for what trains): the frozen base in bf16, the adapters in float32
    bf16 = measure(GroupJob("text", static=True, device="cuda", dtype="bfloat16", lora_rank=RANK), model_cfg)
    assert bf16.weights - full.weights == 4 * adapters - 2 * base
    assert bf16.optimizer == 8 * adapters


def test_a_tracked_lora_run_counts_the_adapters_gradients_and_pure_bf16_adapters() -> None:
    """A run with its forward and backward (``MemTracker``, which hooks the gradients of what trains: a frozen
    base takes no hook) holds the adapters' gradients alone; under pure bf16 (``train.precision=bf16``) the
    adapters are bf16 as every parameter that trains (ZeRO-1's optimizer takes one dtype): 2 bytes of gradient
    and 4 of AdamW's moments per adapter parameter."""
    from dhp.plan.command import model_config

    _, model_cfg = model_config("tiny")
    base, adapters = _counts(model_cfg)
    job = GroupJob("text", device="cpu", dtype="float32", text_tokens=32, lora_rank=RANK)
    tracked = measure(job, model_cfg)
    assert tracked.grads == 4 * adapters and tracked.optimizer == 8 * adapters
    buffers = tracked.breakdown["Buffer"]  # the rotary table
    assert tracked.weights == 4 * (base + adapters) + buffers
    pure = measure(GroupJob(**{**job.__dict__, "precision": "bf16", "dtype": "bfloat16", "dp": 2, "zero": 1}),
                   model_cfg)
    assert pure.grads == 2 * adapters and pure.weights == 2 * (base + adapters) + buffers
    assert pure.optimizer == pytest.approx(4 * adapters / 2, rel=0.05)  # ZeRO-1: half the moments on a rank


def test_plan_with_lora_prints_and_writes_the_lora_keys(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    rc = main(["plan", "tiny", "--gpus", "2", "--strategies", "zero3", "--vision-tokens", "256", "--text-tokens",
               "64", "--lora", "text=8", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "LoRA text r=8 (base frozen)" in printed and "text.lora.r=8" in printed
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("text.lora.r=8" in r["overrides"] for r in rows)
    assert all(not any(o.startswith("vision.lora") for o in r["overrides"]) for r in rows)


@pytest.mark.parametrize("spec, message", [("audio=8", "not a module"), ("text=0", "whole number >= 1"),
                                           ("text=x", "whole number >= 1"), ("text", "whole number >= 1")])
def test_bad_lora_flags_name_the_flag(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        lora_of(spec, get_family("qwen2_5_vl"))


def test_a_bare_rank_is_the_language_models() -> None:
    assert lora_of("16", get_family("qwen2_5_vl")) == {"text": 16}
    assert lora_of("text=16,vision=4", get_family("qwen2_5_vl")) == {"text": 16, "vision": 4}
