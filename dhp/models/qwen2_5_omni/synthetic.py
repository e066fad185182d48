"""Synthetic inputs of Qwen2.5-Omni's thinker for the planner (``dhp plan``): Qwen2.5-VL's image, plus audio.

A sample of ``media_tokens = {"vision": patches, "audio": mel frames}``: one image (Qwen2.5-VL's
``synthetic_sample``) and one audio clip of that many log-mel frames (100 per second: 30 s is 3000 frames),
zeros, with the audio placeholders the clip gives (the stride-2 conv, then the stride-2 pool). Host metadata
is real even under the planner's ``FakeTensorMode``; the mel frames are the caller's mode's (fake there).

``depth_variants``: the vision encoder and the language model as Qwen2.5-VL's; the audio encoder, whose
layers all attend within the same chunks, in steps of 8 layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dhp.models.qwen2_5_vl import synthetic as vl
from dhp.ops.attention import host_metadata

AUDIO = "audio"  # this family's audio module (``family.py``)
AUDIO_STEP = 8  # audio encoder layers per depth step
AUDIO_WHOLE_BELOW = 16  # an audio stack this deep or shallower is measured whole


def synthetic_sample(model_cfg: Any, media_tokens: dict[str, int], text_tokens: int, index: int = 0) -> Any:
    """A decoded ``Sample``: the image (``media_tokens["vision"]`` patches), one audio clip of
    ``media_tokens["audio"]`` mel frames, ``text_tokens`` text tokens. Zeros, shapes exact."""
    from dhp.models.qwen2_5_omni.processor import audio_tokens

    unknown = set(media_tokens) - {vl.VISION, AUDIO}
    if unknown:
        raise ValueError(f"Qwen2.5-Omni has no encoder {sorted(unknown)} (its encoders: {vl.VISION}, {AUDIO})")
    frames = media_tokens.get(AUDIO, 0)
    n_audio = audio_tokens(frames) if frames else 0
    if frames and n_audio < 1:
        raise ValueError(f"an audio clip of {frames} mel frames gives no audio token; give at least 3 frames")
    sample = vl.synthetic_sample(model_cfg, {k: v for k, v in media_tokens.items() if k == vl.VISION},
                                 text_tokens, index, extra_placeholders={model_cfg.audio_token_id: n_audio})
    with host_metadata():
        sample.media["audio_feature_lens"] = torch.tensor([frames] if frames else [], dtype=torch.long)
    # the mel frames: device data (fake under the planner's mode)
    sample.media["audio_features"] = torch.zeros(model_cfg.audio.num_mel_bins, frames)
    return sample


def depth_variants(module_name: str, model_cfg: Any) -> tuple[list[Any], float] | None:
    """Two shallower configs of the module (one and two depth steps) and the whole depth in steps; None: run it
    whole."""
    if module_name != AUDIO:
        return vl.depth_variants(module_name, model_cfg)
    n = model_cfg.audio.encoder_layers
    if n <= AUDIO_WHOLE_BELOW:
        return None
    small = [replace(model_cfg, audio=replace(model_cfg.audio, encoder_layers=k * AUDIO_STEP)) for k in (1, 2)]
    return small, n / AUDIO_STEP
