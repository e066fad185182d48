"""A toy second encoder, plugged in through the registry alone: Qwen2.5-VL plus a tiny "audio" encoder.

The audio encoder reads random feature frames (two per token, seeded by the sample id, so
every process that loads a sample sees the same frames) and fills its own placeholder token
(``<|vision_pad|>``, unused by Qwen2.5-VL's image data). Nothing under ``dhp/`` knows it: the
family is registered by the tests, and shipped to Ray workers inside the run's inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.family import FAMILY as QWEN
from dhp.models.qwen2_5_vl.family import init_module
from dhp.models.spec import EncoderSpec, FamilySpec, ParallelizeOptions, SampleInfo
from dhp.parallel.sharding import apply_activation_checkpointing, apply_fsdp

PLACEHOLDER = "<|vision_pad|>"
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


def frames_of(sample: Any, cfg: ToyAudioConfig) -> torch.Tensor:
    """The sample's feature frames [2n, F]: random, but the same for the same sample id everywhere."""
    n = audio_tokens(sample, cfg)
    g = torch.Generator().manual_seed(10_000 + sample.index)
    return torch.randn(FRAMES_PER_TOKEN * n, cfg.audio_features, generator=g)


def audio_tokens(sample: Any, cfg: ToyAudioConfig) -> int:
    return int((sample.input_ids == cfg.audio_token_id).sum())


def encode(module: ToyAudioEncoder, samples: list, par: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = module.cfg
    frames = torch.cat([torch.zeros(0, cfg.audio_features)] + [frames_of(s, cfg) for s in samples]).to(device)
    out = module(frames)
    return out, torch.arange(out.shape[0], device=out.device)


def parallelize(module: ToyAudioEncoder, par: Any, opts: ParallelizeOptions) -> None:
    # 1. no TP/SP: the toy encoder is data parallel only
    # 2. activation checkpointing
    if opts.activation_checkpointing:
        apply_activation_checkpointing(module.blocks)
    # 3. FSDP2
    if opts.fsdp_mesh is not None:
        apply_fsdp(module, opts.fsdp_mesh, list(module.blocks), mp_policy=opts.mp_policy)


def cost(info: SampleInfo, cfg: ToyAudioConfig) -> float:
    return float(info.token_counts.get(cfg.audio_token_id, 0))


def model_config(cfg: Any, tok: Any) -> ToyAudioConfig:
    base = QWEN.model_config(cfg, tok)
    return ToyAudioConfig(**{f.name: getattr(base, f.name) for f in fields(base)},
                          audio_token_id=tok.token_to_id(PLACEHOLDER))


AUDIO = EncoderSpec(
    name="audio",
    weight_prefix="audio",
    build=ToyAudioEncoder,
    init=init_module,
    parallelize=parallelize,
    seed_offset=7,
    num_tokens=audio_tokens,
    token_id=lambda cfg: cfg.audio_token_id,
    encode=encode,
    cost=cost,
    info_tokens=lambda info, cfg: info.token_counts.get(cfg.audio_token_id, 0),
)

TOY_FAMILY = FamilySpec(
    name="toy_qwen_audio",
    encoders=(*QWEN.encoders, AUDIO),
    language=QWEN.language,
    model_config=model_config,
)


def write_audio_data(demo_train: Path, demo_root: Path, out: Path, n: int = 32) -> Path:
    """Demo image samples and text-only samples, a third of each with an audio clip of 2-5 placeholder tokens."""
    rows = [json.loads(line) for line in demo_train.read_text().splitlines()]
    images = [r for r in rows if "image" in r][:n // 2]
    data = []
    for i, r in enumerate(images):
        r = json.loads(json.dumps(r))
        paths = [r["image"]] if isinstance(r["image"], str) else r["image"]
        r["image"] = [str(demo_root / p) for p in paths]
        if i % 3 == 0:  # image and audio
            r["conversations"][0]["value"] = PLACEHOLDER * (2 + i % 4) + " " + r["conversations"][0]["value"]
        data.append(r)
        k = 2 + (i * 7) % 4
        question = (PLACEHOLDER * k + " ") if i % 3 != 2 else ""  # audio only, or plain text
        data.append({"conversations": [{"from": "human", "value": f"{question}What comes after {i % 9}?"},
                                       {"from": "gpt", "value": str(i % 9 + 1)}]})
    out.write_text("".join(json.dumps(r) + "\n" for r in data))
    return out
