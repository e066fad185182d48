"""Ulysses sequence parallelism applied to the Qwen2.5-VL vision encoder: where to cut its sequence.

The generic all-to-all attention lives in ``dhp.parallel.ulysses``; what is
Qwen-specific is the sequence itself. Every rank of an SP group holds all
weights and a contiguous slice of the *window-ordered* patch sequence of the
replica's packed images.

Why cut at window boundaries: most blocks attend only inside windows of 4x4
merged tokens (64 patches). A slice that never splits a window runs those
blocks, the MLPs, the norms and the merger locally with no communication at
all; so does the merger, since a window holds whole 2x2 merge units. Only the
full-attention blocks need the whole sequence: they get ``UlyssesAttention``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhp.models.qwen2_5_vl.vision import VisionLayout, VisionTransformer
from dhp.parallel.ulysses import UlyssesAttention, UlyssesSegments, check_sp


@dataclass(frozen=True)
class VisionShard:
    """One SP rank's contiguous slice of a replica's window-ordered patch sequence."""

    rank: int
    offset: int  # first patch of the slice in the replica's window order
    num_patches: int  # S_local, a multiple of merge_unit (may be 0)
    patch_rows: torch.Tensor  # [S_local] row of each local patch (window order) in the packed pixel_values
    rotary_pos: torch.Tensor  # [S_local, 2] (h, w) of each local patch
    cu_window: torch.Tensor  # [n_local_windows + 1] local window boundaries, from 0 to S_local
    merged_index: torch.Tensor  # [S_local/4] image-order merged-token index of each local merged token
    cu_full: torch.Tensor  # [n_frames + 1] GLOBAL image/frame boundaries (for full attention)
    split_sizes: list[int]  # [sp] patches of every rank (for the all-to-alls)



def _cut_points(bounds: list[int], sp: int) -> list[int]:
    """Greedy balance: each cut at the window boundary nearest to k * S / sp (never splitting a window).

    Targets grow with k and the nearest boundary grows with the target, so the cuts are monotone and
    every chunk is within one window of S / sp.
    """
    total = bounds[-1]
    cuts = [0]
    for k in range(1, sp):
        target = k * total / sp
        i = bisect.bisect_left(bounds, target)
        lo, hi = bounds[max(i - 1, 0)], bounds[min(i, len(bounds) - 1)]
        cut = lo if target - lo <= hi - target else hi
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    return cuts


def shard_vision(layout: VisionLayout, sp_size: int, merge_unit: int = 4) -> list[VisionShard]:
    """Cut the window-ordered sequence into ``sp_size`` contiguous slices at window boundaries."""
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    bounds = layout.cu_window_seqlens.tolist()
    cuts = _cut_points(bounds, sp_size)
    split_sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return [
        _shard(layout, rank, cuts[rank], cuts[rank + 1], bounds, split_sizes, merge_unit) for rank in range(sp_size)
    ]


def _shard(
    layout: VisionLayout, rank: int, start: int, end: int, bounds: list[int], split_sizes: list[int], unit: int
) -> VisionShard:
    merged = layout.window_index[start // unit : end // unit]  # [S_local/4] image-order merged units
    patch_rows = (merged[:, None] * unit + torch.arange(unit)).reshape(-1)  # [S_local] 4 patches per unit
    local_bounds = [b - start for b in bounds if start <= b <= end]
    return VisionShard(
        rank=rank,
        offset=start,
        num_patches=end - start,
        patch_rows=patch_rows,
        rotary_pos=layout.rotary_pos[start:end],
        cu_window=torch.tensor(local_bounds, dtype=torch.long),
        merged_index=merged.clone(),
        cu_full=layout.cu_seqlens,
        split_sizes=list(split_sizes),
    )


def to_image_order(pieces: list[torch.Tensor], shards: list[VisionShard]) -> torch.Tensor:
    """Reassemble every rank's merged tokens ``[S_r/4, D]`` into the replica's image order ``[N/4, D]``."""
    index = torch.cat([s.merged_index for s in shards]).to(pieces[0].device)
    out = pieces[0].new_empty(len(index), pieces[0].shape[-1])
    out[index] = torch.cat(pieces)
    return out




def parallelize_vision_sp(model: VisionTransformer, group: dist.ProcessGroup | None) -> None:
    """Install Ulysses attention on the full-attention blocks; window blocks keep local attention."""
    check_sp(model.cfg.num_heads, dist.get_world_size(group))
    for block in model.blocks:
        if block.full_attention:
            block.attn.attend = UlyssesAttention(group)  # instance attribute shadows the method


def sp_forward(
    model: VisionTransformer, pixel_values: torch.Tensor, shard: VisionShard, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's slice through the encoder: -> [S_local/4, D] merged tokens, window order.

    Row i belongs to image-order merged token ``shard.merged_index[i]``. ``pixel_values`` are the replica's
    packed patches [N, patch_dim] (image order); only this rank's rows are embedded.
    """
    full = [b for b in model.blocks if b.full_attention]
    if full and not all(isinstance(b.attn.__dict__.get("attend"), UlyssesAttention) for b in full):
        raise RuntimeError("sp_forward needs parallelize_vision_sp(model, group) first")
    if len(shard.split_sizes) != dist.get_world_size(group):
        raise ValueError(f"shard cut for {len(shard.split_sizes)} ranks, SP group has {dist.get_world_size(group)}")
    segments = UlyssesSegments(shard.cu_full, shard.split_sizes)
    # [S_local/4, D], window order
    return model.encode_rows(pixel_values, shard.patch_rows, shard.rotary_pos, shard.cu_window, segments)
