"""The Qwen2.5-Omni thinker as three modules: ``visual`` (Qwen2.5-VL's encoder + merger, reused as is), ``audio``
(the chunked Whisper encoder) and ``language`` (Qwen2.5-VL's decoder + lm_head, reused as is).

The runtime places the modules in different actor groups; this wrapper joins them for the single-process
reference, for evaluation and for the weight adapter. Inputs are taken as transformers'
``Qwen2_5OmniThinkerForConditionalGeneration`` takes them.
"""

from __future__ import annotations

import torch
from torch import nn

from dhp.models.qwen2_5_omni.audio import AudioEncoder, init_audio
from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from dhp.models.qwen2_5_omni.rope import omni_rope_index
from dhp.models.qwen2_5_vl.model import Qwen2_5_VL, init_qwen
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.qwen2_5_vl.vision import VisionTransformer


def flatten_features(input_features: torch.Tensor, feature_attention_mask: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' padded clips [A, M, F_max] + mask [A, F_max] -> frames [M, F_total] (clips concatenated in
    time), frames per clip [A]. Without a mask every frame counts."""
    if feature_attention_mask is None:
        feature_attention_mask = torch.ones(input_features.shape[0], input_features.shape[2], dtype=torch.long,
                                            device=input_features.device)
    lens = feature_attention_mask.sum(-1).long()
    frames = input_features.permute(0, 2, 1)[feature_attention_mask.bool()]  # [F_total, M]
    return frames.T, lens


class Qwen2_5OmniThinker(nn.Module):
    def __init__(self, cfg: Qwen2_5OmniConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTransformer(cfg.vision)
        self.audio = AudioEncoder(cfg.audio)
        self.language = TextModel(cfg.text, cfg.image_token_id)

    def reset_parameters(self, seed: int | None = None, std: float = 0.02) -> None:
        """Each module from its own seed (``seed + 0`` vision, ``seed + 1`` text, ``seed + 2`` audio), by parameter
        name, so a group that builds only one module, in any layout, gets exactly the weights the whole model
        would. ``seed=None``: a seed drawn from torch's global RNG."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        init_qwen(self.visual, seed, std=std)
        init_qwen(self.language, seed + 1, std=std)
        init_audio(self.audio, seed + 2, std=std)

    # ---- encoders ------------------------------------------------------------------------------------------
    def encode_vision(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """``{image_token_id: [n, D], video_token_id: [m, D]}`` (absent ones left out): Qwen2.5-VL's code, which
        reads only ``self.visual``, ``split_vision`` and the config attributes this config shares with
        Qwen2_5_VLConfig."""
        return Qwen2_5_VL.encode_vision(self, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)

    split_vision = Qwen2_5_VL.split_vision  # one output per vision token, as Qwen2.5-VL's

    def encode_audio(self, features: torch.Tensor | None, feature_lens: torch.Tensor | None
                     ) -> dict[int, torch.Tensor]:
        """features [M, F_total], feature_lens [A] -> ``{audio_token_id: [N, D]}`` (empty without clips)."""
        if features is None or feature_lens is None or feature_lens.numel() == 0:
            return {}
        return {self.cfg.audio_token_id: self.audio(features, feature_lens)}

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     video_grid_thw: torch.Tensor | None, audio_feature_lens: torch.Tensor | None,
                     second_per_grid_ts: torch.Tensor | None, use_audio_in_video: bool = False) -> torch.Tensor:
        return omni_rope_index(input_ids, image_grid_thw, video_grid_thw, audio_feature_lens, second_per_grid_ts,
                               self.cfg, use_audio_in_video)

    def forward(
        self,
        input_ids: torch.Tensor,
        input_features: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        use_audio_in_video: bool = False,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, L], input_features [A, M, F_max] + feature_attention_mask [A, F_max], pixel_values
        [N, 1176] + image_grid_thw [I, 3], pixel_values_videos [Nv, 1176] + video_grid_thw [V, 3],
        video_second_per_grid [V] -> logits [B, L, V]."""
        features = lens = None
        if input_features is not None:
            features, lens = flatten_features(input_features, feature_attention_mask)
        media = {**self.encode_audio(features, lens),
                 **self.encode_vision(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)}
        if position_ids is None:
            position_ids = self.position_ids(input_ids, image_grid_thw, video_grid_thw, lens, video_second_per_grid,
                                             use_audio_in_video)
        return self.language(input_ids, position_ids, media or None, cu_seqlens)

    # ---- what evaluation uses (dhp.evaluate.EvalModel) ----------------------------------------
    def encode_media(self, sample) -> dict[int, torch.Tensor] | None:
        """The sample's vision and audio embeddings ``{placeholder id: [n, D]}``, or None for a text-only sample."""
        media = self.encode_vision(sample.pixel_values, sample.image_grid_thw,
                                   getattr(sample, "pixel_values_videos", None),
                                   getattr(sample, "video_grid_thw", None))
        media.update(self.encode_audio(getattr(sample, "audio_features", None),
                                       getattr(sample, "audio_feature_lens", None)))
        return media or None

    def sample_logits(self, input_ids: torch.Tensor, sample, media) -> torch.Tensor:
        """Logits [1, L, V] of ``input_ids`` [1, L] (a prefix of ``sample``'s ids, or its continuation)."""
        in_video = getattr(sample, "use_audio_in_video", None)
        if in_video is None:
            in_video = has_audio_in_video(input_ids, self.cfg)
        positions = self.position_ids(input_ids, sample.image_grid_thw, getattr(sample, "video_grid_thw", None),
                                      getattr(sample, "audio_feature_lens", None),
                                      getattr(sample, "second_per_grid_ts", None), bool(in_video))
        return self.language(input_ids, positions, media)


def has_audio_in_video(input_ids: torch.Tensor, cfg: Qwen2_5OmniConfig) -> bool:
    """Whether the ids hold a video laid out with its audio (``<|vision_bos|>`` directly followed by
    ``<|audio_bos|>``, as the processor writes it with ``use_audio_in_video``)."""
    ids = input_ids.reshape(-1)
    return bool(((ids[:-1] == cfg.vision_start_token_id) & (ids[1:] == cfg.audio_start_token_id)).any())


def build_model(cfg: Qwen2_5OmniConfig, device: str | torch.device = "cpu", seed: int | None = None
                ) -> Qwen2_5OmniThinker:
    """A randomly initialised thinker; on ``device="meta"`` nothing is allocated."""
    with torch.device(device):
        model = Qwen2_5OmniThinker(cfg)
    if str(device) != "meta":
        model.reset_parameters(seed)
    return model
