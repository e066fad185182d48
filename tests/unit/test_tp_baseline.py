"""The uniform-TP baseline is the best TP can be: all-reduces per block, counted with ``CommCounter``.

Megatron fuses q/k/v and gate/up into one weight each, so a block reduces one input gradient per sub-layer in
backward. So do we: the vision ``attn.qkv``, the text ``self_attn.qkv_proj`` (GQA: unequal q, k, v parts) and
every ``mlp.gate_up_proj`` are one fused Linear each, sharded rank-ordered (``FusedColwise``). Per block and step,
tp 2:

* vision: forward proj + down, backward qkv input + MLP input: 4 all-reduces of [S, C];
* text: forward o + down, backward attention input + MLP input: 4 of [1, T, D] (it was 7 with q, k, v, gate and
  up apart).

The plan without the SP-style input hooks (each projection its own ``from_local``) is rebuilt here: with every
column-parallel projection fused there is nothing left for a shared input to save.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from dhp.models.qwen2_5_vl import build_model
from dhp.models.qwen2_5_vl.parallelize import (
    parallelize_text,
    parallelize_vision_tp,
    text_layer_plan,
    text_top_plan,
    vision_block_plan,
)
from dhp.parallel.comm import CommCounter
from tests.dist_utils import run_distributed
from tests.unit.test_tensor_parallel import text_cfg, text_inputs, vision_inputs

TP = 2


def _naive(plan: dict) -> dict:
    """The plan without the shared-input hooks: every column-parallel projection reduces its own input grad."""
    return {k: v for k, v in plan.items() if k not in ("mlp", "self_attn")}


def _count(forward, backward) -> dict[str, dict[str, int]]:
    counter = CommCounter()
    with counter:
        out = forward()
    fwd = {"calls": counter.calls["all_reduce"], "bytes": counter.bytes["all_reduce"]}
    counter.reset()
    with counter:
        backward(out)
    bwd = {"calls": counter.calls["all_reduce"], "bytes": counter.bytes["all_reduce"]}
    kinds = set(counter.calls)
    return {"forward": fwd, "backward": bwd, "other_kinds": sorted(kinds - {"all_reduce"})}


def _worker(rank: int, world: int) -> dict[str, Any]:
    mesh = DeviceMesh("cpu", list(range(world)))
    cfg = text_cfg()
    res: dict[str, Any] = {}
    xv = vision_inputs(cfg)
    xt = text_inputs(cfg)
    for variant in ("shipped", "naive"):
        vision = build_model(cfg, seed=0).visual
        if variant == "shipped":
            parallelize_vision_tp(vision, mesh)
        else:
            heads = cfg.vision.num_heads
            for block in vision.blocks:
                parallelize_module(block, mesh, _naive(vision_block_plan(cfg.vision)))
                block.attn.num_heads = heads // world
        res[f"vision_{variant}"] = _count(lambda v=vision: v(xv["pixel_values"], xv["grid_thw"]),
                                          lambda out: (out * xv["weight"]).sum().backward())
        text = build_model(cfg, seed=0).language
        if variant == "shipped":
            parallelize_text(text, mesh)
        else:
            parallelize_module(text, mesh, text_top_plan())
            for layer in text.layers:
                parallelize_module(layer, mesh, _naive(text_layer_plan(cfg.text)))
        embeds = xt["image_embeds"].clone().requires_grad_()
        res[f"text_{variant}"] = _count(
            lambda t=text, e=embeds: t.hidden_states(xt["input_ids"], xt["position_ids"], e, xt["cu_seqlens"]),
            lambda out: out.square().sum().backward(),
        )
    return res


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return run_distributed(_worker, TP, timeout_s=120)


def test_vision_tp_all_reduces_four_per_block(counts):
    """depth blocks, S patches of width C, 4-byte floats: 2 all-reduces of [S, C] forward, 2 backward per block."""
    cfg = text_cfg().vision
    s = sum(t * h * w for t, h, w in [[1, 8, 12]])
    payload = s * cfg.hidden_size * 4
    for res in counts:
        got, naive = res["vision_shipped"], res["vision_naive"]
        assert got["forward"] == {"calls": 2 * cfg.depth, "bytes": 2 * cfg.depth * payload}
        assert got["backward"] == {"calls": 2 * cfg.depth, "bytes": 2 * cfg.depth * payload}
        assert got["other_kinds"] == []
        # per block and step: 4 all-reduces (fused qkv, fused gate/up: one input gradient each, as Megatron's)
        assert (got["forward"]["calls"] + got["backward"]["calls"]) / cfg.depth == 4
        assert naive == got  # nothing left to share: the vision block's column-parallel projections are fused


def test_text_tp_all_reduces_four_per_layer(counts):
    """L layers over [1, T, D]: the embedding's forward all-reduce, then 2 forward + 2 backward per layer (the fused
    qkv and the fused gate/up each reduce their one input gradient: 7 with q, k, v, gate and up apart)."""
    cfg = text_cfg().text
    seq = text_inputs(text_cfg())["input_ids"].shape[1]
    layers, payload = cfg.num_hidden_layers, seq * cfg.hidden_size * 4
    for res in counts:
        got, naive = res["text_shipped"], res["text_naive"]
        assert got["forward"] == {"calls": 1 + 2 * layers, "bytes": (1 + 2 * layers) * payload}
        assert got["backward"] == {"calls": 2 * layers, "bytes": 2 * layers * payload}
        assert naive == got  # nothing left to share: the layer's column-parallel projections are fused
        assert got["other_kinds"] == []
