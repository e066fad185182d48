"""Qwen3-VL as two modules: ``visual`` (encoder, merger, DeepStack mergers) and ``language`` (decoder + lm_head).

The runtime places the two in different actor groups; this wrapper joins them for the single-process reference,
for evaluation and for the weight adapter. The vision encoder's outputs are named (``vision.output_names``: the
main embeddings and the DeepStack features), so ``encode_vision``'s output, ``{placeholder id: {name: [n, D]}}``,
is exactly what the language module takes.
Everything but the modules and the rope index is Qwen2.5-VL's whole model (``Qwen2_5_VL``), which this subclasses:
the joint image-and-video encode, the forward, what evaluation calls, the by-name init.
"""

from __future__ import annotations

import torch
from torch import nn

from dhp.models.qwen2_5_vl.model import Qwen2_5_VL, build_whole, count_parameters
from dhp.models.qwen3_vl.config import Qwen3VLConfig
from dhp.models.qwen3_vl.mrope import rope_index
from dhp.models.qwen3_vl.text import TextModel
from dhp.models.qwen3_vl.vision import VisionTransformer

__all__ = ["Qwen3VL", "build_model", "count_parameters"]


class Qwen3VL(Qwen2_5_VL):
    def build_modules(self, cfg: Qwen3VLConfig) -> tuple[nn.Module, nn.Module]:  # type: ignore[override]
        return VisionTransformer(cfg.vision), TextModel(cfg.text, cfg.image_token_id, cfg.deepstack_levels)

    def split_vision(self, embeds: dict[str, torch.Tensor], counts: list[int]) -> list[dict[str, torch.Tensor]]:
        """The named outputs cut into runs of ``counts`` rows: ``encode_vision`` then gives ``{image_token_id:
        {name: image rows}, video_token_id: {name: video rows}}``."""
        split = {name: t.split(counts) for name, t in embeds.items()}
        return [{name: s[k] for name, s in split.items()} for k in range(len(counts))]

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: object = None) -> torch.Tensor:
        """M-RoPE positions [3, B, L] (``second_per_grid_ts`` is accepted and unused: time is text in Qwen3-VL)."""
        return rope_index(input_ids, image_grid_thw, image_token_id=self.cfg.image_token_id,
                          video_token_id=self.cfg.video_token_id,
                          spatial_merge_size=self.cfg.vision.spatial_merge_size, video_grid_thw=video_grid_thw)


def build_model(cfg: Qwen3VLConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Qwen3VL:
    """A randomly initialised model; on ``device="meta"`` nothing is allocated."""
    return build_whole(Qwen3VL, cfg, device, seed)
