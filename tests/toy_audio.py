"""A toy third family, plugged in through the registry alone: Qwen2.5-VL plus a tiny "audio" encoder.

Its own processor reads toy clips (``.npy`` feature arrays, two frames per token; ``ToyClips``), its
encoder fills its own placeholder token (``<|vision_pad|>``, unused by Qwen2.5-VL's image data) and
gives its own FLOPs, and its synthetic samples let ``dhp plan`` plan it. Everything else is the
interface's default (init, layout, cost). Nothing under ``dhp/`` knows it: the family is registered by
the tests, and shipped to Ray workers inside the run's inputs.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dhp.data.processor import Media, MediaError, Placeholder
from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.family import FAMILY as QWEN
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor
from dhp.models.spec import Encoder
from dhp.ops.attention import host_metadata

PLACEHOLDER = "<|vision_pad|>"
VISION_PAD_ID = 151654  # its id in Qwen2.5's tokenizers (the presets' token ids are theirs)
FRAMES_PER_TOKEN = 2


@dataclass(frozen=True)
class ToyAudioConfig(Qwen2_5_VLConfig):
    audio_token_id: int = -1
    audio_features: int = 12  # features per frame
    audio_hidden: int = 24


class ToyAudioEncoder(nn.Module):
    """frames [2N, F] (two per token, samples concatenated) -> token embeddings [N, D]."""

    def __init__(self, cfg: ToyAudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.frames_in = nn.Linear(FRAMES_PER_TOKEN * cfg.audio_features, cfg.audio_hidden)  # stride-2 "conv"
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(cfg.audio_hidden), nn.Linear(cfg.audio_hidden,
                                                                                              cfg.audio_hidden),
                                                  nn.GELU()) for _ in range(2))
        self.out = nn.Linear(cfg.audio_hidden, cfg.text.hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = self.frames_in(frames.reshape(-1, FRAMES_PER_TOKEN * self.cfg.audio_features))  # [N, H]
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)  # [N, D]


class ToyClips(Media):
    """Toy audio clips: ``.npy`` arrays [frames, F] of feature frames, two frames per placeholder token.

    ``probe`` reads the array's header only (shape and dtype), as a real family's processor reads an image's."""

    kind, noun = "audio", "audio clip"

    def __init__(self, placeholder: Placeholder, features: int) -> None:
        self.placeholder, self.features = placeholder, features

    def probe(self, source: Path) -> int:
        if Path(source).suffix != ".npy":
            raise MediaError(f"audio clip {source}: the toy family reads .npy feature arrays; convert the clip")
        with open(source, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                               else np.lib.format.read_array_header_2_0(f))
        if len(shape) != 2 or shape[1] != self.features or shape[0] < FRAMES_PER_TOKEN \
                or shape[0] % FRAMES_PER_TOKEN or dtype.kind != "f":
            raise MediaError(f"audio clip {source} holds {dtype} {shape}; the toy family reads float arrays "
                             f"[frames, {self.features}] with an even, nonzero number of frames")
        return int(shape[0])

    def num_tokens(self, frames: int) -> int:
        return frames // FRAMES_PER_TOKEN

    def decode(self, source: Path, frames: int) -> torch.Tensor:
        return torch.from_numpy(np.load(source)).float()

    def collate(self, facts: Sequence[int], decoded: Sequence[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return {"toy_frames": torch.cat(list(decoded)) if decoded else torch.zeros(0, self.features),
                "toy_frame_lens": torch.tensor(list(facts), dtype=torch.long)}

    def info(self, facts: Sequence[int]) -> dict[str, tuple]:
        return {"audio_frames": tuple(facts)}


class ToyProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's images and videos, plus the toy clips behind their own placeholder token."""

    family = "toy_qwen_audio"

    def __init__(self, data_cfg: Any, tokenizer: Any, model_cfg: ToyAudioConfig) -> None:
        super().__init__(data_cfg, tokenizer, model_cfg)
        self.media = (*self.media, ToyClips(Placeholder(model_cfg.audio_token_id), model_cfg.audio_features))


class ToyAudio(Encoder):
    """Data parallel only: every method but these has the interface's default (init, layout, FLOPs, cost)."""

    name = "audio"
    weight_prefix = "audio"
    seed_offset = 7
    modalities = ("audio",)

    def build(self, model_cfg: ToyAudioConfig) -> ToyAudioEncoder:
        return ToyAudioEncoder(model_cfg)

    def placeholder_ids(self, model_cfg: ToyAudioConfig) -> tuple[int, ...]:
        return (model_cfg.audio_token_id,)

    def encode(self, module: ToyAudioEncoder, samples: list, par: Any, device: Any) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
        frames = torch.cat([torch.zeros(0, module.cfg.audio_features)] + [s.toy_frames for s in samples])
        out = module(frames.to(device))  # [frames / 2, D]: each sample's tokens in order
        return out, torch.arange(out.shape[0])

    def flops(self, info: Any, model_cfg: ToyAudioConfig) -> tuple[float, float]:
        """The closed form of the toy encoder (matmuls): what its group balances and its MFU counts."""
        f, h, d = model_cfg.audio_features, model_cfg.audio_hidden, model_cfg.text.hidden_size
        tokens = sum(info.audio_frames) // FRAMES_PER_TOKEN
        fwd = 2.0 * tokens * (FRAMES_PER_TOKEN * f * h + 2 * h * h + h * d)
        return fwd, 2.0 * fwd - 2.0 * tokens * FRAMES_PER_TOKEN * f * h  # the frames need no gradient


class ToyQwenAudio(type(QWEN)):
    """Qwen2.5-VL plus the toy audio encoder: a third family, registered from the tests alone."""

    name = "toy_qwen_audio"
    encoders = (*QWEN.encoders, ToyAudio())
    hf_model_types = ()
    presets = ("tiny",)

    def model_config(self, cfg: Any, tok: Any) -> ToyAudioConfig:
        base = QWEN.model_config(cfg, tok)
        return ToyAudioConfig(**{f.name: getattr(base, f.name) for f in fields(base)},
                              audio_token_id=tok.token_to_id(PLACEHOLDER))

    def preset_config(self, name: str) -> ToyAudioConfig:
        """Qwen2.5-VL's preset with the toy encoder on ``<|vision_pad|>`` (its id in Qwen's tokenizers), for
        ``dhp plan --family tests.toy_audio:TOY_FAMILY``."""
        base = QWEN.preset_config(name)
        return ToyAudioConfig(**{f.name: getattr(base, f.name) for f in fields(base)}, audio_token_id=VISION_PAD_ID)

    def processor(self, data_cfg: Any, tokenizer: Any, model_cfg: ToyAudioConfig) -> ToyProcessor:
        return ToyProcessor(data_cfg, tokenizer, model_cfg)

    def synthetic_sample(self, model_cfg: ToyAudioConfig, media_tokens: dict[str, int], text_tokens: int,
                         index: int = 0) -> Any:
        """Qwen2.5-VL's synthetic image and text, plus one clip of ``media_tokens["audio"]`` frames (rounded down to
        whole tokens) behind its placeholder tokens. Zeros, shapes exact."""
        from dhp.models.qwen2_5_vl.synthetic import synthetic_sample

        tokens = media_tokens.get("audio", 0) // FRAMES_PER_TOKEN
        vision = {k: v for k, v in media_tokens.items() if k != "audio"}
        sample = synthetic_sample(model_cfg, vision, text_tokens, index,
                                  extra_placeholders={model_cfg.audio_token_id: tokens})
        with host_metadata():
            sample.media["toy_frame_lens"] = torch.tensor([FRAMES_PER_TOKEN * tokens] if tokens else [],
                                                          dtype=torch.long)
        sample.media["toy_frames"] = torch.zeros(FRAMES_PER_TOKEN * tokens, model_cfg.audio_features)  # device data
        return sample


TOY_FAMILY = ToyQwenAudio()


def write_audio_data(demo_train: Path, demo_root: Path, out: Path, n: int = 32) -> Path:
    """Demo image samples and text-only samples, a third of each with a toy clip of 2-5 placeholder tokens (its
    frames random, seeded by the sample, in ``clips/`` beside ``out``)."""
    rows = [json.loads(line) for line in demo_train.read_text().splitlines()]
    images = [r for r in rows if "image" in r][:n // 2]
    clips = out.parent / "clips"
    clips.mkdir(parents=True, exist_ok=True)

    def clip(name: str, tokens: int) -> str:
        g = np.random.default_rng(zlib.crc32(name.encode()))
        path = clips / f"{name}.npy"
        np.save(path, g.standard_normal((FRAMES_PER_TOKEN * tokens, ToyAudioConfig.audio_features), np.float32))
        return str(path)

    data = []
    for i, r in enumerate(images):
        r = json.loads(json.dumps(r))
        paths = [r["image"]] if isinstance(r["image"], str) else r["image"]
        r["image"] = [str(demo_root / p) for p in paths]
        if i % 3 == 0:  # image and audio
            r["audio"] = [clip(f"with_image_{i}", 2 + i % 4)]
            r["conversations"][0]["value"] = "<audio> " + r["conversations"][0]["value"]
        data.append(r)
        question = "<audio> " if i % 3 != 2 else ""  # audio only, or plain text
        row = {"conversations": [{"from": "human", "value": f"{question}What comes after {i % 9}?"},
                                 {"from": "gpt", "value": str(i % 9 + 1)}]}
        if question:
            row["audio"] = [clip(f"alone_{i}", 2 + (i * 7) % 4)]
        data.append(row)
    out.write_text("".join(json.dumps(r) + "\n" for r in data))
    return out
