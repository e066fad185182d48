"""FSDP2 over dp on top of TP (a 2D dp x tp mesh) keeps the unsharded gradients and their norm.

FSDP2 shards TP-sharded parameters a second time along dim 0 and marks that dim ``_StridedShard``,
which is not a ``Shard`` placement: a norm that only all-reduces over ``Shard`` dims counts each
2D shard on its dp rank alone (this test caught that: 0.65 of the true squared norm). Four gloo
ranks, dp 2 x tp 2, every dp replica on the same packed sample, so FSDP's SUM reduce-scatter gives
twice the single-process gradient and four times its squared norm.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dhp.models.qwen2_5_vl.model import build_model
from dhp.parallel.sharding import apply_fsdp
from dhp.parallel.tensor import grad_norm_sq
from dhp.runtime.mesh import ModuleLayout, create_mesh_groups, device_mesh
from tests.dist_utils import run_distributed
from tests.unit.test_tensor_parallel import full, text_cfg, text_inputs

DP, TP = 2, 2


def summed_loss(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    embeds = x["image_embeds"].clone().requires_grad_()
    loss = model.loss_sum(x["input_ids"], x["position_ids"], x["targets"], embeds, x["cu_seqlens"])
    loss.backward()
    return loss.detach()


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from dhp.models.qwen2_5_vl.parallelize import parallelize_text

    layout = ModuleLayout("text", DP, TP, "tp")  # the runtime's own meshes, made from subgroups
    mesh = device_mesh(layout, 0, create_mesh_groups([layout], "gloo", rank), "cpu")
    cfg = text_cfg()
    text = build_model(cfg, seed=0).language
    parallelize_text(text, mesh["tp"])
    apply_fsdp(text, mesh["dp"], list(text.layers), forward_methods=("loss_sum",))
    loss = summed_loss(text, text_inputs(cfg))
    norm_sq = grad_norm_sq(text.parameters())
    placements = {str(p.grad.placements) for p in text.parameters()}
    return {"loss": loss, "norm_sq": norm_sq, "placements": placements,
            "grads": {n: full(p.grad) for n, p in text.named_parameters()}}


@pytest.fixture(scope="module")
def sharded() -> list[dict[str, Any]]:
    return run_distributed(_worker, DP * TP, timeout_s=180)


def test_fsdp_over_tp_keeps_grads_and_norm(sharded: list[dict[str, Any]]) -> None:
    cfg = text_cfg()
    ref = build_model(cfg, seed=0).language
    loss = summed_loss(ref, text_inputs(cfg))
    ref_norm_sq = grad_norm_sq(ref.parameters())
    assert any("_StridedShard" in p for p in sharded[0]["placements"])  # the 2D case is really exercised
    for r in sharded:
        torch.testing.assert_close(r["loss"], loss, rtol=1e-5, atol=1e-5)
        assert r["norm_sq"] == pytest.approx(DP * DP * ref_norm_sq, rel=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][name], DP * p.grad, rtol=1e-5, atol=1e-5)
