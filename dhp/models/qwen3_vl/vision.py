"""The Qwen3-VL vision encoder, top to bottom.

pixel_values [N, C*T*P*P] (N patches of all images/frames, each in 2x2 merge-block order, P = 16)
  -> patch_embed (Conv3d with bias, as one linear map)          [N, C_v]
  -> + learned position embeddings, a square table resampled bilinearly (align_corners) to each grid
  -> blocks x depth: LayerNorm, full attention within each frame (2D rotary on q/k), LayerNorm, GELU-tanh MLP
       after block ``deepstack_visual_indexes[i]``: DeepStack merger i (LayerNorm over the 2x2 group) -> feature i
  -> merger (LayerNorm, 2x2 -> 1, MLP)                          [N/4, D_text]

Why no window permutation (unlike Qwen2.5-VL): every block attends over a whole image or frame, so tokens stay in
image order and the only segments are frames. ``forward`` returns the named outputs ``{"embeds": main [N/4, D],
"deepstack_0": feature 0 [N/4, D], ...}`` (``output_names``): the family declares the same names as its vision
encoder's ``outputs`` and its language model's ``inputs``, so the router moves each as its own tensor and brings
the gradient of each back by name (``docs/families.md``).

The patch embedding (with a bias here), the 2D rotary and the attention are Qwen2.5-VL's classes, reused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dhp.models.qwen2_5_vl.vision import PatchEmbed as Qwen25PatchEmbed
from dhp.models.qwen2_5_vl.vision import VisionAttention, VisionRotary, reset_rotary_buffers
from dhp.models.qwen3_vl.config import VisionConfig
from dhp.models.spec import EMBEDS
from dhp.ops.attention import Segments, host_metadata
from dhp.parallel.ulysses import UlyssesSegments


@dataclass(frozen=True)
class VisionLayout:
    """Host metadata of a packed batch of images/frames, all derived from grid_thw."""

    cu_seqlens: torch.Tensor  # [n_frames + 1] patch boundaries of frames
    rotary_pos: torch.Tensor  # [N, 2] (h, w) patch coordinates, merge-block order
    interp_index: torch.Tensor  # [N, 4] rows of the position table each patch interpolates
    interp_weight: torch.Tensor  # [N, 4] their bilinear weights (float32)


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch [N, 2], patches of each frame in merge-block order, frames repeated."""
    out = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        wpos = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pos = torch.stack([hpos.transpose(1, 2).reshape(-1), wpos.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1) into a table of ``side`` and their weights, align_corners=True."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def vision_layout(grid_thw: torch.Tensor, cfg: VisionConfig) -> VisionLayout:
    """Frame boundaries, rotary coordinates and position-table interpolation of images ``grid_thw [I, 3]``."""
    pos = patch_coordinates(grid_thw, cfg.spatial_merge_size)
    counts = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).long()
    heights = torch.repeat_interleave(grid_thw[:, 1].long(), counts)
    widths = torch.repeat_interleave(grid_thw[:, 2].long(), counts)
    side = cfg.grid_per_side
    h_taps, h_w = _axis_taps(pos[:, 0], heights, side)
    w_taps, w_w = _axis_taps(pos[:, 1], widths, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).long()
    return VisionLayout(F.pad(frames.cumsum(0), (1, 0)), pos, index, weight)


class PatchEmbed(Qwen25PatchEmbed):
    """Qwen2.5-VL's patch embedding (one linear map of each (T=2, P, P) patch) with a bias."""

    bias = True


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, segments: Any, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, 2x2 neighbouring patches concatenated, an MLP to the LLM width. The DeepStack mergers take
    the norm after the concatenation (``postshuffle``: over 4 * C_v), the final merger before it."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.in_dim = cfg.hidden_size * cfg.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.in_dim if postshuffle else cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.in_dim, self.in_dim)
        self.linear_fc2 = nn.Linear(self.in_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C_v] -> [N/4, D_text]
        rows = x.shape[0] // (self.in_dim // x.shape[-1])
        x = self.norm(x.reshape(rows, self.in_dim)) if self.postshuffle else self.norm(x).reshape(rows, self.in_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def deepstack_names(levels: int) -> tuple[str, ...]:
    """The names of the K DeepStack features among the vision outputs: ``deepstack_0`` ... (level i: the merger
    after block ``deepstack_visual_indexes[i]``, added after decoder layer i)."""
    return tuple(f"deepstack_{i}" for i in range(levels))


def output_names(cfg: VisionConfig) -> tuple[str, ...]:
    """The vision encoder's named outputs: the merged embeddings, then the DeepStack features."""
    return (EMBEDS, *deepstack_names(len(cfg.deepstack_visual_indexes)))


class VisionTransformer(nn.Module):
    """Patches -> ``{name: [N/4, D]}``: the merged embeddings, then the K DeepStack features (``output_names``)."""

    attention_kernel: str = "auto"  # packed_attention's kernel (train.attention)

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary = VisionRotary(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixel_values [N, patch_dim], grid_thw [I, 3] -> {name: [N/4, out_hidden_size]}, image order."""
        with host_metadata():
            layout = vision_layout(grid_thw.cpu().long(), self.cfg)
        return self.encode(pixel_values, layout)

    def encode_rows(self, pixel_values: torch.Tensor, rows: torch.Tensor, layout: VisionLayout,
                    segments: UlyssesSegments) -> dict[str, torch.Tensor]:
        """A sequence-parallel rank's slice: ``pixel_values[rows]`` (whole merge units, image order) with its
        ``layout`` rows and the batch's ``UlyssesSegments`` -> ``{name: [len(rows)/4, D]}``. One entry point
        (FSDP registers it as a forward method)."""
        return self.encode(pixel_values[rows.to(pixel_values.device)], layout, segments)

    def encode(self, pixel_values: torch.Tensor, layout: VisionLayout,
               segments: UlyssesSegments | None = None) -> dict[str, torch.Tensor]:
        """Patches [S, patch_dim] with their layout rows -> ``{name: [S/4, D]}`` (``output_names``); ``segments``:
        the whole batch's frames and every rank's share (sequence parallel), else ``layout.cu_seqlens``."""
        x = self.patch_embed(pixel_values)  # [S, C_v]
        dev = x.device
        table = self.pos_embed(layout.interp_index.to(dev))  # [N, 4, C_v]
        pos = (table * layout.interp_weight.to(dev, table.dtype)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        rope = self.rotary(layout.rotary_pos.to(dev))
        if segments is None:
            segments = Segments.of(layout.cu_seqlens, self.attention_kernel)
        else:
            segments = dataclasses.replace(segments, cu_seqlens=Segments.of(segments.cu_seqlens,
                                                                             self.attention_kernel))
        levels = {i: n for n, i in enumerate(self.cfg.deepstack_visual_indexes)}
        features: list[torch.Tensor] = [torch.empty(0)] * len(levels)
        for i, block in enumerate(self.blocks):
            x = block(x, segments, rope)
            if i in levels:
                features[levels[i]] = self.deepstack_merger_list[levels[i]](x)
        return dict(zip(output_names(self.cfg), [self.merger(x), *features], strict=True))


__all__ = ["PatchEmbed", "PatchMerger", "VisionAttention", "VisionBlock", "VisionLayout", "VisionRotary",
           "VisionTransformer", "deepstack_names", "output_names", "reset_rotary_buffers", "vision_layout"]
