"""A toy family whose encoder has two named outputs, for the router's generic named-output path.

The toy audio family (``tests.toy_audio``: Qwen2.5-VL plus a tiny audio encoder) with its audio encoder emitting
``embeds`` [n, D] (float32) and ``extra`` [n, 5] in float64: another width and another dtype, so a router that
padded, cast or dropped a part would show. The language model declares both as its inputs and adds ``extra``
to the first 5 features of each audio placeholder's embedding (no parameter of its own: under text TP with
Megatron SP each rank adds only its slice's rows, and nothing would need summing). Nothing under ``dhp/`` knows
it: the tests register it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dhp.models.qwen2_5_vl.family import Text as QwenText
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.spec import EMBEDS, Input
from tests.toy_audio import FRAMES_PER_TOKEN, TOY_FAMILY, ToyAudio, ToyAudioConfig, ToyAudioEncoder

EXTRA = "extra"
EXTRA_WIDTH = 5
EXTRA_DTYPE = torch.float64


class TwoOutputEncoder(ToyAudioEncoder):
    """The toy audio encoder with a second head: ``{"embeds": [N, D] float32, "extra": [N, 5] float64}``."""

    def __init__(self, cfg: ToyAudioConfig) -> None:
        super().__init__(cfg)
        self.extra = nn.Linear(cfg.audio_hidden, EXTRA_WIDTH)

    def forward(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x = self.frames_in(frames.reshape(-1, FRAMES_PER_TOKEN * self.cfg.audio_features))
        for block in self.blocks:
            x = x + block(x)
        return {EMBEDS: self.out(x), EXTRA: self.extra(x).to(EXTRA_DTYPE)}


class TwoOutputAudio(ToyAudio):
    def outputs(self, model_cfg: Any) -> tuple[str, ...]:
        return (EMBEDS, EXTRA)

    def build(self, model_cfg: ToyAudioConfig) -> TwoOutputEncoder:
        return TwoOutputEncoder(model_cfg)

    def encode(self, module: TwoOutputEncoder, samples: list, par: Any,
               device: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        frames = torch.cat([torch.zeros(0, module.cfg.audio_features)] + [s.toy_frames for s in samples])
        out = module(frames.to(device))
        return out, torch.arange(out[EMBEDS].shape[0])


class ExtraTextModel(TextModel):
    """Qwen2.5-VL's language model; where a placeholder id's media carry ``extra``, it is added to the first
    ``EXTRA_WIDTH`` features of those placeholders' embeddings (whole, or a sequence slice's rows)."""

    def embed(self, input_ids: torch.Tensor, media: Any = None,
              placeholders: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        main, extra = {}, {}
        for token_id, value in (media or {}).items():
            named, positions = value if isinstance(value, tuple) else (value, None)
            if isinstance(named, dict):
                if EXTRA in named:
                    rows = positions if positions is not None else _slots(input_ids, token_id, placeholders)
                    extra[token_id] = (named[EXTRA], rows)
                named = named[EMBEDS]
            main[token_id] = named if positions is None else (named, positions)
        x = super().embed(input_ids, main or None, placeholders)
        flat = x.reshape(-1, x.shape[-1])
        for feature, rows in extra.values():
            if rows.numel():
                flat = flat.index_add(0, rows.to(x.device), nn.functional.pad(
                    feature.to(x.dtype), (0, x.shape[-1] - EXTRA_WIDTH)))
        return flat.view(x.shape)


def _slots(input_ids: torch.Tensor, token_id: int, placeholders: dict[int, torch.Tensor] | None) -> torch.Tensor:
    if placeholders is not None and token_id in placeholders:
        return placeholders[token_id]
    return (input_ids.reshape(-1) == token_id).nonzero().flatten()


class ExtraText(QwenText):
    def build(self, model_cfg: ToyAudioConfig) -> ExtraTextModel:
        return ExtraTextModel(model_cfg.text, model_cfg.image_token_id)

    def inputs(self, model_cfg: Any) -> tuple[Input, ...]:
        return (Input(EMBEDS), Input(EXTRA))  # both at the placeholders, before the first layer


class ToyNamed(type(TOY_FAMILY)):
    name = "toy_named_audio"
    encoders = (*TOY_FAMILY.encoders[:-1], TwoOutputAudio())
    language = ExtraText()


NAMED_FAMILY = ToyNamed()
