"""Qwen3-VL's sharded layouts (gloo, 2 processes, no Ray) against the unsharded single-process modules.

One spawn runs every sharded case and returns gathered outputs and gradients in HF row order; the tests compare
them with the same modules built from the same seed, unsharded:

* text TP 2, whole inputs: the q/k RMSNorm weights are shared by all heads, so with the heads sharded each rank
  holds a part of their gradient (``HeadNormTP`` sums it); DeepStack adds two levels after layers 0 and 1;
* text TP 2 with Megatron SP over an odd length (padded inside): whole DeepStack features (every rank adds its
  shard's rows) and, as the data plane sends them, each rank only its sequence slice's rows with their positions;
* vision TP 2 over the fused qkv (rows re-laid head-wise), fc1/fc2 column/row parallel with biases: the named
  outputs (main merger and both DeepStack mergers, compared side by side as ``[N/4, 3 D]``) and every gradient;
* vision Ulysses SP 2 (an all-to-all in every full-attention block) over an image, a clip and a small image: each
  rank's rows of every named output and the gradients summed over the ranks.

The media cross as the encoder's named outputs (``{"embeds", "deepstack_0", "deepstack_1"}``, each ``[n, D]``);
the checks put them side by side (``side_by_side``) to compare every part at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dhp.data.batch import PackedMeta
from dhp.engine import sequence_slice
from dhp.models.qwen2_5_vl.parallelize import rows_from_rank_order
from dhp.models.qwen2_5_vl.text import text_qkv_sizes
from dhp.models.qwen3_vl import build_model
from dhp.models.qwen3_vl.config import tiny
from dhp.models.qwen3_vl.parallelize import parallelize_text, parallelize_vision_tp
from dhp.models.qwen3_vl.sequence_parallel import parallelize_vision_sp, shard_vision, sp_forward, to_image_order
from dhp.models.qwen3_vl.vision import VisionTransformer
from dhp.parallel.tensor import grad_norm_sq
from tests.dist_utils import run_distributed

TP = 2
IMAGE, VIDEO = 290, 291
GRID = [[1, 8, 12], [2, 4, 4]]  # an image of 24 merged tokens and a clip of 2 x 4: 32 vision tokens


def named(packed: torch.Tensor, cfg) -> dict[str, torch.Tensor]:
    """``[n, (1 + K) D]`` -> the named outputs ``{"embeds": [n, D], "deepstack_i": [n, D]}`` (main first)."""
    names = ("embeds", *(f"deepstack_{i}" for i in range(cfg.deepstack_levels)))
    return dict(zip(names, packed.split(cfg.text.hidden_size, dim=-1), strict=True))


def side_by_side(out: dict[str, torch.Tensor]) -> torch.Tensor:
    """The named outputs ``[n, D]`` each, side by side ``[n, (1 + K) D]`` (main first): one tensor to compare."""
    return torch.cat(list(out.values()), dim=-1)


def cfg_():
    cfg = tiny(vocab_size=301, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=292,
               vision_end_token_id=293)  # vocab 301: uneven vocabulary shards (151 + 150)
    return replace(cfg, vision=replace(cfg.vision, depth=2))  # DeepStack after blocks 0 and 1


def text_inputs(cfg, extra: int) -> dict[str, Any]:
    """Two packed samples in one row: 17 text, 6 image slots, 3 text, 4 video slots, 3 text | 7 + extra text (at
    T = 41 the SP cut at 21 falls inside the image; the video is all on rank 1)."""
    g = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(0, 280, (n,), generator=g).tolist()  # noqa: E731
    first = text(17) + [IMAGE] * 6 + text(3) + [VIDEO] * 4 + text(3)
    ids = torch.tensor([first + text(7 + extra)])
    seq = ids.shape[1]
    second = seq - len(first)
    pos = torch.cat([torch.arange(len(first)), torch.arange(second)]).view(1, 1, seq).expand(3, 1, seq)
    targets = torch.randint(0, cfg.text.vocab_size, (1, seq), generator=g)
    targets[0, :4] = -100
    targets[0, -2] = cfg.text.vocab_size - 1  # the last column, on the last shard
    width = (1 + cfg.deepstack_levels) * cfg.text.hidden_size
    flat = ids.reshape(-1)
    return {"input_ids": ids, "position_ids": pos.contiguous(), "targets": targets,
            "media": {IMAGE: torch.randn(6, width, generator=g), VIDEO: torch.randn(4, width, generator=g)},
            "meta": PackedMeta(cu_seqlens=(0, len(first), seq), label_rows=(targets.reshape(-1) != -100).nonzero()
                               .flatten(), placeholders={t: (flat == t).nonzero().flatten() for t in (IMAGE, VIDEO)})}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def canonical(name: str, p: torch.Tensor, t: torch.Tensor, cfg) -> torch.Tensor:
    """A gathered weight or gradient in HF row order: the fused projections' rows are grouped by TP rank."""
    if not isinstance(p, DTensor):
        return t
    if name.endswith("self_attn.qkv_proj.weight"):
        return rows_from_rank_order(t, text_qkv_sizes(cfg.text), TP)
    if name.endswith("gate_up_proj.weight"):
        return rows_from_rank_order(t, (cfg.text.intermediate_size,) * 2, TP)
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return rows_from_rank_order(t, (cfg.vision.hidden_size,) * 3, TP)
    return t


def grads(model: torch.nn.Module, cfg) -> dict[str, torch.Tensor]:
    return {n: canonical(n, p, full(p.grad), cfg) for n, p in model.named_parameters()}


def run_text(model, x: dict[str, Any], cfg, sliced_rank: int | None = None) -> dict[str, Any]:
    """Summed loss over the supervised rows (the engine's call), its gradients and the media's gradients.

    ``sliced_rank``: give the model only that rank's sequence slice of the media rows, with their positions."""
    leaves = {t: {n: p.clone().requires_grad_() for n, p in named(e, cfg).items()} for t, e in x["media"].items()}
    media: dict[int, Any] = leaves
    if sliced_rank is not None:
        lo, hi = sequence_slice(x["input_ids"].numel(), TP, sliced_rank)
        mine = {t: ((p >= lo) & (p < hi)).nonzero().flatten() for t, p in x["meta"].placeholders.items()}
        media = {t: ({n: leaf[mine[t]] for n, leaf in leaves[t].items()}, x["meta"].placeholders[t][mine[t]])
                 for t in leaves}
    loss = model.loss_sum(x["input_ids"], x["position_ids"], x["targets"], media, meta=x["meta"])
    loss.backward()
    return {"loss": loss.detach(), "grads": grads(model, cfg), "norm_sq": float(grad_norm_sq(model.parameters())),
            "media_grads": {t: side_by_side({n: torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
                                             for n, leaf in parts.items()})  # unused here: zero, as the engine
                            for t, parts in leaves.items()},
            "q_norm_grad_type": type(model.layers[0].self_attn.q_norm.weight.grad).__name__}


def run_vision(model, x: dict[str, torch.Tensor], cfg) -> dict[str, Any]:
    out = side_by_side(model(x["pixel_values"], x["grid_thw"]))
    (out * x["weight"]).sum().backward()
    return {"out": out.detach(), "grads": grads(model, cfg), "norm_sq": float(grad_norm_sq(model.parameters()))}


def vision_inputs(cfg) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    n = sum(t * h * w for t, h, w in GRID)
    return {"pixel_values": torch.randn(n, cfg.vision.patch_dim, generator=g), "grid_thw": torch.tensor(GRID),
            "weight": torch.randn(n // 4, (1 + cfg.deepstack_levels) * cfg.vision.out_hidden_size, generator=g)}


def build(cfg, part: str) -> torch.nn.Module:
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # norm weights and biases away from their init, so a wrong cut of them would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.language if part == "text" else model.visual


CASES = {"tp": (False, 0, False), "sp_whole": (True, 1, False), "sp_sliced": (True, 1, True)}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(123 + rank)  # the plans must not depend on the rank's RNG
    mesh = DeviceMesh("cpu", list(range(world_size)))
    cfg = cfg_()
    results: dict[str, Any] = {}
    for case, (sp, extra, sliced) in CASES.items():
        text = build(cfg, "text")
        parallelize_text(text, mesh, sequence_parallel=sp)
        results[case] = run_text(text, text_inputs(cfg, extra), cfg, rank if sliced else None)
    vision = build(cfg, "vision")
    parallelize_vision_tp(vision, mesh)
    results["vision"] = run_vision(vision, vision_inputs(cfg), cfg)
    results["sp"] = _sp_rank(rank, world_size, _sp_problem())
    return results


@pytest.fixture(scope="module")
def sharded() -> list[dict[str, Any]]:
    return run_distributed(_worker, TP, timeout_s=120)


def assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    assert got.keys() == ref.keys()
    for name, g in got.items():
        r = ref[name]
        assert g.shape == r.shape, name
        assert r.abs().max() > 0, name  # every gradient checked is a real one
        err = (g - r).abs().max().item() / r.abs().max().item()
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_text_tp_matches_unsharded(sharded, case):
    """Loss, every parameter's gradient (q/k norms and lm_head included) and the media's gradients (main and
    DeepStack parts) equal one process's on every rank; under a sequence slice each rank returns its rows'."""
    cfg = cfg_()
    sp, extra, sliced = CASES[case]
    ref = run_text(build(cfg, "text"), text_inputs(cfg, extra), cfg)
    x = text_inputs(cfg, extra)
    for rank, got in enumerate(r[case] for r in sharded):
        assert abs(got["loss"].item() - ref["loss"].item()) < 1e-4 * abs(ref["loss"].item()), rank
        assert_close(got["grads"], ref["grads"])
        assert got["q_norm_grad_type"] == "Tensor"  # a plain, already summed gradient
        assert got["norm_sq"] == pytest.approx(ref["norm_sq"], rel=1e-5), rank
        for t, g in got["media_grads"].items():
            want = ref["media_grads"][t]
            if sliced:  # this rank's slice's rows only; the others are the other rank's
                lo, hi = sequence_slice(x["input_ids"].numel(), TP, rank)
                pos = x["meta"].placeholders[t]
                mine = (pos >= lo) & (pos < hi)
                assert not g[~mine].any()
                g, want = g[mine], want[mine]
            assert torch.allclose(g, want, rtol=0, atol=1e-5), (case, rank, t)
    hidden = cfg.text.hidden_size
    assert ref["media_grads"][IMAGE][:, hidden:].abs().max() > 0  # DeepStack parts get a gradient back


def test_sequence_slice_cuts_the_image_rows():
    """The sliced case is a real one: each rank of the padded 41-token row holds some of the image's rows."""
    x = text_inputs(cfg_(), 1)
    cuts = [sequence_slice(x["input_ids"].numel(), TP, r) for r in range(TP)]
    img = x["meta"].placeholders[IMAGE]
    assert x["input_ids"].numel() % TP == 1
    assert all(0 < ((img >= lo) & (img < hi)).sum() < img.numel() for lo, hi in cuts)


def test_vision_tp_matches_unsharded(sharded):
    """The fused qkv re-laid head-wise, fc1/fc2 with biases: output (DeepStack included) and every gradient."""
    cfg = cfg_()
    ref = run_vision(build(cfg, "vision"), vision_inputs(cfg), cfg)
    for rank, res in enumerate(r["vision"] for r in sharded):
        assert (res["out"] - ref["out"]).abs().max().item() < 1e-5, rank
        assert_close(res["grads"], ref["grads"])
        assert res["norm_sq"] == pytest.approx(ref["norm_sq"], rel=1e-5), rank


# ---- vision Ulysses SP -------------------------------------------------------------------------------------

SP_GRIDS = torch.tensor([[1, 12, 20], [2, 8, 6], [1, 4, 6]])  # an image, a clip of 2 frame pairs, a small image


def _sp_problem(seed: int = 0) -> dict:
    cfg = cfg_().vision
    torch.manual_seed(seed)
    model = VisionTransformer(cfg)
    n = int(SP_GRIDS.prod(-1).sum())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return {"cfg": cfg, "state": model.state_dict(), "pixel_values": torch.randn(n, cfg.patch_dim),
            "weight": torch.randn(n // 4, 3 * cfg.out_hidden_size)}


def _sp_rank(rank: int, world_size: int, p: dict) -> dict:
    model = VisionTransformer(p["cfg"])
    model.load_state_dict(p["state"])
    parallelize_vision_sp(model, None)
    shard = shard_vision(SP_GRIDS, p["cfg"], world_size)[rank]
    out = sp_forward(model, p["pixel_values"], shard, None)
    (side_by_side(out) * p["weight"][shard.merged_index]).sum().backward()
    grads = {n: torch.zeros_like(q) if q.grad is None else q.grad for n, q in model.named_parameters()}
    return {"out": {n: t.detach() for n, t in out.items()}, "grads": grads, "shard": shard}


def test_vision_sp_forward_and_gradients_match_unsharded(sharded):
    """Every block all-to-alls; the merged and DeepStack outputs and every gradient equal one process's."""
    p = _sp_problem()  # the same seed as the ranks': the same weights and inputs
    results = [r["sp"] for r in sharded]
    model = VisionTransformer(p["cfg"])
    model.load_state_dict(p["state"])
    ref = side_by_side(model(p["pixel_values"], SP_GRIDS))
    (ref * p["weight"]).sum().backward()
    sizes = results[0]["shard"].split_sizes
    assert sum(sizes) == SP_GRIDS.prod(-1).sum() and max(sizes) - min(sizes) <= 4
    out = side_by_side(to_image_order([r["out"] for r in results], [r["shard"] for r in results]))
    assert (out - ref.detach()).abs().max() < 1e-5
    for name, q in model.named_parameters():
        summed = sum(r["grads"][name] for r in results)
        assert (summed - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-6) < 1e-5, name
