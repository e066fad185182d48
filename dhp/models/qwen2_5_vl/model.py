"""Qwen2.5-VL as two modules: ``visual`` (encoder + merger) and ``language`` (decoder + lm_head).

The runtime places the two in different actor groups; this wrapper joins them
for the single-process reference, for evaluation and for the weight adapter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.mrope import rope_index
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_rule
from dhp.parallel.materialize import init_by_name


class Qwen2_5_VL(nn.Module):
    """The whole model. A family whose model has the same two halves (Qwen3-VL) subclasses it, bringing its own
    ``build_modules`` and ``position_ids``."""

    def __init__(self, cfg: Qwen2_5_VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual, self.language = self.build_modules(cfg)

    def build_modules(self, cfg: Qwen2_5_VLConfig) -> tuple[nn.Module, nn.Module]:
        """(the vision encoder, the language model)."""
        return VisionTransformer(cfg.vision), TextModel(cfg.text, cfg.image_token_id)

    def reset_parameters(self, seed: int | None = None, std: float = 0.02) -> None:
        """Each module is initialised from its own seed (``seed + 0`` vision, ``seed + 1`` text) by parameter
        name (``init_qwen``), so a group that builds only one module, in any layout, gets exactly the weights
        the whole model would. ``seed=None``: a seed drawn from torch's global RNG."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        for offset, module in enumerate((self.visual, self.language)):
            init_qwen(module, seed + offset, std=std)

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     video_grid_thw: torch.Tensor | None = None,
                     second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        return rope_index(
            input_ids,
            image_grid_thw,
            image_token_id=self.cfg.image_token_id,
            vision_start_token_id=self.cfg.vision_start_token_id,
            spatial_merge_size=self.cfg.vision.spatial_merge_size,
            video_grid_thw=video_grid_thw,
            video_token_id=self.cfg.video_token_id,
            second_per_grid_ts=second_per_grid_ts,
            tokens_per_second=self.cfg.vision.tokens_per_second,
        )

    def encode_vision(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """``{image_token_id: image embeddings, video_token_id: video embeddings}`` (entries with none left out).

        Images and clips go through the encoder in one call: attention never crosses an image or a frame, so
        this equals encoding them apart (as transformers does)."""
        parts = [(self.cfg.image_token_id, pixel_values, image_grid_thw),
                 (self.cfg.video_token_id, pixel_values_videos, video_grid_thw)]
        parts = [(tid, pv, g) for tid, pv, g in parts if pv is not None and pv.shape[0]]
        if not parts:
            return {}
        embeds = self.visual(torch.cat([pv for _, pv, _ in parts]), torch.cat([g.reshape(-1, 3) for _, _, g in parts]))
        counts = [int(g.prod(-1).sum()) // self.cfg.vision.merge_unit for _, _, g in parts]
        return {tid: e for (tid, _, _), e in zip(parts, self.split_vision(embeds, counts), strict=True)}

    def split_vision(self, embeds: Any, counts: list[int]) -> list[Any]:
        """The encoder's output cut into consecutive runs of ``counts`` rows (images', then videos'). A family
        whose encoder has named outputs (Qwen3-VL) cuts each of them."""
        return list(embeds.split(counts))

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, L], pixel_values [N, 1176], image_grid_thw [I, 3], pixel_values_videos [Nv, 1176],
        video_grid_thw [V, 3], second_per_grid_ts [V] -> logits [B, L, V]."""
        media = self.encode_vision(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts)
        return self.language(input_ids, position_ids, media or None, cu_seqlens)

    # ---- what evaluation uses (dhp.evaluate.EvalModel) ----------------------------------------
    def encode_media(self, sample) -> dict[int, torch.Tensor] | None:
        """The sample's vision embeddings ``{placeholder id: [n, D]}``, or None for a text-only sample."""
        media = self.encode_vision(sample.pixel_values, sample.image_grid_thw,
                                   getattr(sample, "pixel_values_videos", None),
                                   getattr(sample, "video_grid_thw", None))
        return media or None

    def sample_logits(self, input_ids: torch.Tensor, sample, media) -> torch.Tensor:
        """Logits [1, L, V] of ``input_ids`` [1, L] (a prefix of ``sample``'s ids, or its continuation)."""
        grid = sample.image_grid_thw if sample.image_grid_thw.shape[0] else None
        videos = getattr(sample, "video_grid_thw", None)
        seconds = getattr(sample, "second_per_grid_ts", None)
        return self.language(input_ids, self.position_ids(input_ids, grid, videos, seconds), media)


def build_model(cfg: Qwen2_5_VLConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Qwen2_5_VL:
    """A randomly initialised model; on ``device="meta"`` nothing is allocated."""
    return build_whole(Qwen2_5_VL, cfg, device, seed)


def build_whole(model_class: type, cfg: object, device: str | torch.device = "cpu", seed: int | None = None) -> Any:
    """``model_class(cfg)`` on ``device``, randomly initialised (``reset_parameters(seed)``) unless on meta."""
    with torch.device(device):
        model = model_class(cfg)
    if str(device) != "meta":
        model.reset_parameters(seed)
    return model


def init_qwen(module: nn.Module, seed: int, transforms: dict | None = None, std: float = 0.02) -> None:
    """Shard-local deterministic init of a (possibly parallelized, materialised) module: each parameter's values
    depend on ``(seed, its name)`` only (``dhp.parallel.materialize.init_by_name``, Qwen's ``init_rule``)."""
    init_by_name(module, seed, lambda name, p: init_rule(name, p, std), transforms=transforms)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
