"""Qwen3-VL as two modules: ``visual`` (encoder, merger, DeepStack mergers) and ``language`` (decoder + lm_head).

The runtime places the two in different actor groups; this wrapper joins them for the single-process reference,
for evaluation and for the weight adapter. The vision embeddings travel packed (``vision.pack``: main embeddings
and DeepStack features side by side), so ``encode_vision``'s output is exactly what the language module takes.
"""

from __future__ import annotations

import torch
from torch import nn

from dhp.models.qwen3_vl.config import Qwen3VLConfig
from dhp.models.qwen3_vl.mrope import rope_index
from dhp.models.qwen3_vl.text import TextModel
from dhp.models.qwen3_vl.vision import VisionTransformer
from dhp.models.spec import standard_init_rule
from dhp.parallel.materialize import init_by_name


class Qwen3VL(nn.Module):
    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTransformer(cfg.vision)
        self.language = TextModel(cfg.text, cfg.image_token_id, cfg.deepstack_levels)

    def reset_parameters(self, seed: int | None = None, std: float = 0.02) -> None:
        """Each module from its own seed (``seed + 0`` vision, ``seed + 1`` text), by parameter name."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        for offset, module in enumerate((self.visual, self.language)):
            init_qwen3(module, seed + offset, std=std)

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: object = None) -> torch.Tensor:
        """M-RoPE positions [3, B, L] (``second_per_grid_ts`` is accepted and unused: time is text in Qwen3-VL)."""
        return rope_index(input_ids, image_grid_thw, image_token_id=self.cfg.image_token_id,
                          video_token_id=self.cfg.video_token_id,
                          spatial_merge_size=self.cfg.vision.spatial_merge_size, video_grid_thw=video_grid_thw)

    def encode_vision(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """``{image_token_id: packed image embeddings, video_token_id: packed video embeddings}`` (empty ones left
        out); attention never crosses a frame, so one call for both equals encoding them apart."""
        parts = [(self.cfg.image_token_id, pixel_values, image_grid_thw),
                 (self.cfg.video_token_id, pixel_values_videos, video_grid_thw)]
        parts = [(tid, pv, g) for tid, pv, g in parts if pv is not None and pv.shape[0]]
        if not parts:
            return {}
        embeds = self.visual(torch.cat([pv for _, pv, _ in parts]), torch.cat([g.reshape(-1, 3) for _, _, g in parts]))
        counts = [int(g.prod(-1).sum()) // self.cfg.vision.merge_unit for _, _, g in parts]
        return {tid: e for (tid, _, _), e in zip(parts, embeds.split(counts), strict=True)}

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, L], pixel_values [N, 1536], image_grid_thw [I, 3], pixel_values_videos [Nv, 1536],
        video_grid_thw [V, 3] -> logits [B, L, V]."""
        media = self.encode_vision(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, image_grid_thw, video_grid_thw)
        return self.language(input_ids, position_ids, media or None, cu_seqlens)

    # ---- what evaluation uses (dhp.evaluate.EvalModel) ----------------------------------------
    def encode_media(self, sample) -> dict[int, torch.Tensor] | None:
        media = self.encode_vision(sample.pixel_values, sample.image_grid_thw,
                                   getattr(sample, "pixel_values_videos", None),
                                   getattr(sample, "video_grid_thw", None))
        return media or None

    def sample_logits(self, input_ids: torch.Tensor, sample, media) -> torch.Tensor:
        grid = sample.image_grid_thw if sample.image_grid_thw.shape[0] else None
        videos = getattr(sample, "video_grid_thw", None)
        return self.language(input_ids, self.position_ids(input_ids, grid, videos), media)


def build_model(cfg: Qwen3VLConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Qwen3VL:
    """A randomly initialised model; on ``device="meta"`` nothing is allocated."""
    with torch.device(device):
        model = Qwen3VL(cfg)
    if str(device) != "meta":
        model.reset_parameters(seed)
    return model


def init_qwen3(module: nn.Module, seed: int, transforms: dict | None = None, std: float = 0.02) -> None:
    """Shard-local deterministic init: each parameter's values depend on ``(seed, its name)`` only (Normal(0, std)
    matrices and embeddings, zero biases, unit norm weights)."""
    init_by_name(module, seed, lambda name, p: standard_init_rule(name, p, std), transforms=transforms)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
