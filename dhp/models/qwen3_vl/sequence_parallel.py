"""Ulysses sequence parallelism over Qwen3-VL's full-attention vision encoder: where to cut its sequence.

Every rank of an SP group holds all weights and a contiguous slice of the replica's packed patches (image
order). Unlike Qwen2.5-VL, every block attends over a whole frame, so every block all-to-alls
(``UlyssesAttention``: sequence-sharded q/k/v to head-sharded, attention over the frames, and back); the rest
(patch embedding, the position table, the norms and MLPs, the merger and the DeepStack mergers) is local,
because a cut at a merge-unit boundary (4 patches) keeps every merged token on one rank. With no windows to
respect, the cuts balance the patches exactly to within one merge unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhp.models.qwen3_vl.config import VisionConfig
from dhp.models.qwen3_vl.vision import VisionLayout, VisionTransformer, vision_layout
from dhp.parallel.ulysses import UlyssesAttention, UlyssesSegments, check_sp


@dataclass(frozen=True)
class VisionShard:
    """One SP rank's contiguous slice ``[start, end)`` of a replica's patch sequence (image order)."""

    rank: int
    start: int
    end: int
    layout: VisionLayout  # the slice's rows of the layout; cu_seqlens stays the GLOBAL frame boundaries
    split_sizes: list[int]  # patches of every rank (for the all-to-alls)
    merge_unit: int

    @property
    def patch_rows(self) -> torch.Tensor:
        return torch.arange(self.start, self.end)

    @property
    def merged_index(self) -> torch.Tensor:
        """The image-order merged-token index of each of this rank's output rows."""
        return torch.arange(self.start // self.merge_unit, self.end // self.merge_unit)


def shard_vision(grid_thw: torch.Tensor, cfg: VisionConfig, sp: int) -> list[VisionShard]:
    """Cut the batch of images ``grid_thw`` into ``sp`` contiguous slices of whole merge units, as equal as
    those allow (a rank may get none: a batch smaller than ``sp`` merge units)."""
    if sp < 1:
        raise ValueError(f"sp must be >= 1, got {sp}")
    layout = vision_layout(grid_thw, cfg)
    unit = cfg.merge_unit
    units = int(layout.cu_seqlens[-1]) // unit
    cuts = [unit * (k * units // sp) for k in range(sp + 1)]
    sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return [VisionShard(r, a, b, VisionLayout(layout.cu_seqlens, layout.rotary_pos[a:b], layout.interp_index[a:b],
                                              layout.interp_weight[a:b]), sizes, unit)
            for r, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))]


def to_image_order(pieces: list[dict[str, torch.Tensor]], shards: list[VisionShard]) -> dict[str, torch.Tensor]:
    """Every rank's named rows ``{name: [S_r/4, D]}`` back into the replica's order ``{name: [N/4, D]}`` (the
    slices are in order)."""
    ordered = [p for p, _ in sorted(zip(pieces, shards, strict=True), key=lambda ps: ps[1].rank)]
    return {name: torch.cat([p[name] for p in ordered]) for name in ordered[0]}


def parallelize_vision_sp(model: VisionTransformer, group: dist.ProcessGroup | None) -> None:
    """Ulysses attention in every block (all are full attention)."""
    check_sp(model.cfg.num_heads, dist.get_world_size(group))
    for block in model.blocks:
        block.attn.attend = UlyssesAttention(group)  # an instance attribute shadows the method


def sp_forward(model: VisionTransformer, pixel_values: torch.Tensor, shard: VisionShard,
               group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """This rank's slice through the encoder -> named ``{name: [S_local/4, D]}`` (rows: ``merged_index``).
    ``pixel_values`` are the replica's packed patches [N, patch_dim]; only this rank's rows are embedded."""
    if not all(isinstance(b.attn.__dict__.get("attend"), UlyssesAttention) for b in model.blocks):
        raise RuntimeError("sp_forward needs parallelize_vision_sp(model, group) first")
    if len(shard.split_sizes) != dist.get_world_size(group):
        raise ValueError(f"shard cut for {len(shard.split_sizes)} ranks, SP group has {dist.get_world_size(group)}")
    segments = UlyssesSegments(shard.layout.cu_seqlens, shard.split_sizes)
    return model.encode_rows(pixel_values, shard.patch_rows, shard.layout, segments)
