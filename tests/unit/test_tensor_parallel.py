"""Tensor parallelism (DTensor, gloo, 2 processes) against the unsharded single-process modules.

One spawn runs every sharded case (text, text with tied embeddings, vision) and returns gathered logits, losses,
gradients and grad norms; the tests compare them with the same modules built from the same seed, unsharded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dhp.data.batch import PackedMeta
from dhp.models.qwen2_5_vl import build_model
from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig, tiny
from dhp.models.qwen2_5_vl.parallelize import (
    parallelize_text,
    parallelize_vision_tp,
    rows_from_rank_order,
)
from dhp.models.qwen2_5_vl.text import text_qkv_sizes
from dhp.parallel.tensor import check_tp, check_vision_tp, grad_norm_sq
from tests.dist_utils import run_distributed

TP = 2
IMAGE = 290
GRID = [[1, 8, 12]]  # 8x12 patches: 4x6 merged tokens, two windows (one padded), 96 patches


def text_cfg(tie: bool = False) -> Qwen2_5_VLConfig:
    from dataclasses import replace

    # vocab 301: uneven vocabulary shards (151 + 150) on 2 ranks
    cfg = tiny(vocab_size=301, image_token_id=IMAGE, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293)
    return replace(cfg, text=replace(cfg.text, tie_word_embeddings=tie))


def text_inputs(cfg: Qwen2_5_VLConfig, extra: int = 0) -> dict[str, torch.Tensor]:
    """Two packed samples in one row [1, 40 + extra]: 11 + 6 image slots + 4, then 19 + extra text tokens."""
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, 280, (11,), generator=g).tolist() + [IMAGE] * 6
    first += torch.randint(0, 280, (4,), generator=g).tolist()
    second = torch.randint(0, 280, (19 + extra,), generator=g).tolist()
    ids = torch.tensor([first + second])
    seq = ids.shape[1]
    pos = torch.cat([torch.arange(len(first)), torch.arange(len(second))]).view(1, 1, seq).expand(3, 1, seq)
    targets = torch.randint(0, cfg.text.vocab_size, (1, seq), generator=g)
    targets[0, :5] = -100
    targets[0, len(first) - 1] = -100
    targets[0, -3] = cfg.text.vocab_size - 1  # the last column, on the last shard
    return {
        "input_ids": ids,
        "position_ids": pos.contiguous(),
        "targets": targets,
        "image_embeds": torch.randn(6, cfg.text.hidden_size, generator=g),
        "cu_seqlens": torch.tensor([0, len(first), seq]),
    }


def vision_inputs(cfg: Qwen2_5_VLConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    n = sum(t * h * w for t, h, w in GRID)
    return {
        "pixel_values": torch.randn(n, cfg.vision.patch_dim, generator=g),
        "grid_thw": torch.tensor(GRID),
        "weight": torch.randn(n // 4, cfg.vision.out_hidden_size, generator=g),
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def tp_size_of(p: torch.Tensor) -> int:
    """The TP degree a parameter is sharded over: the size of its last mesh dim with a plain ``Shard`` (FSDP2 over
    TP marks its own dp dim ``_StridedShard``); 1 for a plain tensor. For TP layouts (with or without FSDP)."""
    if not isinstance(p, DTensor):
        return 1
    dims = [i for i, pl in enumerate(p.placements) if type(pl) is Shard]
    return p.device_mesh.size(dims[-1]) if dims else 1


def canonical(name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (the full tensor of parameter ``p``, or of its gradient) in HF's row order: a TP-sharded fused
    projection (gate/up, the text q/k/v of ``text_cfg``, the vision qkv) holds its rows grouped by rank
    (``FusedColwise``)."""
    tp = tp_size_of(p)
    if tp == 1:
        return t
    sizes = None
    if name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
        sizes = (t.shape[0] // 2,) * 2
    elif name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
        sizes = text_qkv_sizes(text_cfg().text)
    elif name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        sizes = (t.shape[0] // 3,) * 3
    return t if sizes is None else rows_from_rank_order(t, sizes, tp)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, in HF's row order."""
    return {n: canonical(n, p, full(p.grad)) for n, p in model.named_parameters()}


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, in HF's row order."""
    return {n: canonical(n, p, full(p)) for n, p in model.named_parameters()}


def run_text(model: torch.nn.Module, x: dict[str, torch.Tensor]) -> dict[str, Any]:
    embeds = x["image_embeds"].clone().requires_grad_()
    args = (x["input_ids"], x["position_ids"])
    with torch.no_grad():
        logits = full(model(*args, x["image_embeds"], x["cu_seqlens"]))
    loss = model.loss_sum(*args, x["targets"], embeds, x["cu_seqlens"])
    loss.backward()
    grads = full_grads(model)
    out = {"logits": logits, "loss": loss.detach(), "grads": grads, "embeds_grad": embeds.grad,
           "norm_sq": float(grad_norm_sq(model.parameters())), "grad_layouts": grad_layout_mismatches(model)}
    # the same loss over the supervised rows only (host metadata, as the engine passes it): lm_head sees 30 of 40
    model.zero_grad(set_to_none=True)
    embeds = x["image_embeds"].clone().requires_grad_()
    loss = model.loss_sum(*args, x["targets"], embeds, meta=text_meta(x))
    loss.backward()
    out["labelled"] = {"loss": loss.detach(), "grads": full_grads(model),
                       "embeds_grad": embeds.grad, "grad_layouts": grad_layout_mismatches(model)}
    return out


def text_meta(x: dict[str, torch.Tensor]) -> PackedMeta:
    """The host metadata ``Batch.meta`` gives the engine for these inputs."""
    flat_ids, flat_targets = x["input_ids"].reshape(-1), x["targets"].reshape(-1)
    return PackedMeta(cu_seqlens=tuple(x["cu_seqlens"].tolist()),
                      label_rows=(flat_targets != -100).nonzero().flatten(),
                      placeholders={IMAGE: (flat_ids == IMAGE).nonzero().flatten()})


def grad_layout_mismatches(model: torch.nn.Module) -> list[str]:
    """Parameters whose gradient is not laid out like the parameter (placements and local shape): optimizers,
    clipping, ZeRO-1 and checkpoints rely on it, and a Replicate grad of a sharded weight costs its full size."""
    bad = []
    for n, p in model.named_parameters():
        g = p.grad
        if isinstance(p, DTensor):
            if not isinstance(g, DTensor) or g.placements != p.placements or g.to_local().shape != p.to_local().shape:
                bad.append(f"{n}: {getattr(g, 'placements', type(g).__name__)} vs {p.placements}")
        elif isinstance(g, DTensor) or g.shape != p.shape:
            bad.append(n)
    return bad


def run_vision(model: torch.nn.Module, x: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    out = model(x["pixel_values"], x["grid_thw"])
    (out * x["weight"]).sum().backward()
    grads = full_grads(model)  # the sharded fused qkv and gate/up rows back in HF order
    return {"out": out.detach(), "grads": grads, "norm_sq": float(grad_norm_sq(model.parameters()))}


def _sharded_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(123 + rank)  # the plans must not depend on the rank's RNG
    mesh = DeviceMesh("cpu", list(range(world_size)))
    results: dict[str, Any] = {}
    for tie in (False, True):
        cfg = text_cfg(tie)
        text = build_model(cfg, seed=0).language
        parallelize_text(text, mesh)
        results[f"text_tie{tie}"] = run_text(text, text_inputs(cfg))
    for extra in (0, 1):  # sequence parallel, T = 40 and T = 41 (padded to 42 inside)
        cfg = text_cfg()
        text = build_model(cfg, seed=0).language
        parallelize_text(text, mesh, sequence_parallel=True)
        shapes: list[tuple[int, ...]] = []
        text.layers[0].register_forward_hook(lambda m, a, out, shapes=shapes: shapes.append(tuple(out.shape)))
        results[f"text_sp{extra}"] = run_text(text, text_inputs(cfg, extra))
        results[f"text_sp{extra}"]["residual_shape"] = shapes[0]
        results[f"text_sp{extra}"]["norm_grad_placements"] = str(text.norm.weight.grad.placements)
    cfg = text_cfg()
    vision = build_model(cfg, seed=0).visual
    parallelize_vision_tp(vision, mesh)
    results["vision"] = run_vision(vision, vision_inputs(cfg), world_size)
    return results


@pytest.fixture(scope="module")
def sharded() -> list[dict[str, Any]]:
    return run_distributed(_sharded_worker, TP, timeout_s=120)


def reference_text(tie: bool, extra: int = 0) -> dict[str, Any]:
    cfg = text_cfg(tie)
    return run_text(build_model(cfg, seed=0).language, text_inputs(cfg, extra))


def assert_grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, g in got.items():
        r = ref[name]
        assert g.shape == r.shape, name
        err = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-12)
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


def loss_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A summed float32 loss equal up to a few float32 roundings of its size (its ulp near 200 is 1.5e-5: the
    order of a sum over ranks, rows or a fused matmul's blocks moves it by that much), 1e-6 below 1."""
    return abs(got.item() - want.item()) <= 4 * torch.finfo(torch.float32).eps * max(1.0, abs(want.item())) + 1e-6


@pytest.mark.parametrize(
    ("case", "tie", "extra"),
    [("text_tieFalse", False, 0), ("text_tieTrue", True, 0), ("text_sp0", False, 0), ("text_sp1", False, 1)],
    ids=["untied", "tied", "sequence_parallel", "sequence_parallel_padded"],
)
def test_text_tp_matches_unsharded(sharded, case, tie, extra):
    ref = reference_text(tie, extra)
    single = ref["labelled"]  # unsharded, whole logits over the supervised rows
    assert loss_close(single["loss"], ref["loss"])
    assert_grads_close(single["grads"], ref["grads"])
    for rank, res in enumerate(sharded):
        got = res[case]
        assert got["logits"].shape == ref["logits"].shape
        assert (got["logits"] - ref["logits"]).abs().max().item() < 1e-5, rank
        assert loss_close(got["loss"], ref["loss"]), rank
        assert got["loss"].dtype == torch.float32
        assert_grads_close(got["grads"], ref["grads"])
        assert (got["embeds_grad"] - ref["embeds_grad"]).abs().max().item() < 1e-6, rank
        assert got["norm_sq"] == pytest.approx(ref["norm_sq"], rel=1e-6), rank
        assert got["grad_layouts"] == [], rank  # embed_tokens' included: Shard(0), this rank's rows only
        lab = got["labelled"]  # lm_head over the supervised rows only: the same loss and gradients
        assert loss_close(lab["loss"], ref["loss"]), rank
        assert_grads_close(lab["grads"], ref["grads"])
        assert (lab["embeds_grad"] - ref["embeds_grad"]).abs().max().item() < 1e-6, rank
        assert lab["grad_layouts"] == [], rank
        if "residual_shape" in got:  # the residual stream really is a sequence shard: ceil(T / tp) tokens
            assert got["residual_shape"] == (1, -(-ref["logits"].shape[1] // TP), text_cfg().text.hidden_size)
            assert got["norm_grad_placements"] == "(Replicate(),)"  # reduced after backward, not left Partial


def test_vision_tp_matches_unsharded(sharded):
    cfg = text_cfg()
    ref = run_vision(build_model(cfg, seed=0).visual, vision_inputs(cfg), tp=1)
    for rank, res in enumerate(sharded):
        got = res["vision"]
        assert (got["out"] - ref["out"]).abs().max().item() < 1e-5, rank
        assert_grads_close(got["grads"], ref["grads"])
        # plain (norms, merger), Replicate DTensors (row-parallel biases) and shards each counted once
        assert got["norm_sq"] == pytest.approx(ref["norm_sq"], rel=1e-6), rank


def _embedding_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    from dhp.models.qwen2_5_vl.parallelize import VocabParallelEmbedding

    mesh = DeviceMesh("cpu", list(range(world_size)))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3)  # 5 rows on 4 ranks: shards of 2, 2, 1 and 0 (empty) rows
    parallelize_module(emb, mesh, VocabParallelEmbedding())
    ids = torch.tensor([[0, 4, 1, 3, 4, 2]])
    out = emb(ids)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    g = emb.weight.grad
    return {"out": out.detach(), "grad": g.full_tensor(), "placements": str(g.placements),
            "local_rows": g.to_local().shape[0]}


def test_vocab_parallel_embedding_uneven_and_empty_shards():
    torch.manual_seed(0)
    ref = torch.nn.Embedding(5, 3)
    ids = torch.tensor([[0, 4, 1, 3, 4, 2]])
    out = ref(ids)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    for rank, res in enumerate(run_distributed(_embedding_worker, 4, timeout_s=120)):
        assert torch.equal(res["out"], out.detach()), rank
        assert torch.allclose(res["grad"], ref.weight.grad), rank
        assert res["placements"] == "(Shard(dim=0),)"
        assert res["local_rows"] == [2, 2, 1, 0][rank]


def test_check_tp_names_the_kv_heads():
    with pytest.raises(ValueError, match=r"text.parallel.tp=4 must divide the key/value heads \(2\)"):
        check_tp(2, 4)
    check_tp(2, 2)
    with pytest.raises(ValueError, match=r"vision.parallel.tp=3 must divide the vision heads \(16\)"):
        check_vision_tp(16, 3)

