"""Ulysses sequence parallelism of the vision encoder equals the unsharded encoder (gloo, 2 and 4 ranks).

The packed batch mixes a large image with border-padded windows, a two-frame clip (two full-attention
segments), a tiny image (one 2x3 window) and a medium one, so slices are uneven, some full-attention
segments span ranks and some do not. A lone tiny image under sp=4 leaves three ranks empty.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dhp.models.qwen2_5_vl.config import VisionConfig, tiny
from dhp.models.qwen2_5_vl.sequence_parallel import parallelize_vision_sp, shard_vision, sp_forward, to_image_order
from dhp.models.qwen2_5_vl.vision import VisionTransformer, vision_layout
from dhp.parallel.comm import CommCounter
from dhp.parallel.ulysses import UlyssesAttention, check_sp, expected_alltoall_bytes
from tests.dist_utils import run_distributed

MIXED = torch.tensor([[1, 20, 28], [2, 8, 8], [1, 4, 6], [1, 12, 16]])  # 560 + 128 + 24 + 192 = 904 patches
LONE_TINY = torch.tensor([[1, 4, 6]])  # one window of 6 merged tokens = 24 patches


def _problem(cfg: VisionConfig, grid_thw: torch.Tensor, seed: int = 0) -> dict:
    """Weights, pixels and a loss weight (so every output token gets its own gradient)."""
    torch.manual_seed(seed)
    model = VisionTransformer(cfg)
    n = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
    return {
        "cfg": cfg,
        "state": model.state_dict(),
        "pixel_values": torch.randn(n, cfg.patch_dim),
        "grid_thw": grid_thw,
        "weight": torch.randn(n // cfg.merge_unit, cfg.out_hidden_size),
    }


def _reference(p: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = VisionTransformer(p["cfg"])
    model.load_state_dict(p["state"])
    out = model(p["pixel_values"], p["grid_thw"])  # [N/4, D] image order
    (out * p["weight"]).sum().backward()
    return out.detach(), {n: q.grad for n, q in model.named_parameters()}


def _sp_worker(rank: int, world_size: int, p: dict) -> dict:
    model = VisionTransformer(p["cfg"])
    model.load_state_dict(p["state"])
    parallelize_vision_sp(model, None)
    shard = shard_vision(vision_layout(p["grid_thw"], p["cfg"]), world_size)[rank]
    comm = CommCounter()
    with comm:
        out = sp_forward(model, p["pixel_values"], shard, None)  # [S_local/4, D] window order
    fwd = (dict(comm.sent), dict(comm.bytes), dict(comm.calls))
    with comm:
        (out * p["weight"][shard.merged_index]).sum().backward()
    grads = {n: torch.zeros_like(q) if q.grad is None else q.grad for n, q in model.named_parameters()}
    return {"out": out.detach(), "grads": grads, "shard": shard,
            "fwd": fwd, "all": (dict(comm.sent), dict(comm.bytes), dict(comm.calls))}


def _run(p: dict, sp: int) -> list[dict]:
    return run_distributed(_sp_worker, sp, p)


def _assert_matches(p: dict, results: list[dict]) -> None:
    ref_out, ref_grads = _reference(p)
    out = to_image_order([r["out"] for r in results], [r["shard"] for r in results])
    assert out.shape == ref_out.shape
    assert (out - ref_out).abs().max() < 1e-5
    for name, ref in ref_grads.items():
        summed = sum(r["grads"][name] for r in results)
        err = (summed - ref).abs().max() / ref.abs().max().clamp_min(1e-6)
        assert err < 1e-5, f"gradient of {name} differs (relative {err:.2e})"


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "sp4"])
def mixed_run(request) -> tuple[dict, list[dict]]:
    p = _problem(tiny().vision, MIXED)
    return p, _run(p, request.param)


# ---- the encoder ----------------------------------------------------------------------------


def test_sp_forward_and_gradients_match_unsharded(mixed_run):
    p, results = mixed_run
    sizes = results[0]["shard"].split_sizes
    assert len([s for s in sizes if s]) == len(sizes)  # every rank has work in the mixed batch
    _assert_matches(p, results)


def test_lone_tiny_image_leaves_ranks_empty_and_matches():
    p = _problem(tiny().vision, LONE_TINY, seed=1)
    results = _run(p, 4)
    sizes = results[0]["shard"].split_sizes
    assert sorted(sizes) == [0, 0, 0, 24]
    for r in results:
        assert r["out"].shape == (r["shard"].num_patches // 4, p["cfg"].out_hidden_size)
    _assert_matches(p, results)


# ---- communication ----------------------------------------------------------------------------


def test_comm_counter_equals_closed_form(mixed_run):
    """``CommCounter.sent`` (bytes to OTHER ranks, the all-to-all's own chunk left out) is the closed form; the
    payload ``bytes`` also counts the chunks a rank keeps: its own head chunk of q, k, v (3 S_r rows) and its own
    tokens of the output (S_r rows), per full-attention block and pass."""
    p, results = mixed_run
    cfg = p["cfg"]
    n_full = len(cfg.fullatt_block_indexes)
    for rank, r in enumerate(results):
        sizes = r["shard"].split_sizes
        sp, s_r = len(sizes), sizes[rank]
        fwd = expected_alltoall_bytes(sizes, rank, cfg.num_heads, cfg.head_dim, 4, n_full, backward=False)
        both = expected_alltoall_bytes(sizes, rank, cfg.num_heads, cfg.head_dim, 4, n_full, backward=True)
        assert 0 < fwd < both
        kept = n_full * (3 * s_r + s_r) * cfg.num_heads // sp * cfg.head_dim * 4  # own head chunk, own tokens
        sent, payload, calls = r["fwd"]
        assert sent == {"all_to_all": fwd}
        assert payload == {"all_to_all": fwd + kept}
        assert calls == {"all_to_all": 2 * n_full}  # q, k, v stacked in one, the output in another
        sent, payload, calls = r["all"]
        assert sent == {"all_to_all": both}
        assert payload == {"all_to_all": both + 2 * kept}
        assert calls == {"all_to_all": 4 * n_full}


def test_closed_form_by_hand():
    # sp=2, S_0=3, S_1=5, H/sp*hd*4 bytes = 16 bytes a row: forward 3*3 + 5 rows, backward 3*5 + 3 rows
    assert expected_alltoall_bytes([3, 5], 0, 4, 2, 4, 1, backward=False) == 14 * 16
    assert expected_alltoall_bytes([3, 5], 0, 4, 2, 4, 1, backward=True) == 32 * 16
    assert expected_alltoall_bytes([3, 5], 1, 4, 2, 4, 2, backward=False) == 2 * (3 * 5 + 3) * 16


def test_window_blocks_communicate_nothing():
    p = _problem(replace(tiny().vision, fullatt_block_indexes=()), MIXED, seed=2)
    results = _run(p, 2)
    for r in results:
        assert r["all"] == ({}, {}, {})
    _assert_matches(p, results)


# ---- sharding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_shards_are_contiguous_window_aligned_and_cover_everything(sp):
    cfg = tiny().vision
    layout = vision_layout(MIXED, cfg)
    bounds = layout.cu_window_seqlens.tolist()
    shards = shard_vision(layout, sp)
    n = bounds[-1]
    assert [s.num_patches for s in shards] == shards[0].split_sizes
    assert sum(shards[0].split_sizes) == n
    offset = 0
    for s in shards:
        assert s.offset == offset and offset in bounds  # contiguous, cut at a window boundary
        offset += s.num_patches
        sl = slice(s.offset, s.offset + s.num_patches)
        assert torch.equal(s.rotary_pos, layout.rotary_pos[sl])
        assert torch.equal(s.merged_index, layout.window_index[s.offset // 4 : (s.offset + s.num_patches) // 4])
        assert torch.equal(s.patch_rows.view(-1, 4) // 4, s.merged_index[:, None].expand(-1, 4))
        local = (s.cu_window + s.offset).tolist()
        assert local == [b for b in bounds if s.offset <= b <= s.offset + s.num_patches]
        assert torch.equal(s.cu_full, layout.cu_seqlens)
    rows = torch.cat([s.patch_rows for s in shards])
    assert torch.equal(rows.sort().values, torch.arange(n))  # every patch exactly once
    max_window = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    assert max(abs(s.num_patches - n / sp) for s in shards) <= max_window


def test_equal_windows_balance_exactly():
    layout = vision_layout(torch.tensor([[1, 16, 16], [1, 16, 16]]), tiny().vision)  # 8 windows of 64 patches
    assert shard_vision(layout, 4)[0].split_sizes == [128, 128, 128, 128]
    assert shard_vision(layout, 3)[0].split_sizes == [192, 128, 192]  # cuts nearest 170.7 and 341.3


def test_ulysses_attention_needs_the_batch_split():
    with pytest.raises(RuntimeError, match="without UlyssesSegments"):
        UlyssesAttention(None)(*torch.zeros(3, 4, 2, 8), None)


def test_sp_must_divide_heads():
    check_sp(4, 2)
    with pytest.raises(ValueError, match=r"parallel.sp=3 must divide the attention heads .*\(4\)"):
        check_sp(4, 3)
    with pytest.raises(ValueError, match=">= 1"):
        check_sp(4, 0)


# FSDP2 over dp x sp: 2 replicas of 2 SP ranks, 3 micro-batches pipelined (forward all, then backward all),
# with single-window images that leave one rank of a replica without tokens. That rank's window blocks
# attend nothing; its qkv still needs a (zero) gradient, or FSDP2 reduce-scatters fewer parameters there
# than on its peers: a collective of another size, which gloo answers with an abort.
PIPELINE = [
    [torch.tensor([[1, 8, 8]]), torch.tensor([[1, 12, 20], [1, 4, 4]]), torch.tensor([[1, 4, 4]])],
    [torch.tensor([[1, 4, 8]]), torch.tensor([[1, 8, 8]]), torch.tensor([[1, 16, 8]])],
]


def _pipeline_pixels(replica: int, mb: int, grid: torch.Tensor, patch_dim: int) -> torch.Tensor:
    return torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=torch.Generator().manual_seed(10 * replica + mb))


def _fsdp_sp_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from dhp.parallel.sharding import apply_fsdp
    from tests.unit.test_tensor_parallel import full

    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica, sp_group = rank // 2, sp_groups[rank // 2]
    cfg = tiny().vision
    torch.manual_seed(0)
    model = VisionTransformer(cfg)
    parallelize_vision_sp(model, sp_group)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=torch.arange(4), mesh_dim_names=("dp",))
    apply_fsdp(model, mesh, [model.patch_embed, *model.blocks, model.merger], forward_methods=("encode_rows",))
    outs, empty = [], []
    for mb, grid in enumerate(PIPELINE[replica]):
        shard = shard_vision(vision_layout(grid, cfg), 2)[rank % 2]
        empty.append(shard.num_patches == 0)
        outs.append(sp_forward(model, _pipeline_pixels(replica, mb, grid, cfg.patch_dim), shard, sp_group))
    for out in outs:
        out.square().sum().backward()  # a sum over tokens: the window order of the rows does not matter
    return {"grads": {n: full(p.grad) for n, p in model.named_parameters()}, "empty": empty}


def test_fsdp_over_dp_x_sp_with_empty_ranks_matches_unsharded():
    results = run_distributed(_fsdp_sp_worker, 4, timeout_s=120)
    assert any(any(r["empty"]) for r in results)  # the case is exercised
    cfg = tiny().vision
    torch.manual_seed(0)
    ref = VisionTransformer(cfg)
    for replica, grids in enumerate(PIPELINE):
        for mb, grid in enumerate(grids):
            ref(_pipeline_pixels(replica, mb, grid, cfg.patch_dim), grid).square().sum().backward()
    for r in results:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
