"""The Qwen2.5-VL vision encoder, top to bottom.

pixel_values [N, C*T*P*P] (N patches of all images, each image in 2x2 merge order)
  -> patch_embed            [N, C_v]
  -> reorder by window      [N, C_v]     (windows of 4x4 merged tokens contiguous)
  -> blocks x depth         [N, C_v]     (window attention, or per-image attention in
                                          ``fullatt_block_indexes``), 2D rotary on q/k
  -> merger (2x2 -> 1)      [N/4, D_text]
  -> undo window order      [N/4, D_text] (image order again, as the LLM expects)

The layout of a batch (window permutation, segment boundaries, rotary positions)
depends only on ``grid_thw`` and is computed once by ``vision_layout``; the
sequence-parallel runtime cuts this same layout at window boundaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dhp.models.layers import RMSNorm, SwiGLU, apply_rotary
from dhp.models.qwen2_5_vl.config import VisionConfig
from dhp.ops.attention import Segments, host_metadata, packed_attention
from dhp.parallel.ulysses import UlyssesSegments


@dataclass(frozen=True)
class VisionLayout:
    """Where each token of a packed batch of images goes (all derived from grid_thw)."""

    window_index: torch.Tensor  # [N/4] merged-unit permutation: window order -> image order index
    cu_window_seqlens: torch.Tensor  # [n_windows + 1] patch boundaries of windows (window order)
    cu_seqlens: torch.Tensor  # [n_frames + 1] patch boundaries of images/frames (same in both orders)
    rotary_pos: torch.Tensor  # [N, 2] (h, w) patch coordinates, in window order


def vision_layout(grid_thw: torch.Tensor, cfg: VisionConfig) -> VisionLayout:
    """Window permutation and segment boundaries for images of shapes ``grid_thw [I, 3]`` (t, h, w patches)."""
    m, win, unit = cfg.spatial_merge_size, cfg.window_merged, cfg.merge_unit
    window_index: list[torch.Tensor] = []
    window_sizes: list[int] = []  # merged tokens per window, window order
    positions: list[torch.Tensor] = []
    offset = 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m  # merged grid
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        nwh, nww = -(-gh // win), -(-gw // win)
        padded = F.pad(index, (0, nww * win - gw, 0, nwh * win - gh), value=-1)
        windows = padded.view(t, nwh, win, nww, win).permute(0, 1, 3, 2, 4).reshape(t * nwh * nww, win * win)
        for row in windows:
            kept = row[row >= 0]
            if len(kept):
                window_index.append(kept + offset)
                window_sizes.append(len(kept))
        offset += t * gh * gw
        # (h, w) coordinates of each patch, patches grouped by 2x2 merge unit
        hpos = torch.arange(h).view(gh, m, 1, 1).expand(gh, m, gw, m).permute(0, 2, 1, 3).reshape(-1)
        wpos = torch.arange(w).view(1, 1, gw, m).expand(gh, m, gw, m).permute(0, 2, 1, 3).reshape(-1)
        positions.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    widx = torch.cat(window_index) if window_index else torch.zeros(0, dtype=torch.long)
    pos = torch.cat(positions) if positions else torch.zeros(0, 2, dtype=torch.long)
    pos = pos.view(-1, unit, 2)[widx].view(-1, 2)
    cu_win = F.pad(torch.tensor(window_sizes, dtype=torch.long).cumsum(0) * unit, (1, 0))
    frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).long()
    cu = F.pad(frames.cumsum(0), (1, 0))
    return VisionLayout(widx, cu_win, cu, pos)


class PatchEmbed(nn.Module):
    """Conv3d over (T=2, P, P) patches with stride = kernel, i.e. one linear map of each flattened patch (no bias
    here; a subclass sets ``bias``: Qwen3-VL's has one)."""

    bias: bool = False

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=self.bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C*T*P*P] -> [N, C_v]
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class VisionRotary(nn.Module):
    """2D rotary: half of each head's rotary frequencies follow the row, half the column."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.quarter, self.theta = cfg.head_dim // 2, cfg.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.quarter, 2, dtype=torch.float) / self.quarter))

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (after ``to_empty``): on the CPU, as at construction, then copied in."""
        with torch.device("cpu"):
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, 2] -> 2 x [N, head_dim]
        freqs = (pos[..., None].float() * self.inv_freq.float()).flatten(1)  # [N, head_dim/2]: h | w
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        seq = x.shape[0]
        qkv = self.qkv(x)  # [S, 3 * H * hd]; H are the local heads under tensor parallelism
        heads = qkv.shape[-1] // (3 * self.head_dim)  # explicit, so an empty slice (S = 0) works too
        q, k, v = qkv.view(seq, 3, heads, self.head_dim).unbind(1)  # 3 x [S, H, hd]
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.attend(q, k, v, cu_seqlens)  # [S, H, hd]
        return self.proj(out.reshape(seq, heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Non-causal attention within segments; the sequence-parallel plan replaces this method."""
        return packed_attention(q, k, v, cu_seqlens, causal=False)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, full_attention: bool) -> None:
        super().__init__()
        self.full_attention = full_attention
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then 2x2 neighbouring patches concatenated and mapped to the LLM width by an MLP."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.unit = cfg.merge_unit
        self.in_dim = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.in_dim, self.in_dim), nn.GELU(), nn.Linear(self.in_dim, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C_v] -> [N/4, D_text]
        return self.mlp(self.ln_q(x).view(x.shape[0] // self.unit, self.in_dim))  # explicit: S may be 0


class VisionTransformer(nn.Module):
    attention_kernel: str = "auto"  # packed_attention's kernel (train.attention)

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.rotary = VisionRotary(cfg)
        full = set(cfg.fullatt_block_indexes)
        self.blocks = nn.ModuleList(VisionBlock(cfg, i in full) for i in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, patch_dim], grid_thw [I, 3] -> image embeddings [N/4, out_hidden_size], image order."""
        with host_metadata():
            layout = vision_layout(grid_thw.cpu(), self.cfg)
            order = torch.argsort(layout.window_index)
        x = self.forward_windowed(pixel_values, layout)
        return x[order.to(x.device)]

    def forward_windowed(self, pixel_values: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        """The encoder in window order: returns merged tokens [N/4, D] in window order."""
        unit = self.cfg.merge_unit
        x = self.patch_embed(pixel_values)  # [N, C_v]
        widx = layout.window_index.to(x.device)
        x = x.view(-1, unit, x.shape[-1])[widx].view(-1, x.shape[-1])  # window order
        return self.encode(x, layout.rotary_pos.to(x.device), layout.cu_window_seqlens, layout.cu_seqlens)

    def encode_rows(self, pixel_values: torch.Tensor, rows: torch.Tensor, rotary_pos: torch.Tensor,
                    cu_window: torch.Tensor, cu_full: torch.Tensor) -> torch.Tensor:
        """Patch-embed ``pixel_values[rows]`` (a window-ordered slice) and encode it: [len(rows)/4, D].

        One entry point for a sequence-parallel rank's slice (FSDP registers it as a forward method)."""
        x = self.patch_embed(pixel_values[rows.to(pixel_values.device)])  # [S_local, C_v]
        return self.encode(x, rotary_pos.to(x.device), cu_window, cu_full)

    def encode(
        self, x: torch.Tensor, rotary_pos: torch.Tensor, cu_window: torch.Tensor, cu_full: torch.Tensor
    ) -> torch.Tensor:
        """Blocks and merger over window-ordered tokens x [S, C_v] (S a multiple of 4) -> [S/4, D].

        ``cu_window``/``cu_full``: host boundaries (tensors, ``Segments``, or ``UlyssesSegments`` for the
        full-attention blocks of a sequence-parallel rank), made ``Segments`` once here for every block."""
        rope = self.rotary(rotary_pos)
        window, full = (self._segments(cu) for cu in (cu_window, cu_full))
        for block in self.blocks:
            x = block(x, full if block.full_attention else window, rope)
        return self.merger(x)

    def _segments(self, cu: Any) -> Any:
        if isinstance(cu, UlyssesSegments):
            return dataclasses.replace(cu, cu_seqlens=Segments.of(cu.cu_seqlens, self.attention_kernel))
        return Segments.of(cu, self.attention_kernel)


def init_rule(name: str, param: torch.Tensor, std: float = 0.02) -> tuple:
    """How ``dhp.parallel.materialize.init_by_name`` initialises a Qwen2.5-VL parameter (as ``init_weights``
    does, and as HF initialises): Normal(0, std) for linear/conv/embedding weights, zero biases, unit norm
    weights (the only 1-D weights)."""
    if name.endswith("bias"):
        return ("zeros",)
    if param.ndim == 1:
        return ("ones",)
    return ("normal", std)


def reset_rotary_buffers(module: nn.Module) -> None:
    """Recompute every rotary table (``VisionRotary``, ``MRotary``) in ``module``: non-persistent buffers that a
    checkpoint does not hold and ``to_empty`` leaves uninitialised."""
    for m in module.modules():
        reset = getattr(m, "reset_buffers", None)
        if callable(reset) and hasattr(m, "inv_freq"):
            reset()


def init_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for linear/conv/embedding weights, zero biases, unit norms (as HF initialises)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv3d, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            m.reset_parameters()
