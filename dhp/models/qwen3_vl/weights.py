"""Hugging Face checkpoints in and out: Qwen3-VL's weight adapter (``Qwen3VLWeights``).

On disk (the published Qwen3-VL layout, which transformers reads and writes): ``model.visual.*`` (encoder,
merger, ``deepstack_merger_list``), ``model.language_model.*`` (decoder), ``lm_head.weight``. The older flat
spelling (``visual.*``, ``model.*``) is read too. Our modules are ``visual.*`` (HF's names inside it) and
``language.*`` (``lm_head`` inside it: the text group owns it).

Fused projections: the decoder's ``self_attn.qkv_proj`` is HF's ``q_proj``, ``k_proj``, ``v_proj`` (no biases;
GQA rows) and its ``mlp.gate_up_proj`` HF's ``gate_proj`` and ``up_proj``, concatenated on dim 0 on load and cut
on export (``dhp.models.adapter``). The vision MLP is not gated (``linear_fc1``/``linear_fc2``), so nothing of
the encoder is fused but the qkv that HF fuses too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dhp.models.qwen2_5_vl.weights import QwenVLWeights, build_from_hf, load_into
from dhp.models.qwen3_vl.config import Qwen3VLConfig
from dhp.models.qwen3_vl.model import Qwen3VL

__all__ = ["WEIGHTS", "Qwen3VLWeights", "load_hf_checkpoint", "load_into", "read_hf_config", "save_hf_checkpoint"]



class Qwen3VLWeights(QwenVLWeights):
    """Qwen3-VL's checkpoints (``Qwen3VLForConditionalGeneration``'s names): Qwen2.5-VL's adapter (the same
    load rules, fused q/k/v and gate/up, tied embeddings, config.json), saved under ``model.visual.*`` and
    ``model.language_model.*``."""

    family = "qwen3_vl"
    to_hf_rules = (
        (r"^visual\.", "model.visual."),
        (r"^language\.lm_head\.", "lm_head."),
        (r"^language\.", "model.language_model."),
    )


WEIGHTS = Qwen3VLWeights()


def read_hf_config(path: str | Path) -> Qwen3VLConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint directory needs config.json")
    return Qwen3VLConfig.from_hf_dict(json.loads(cfg_file.read_text()))


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Qwen3VL:
    """A model from a Hugging Face directory (config.json + *.safetensors, sharded or not), in the checkpoint's
    dtype. Missing or unknown keys are an error that lists them."""
    return build_from_hf(Qwen3VL, read_hf_config(path), path, WEIGHTS, device)


def save_hf_checkpoint(model: Qwen3VL, path: str | Path, max_shard_bytes: int = 5 * 2**30,
                       state: dict | None = None) -> None:
    """config.json and safetensors shards that transformers' Qwen3VLForConditionalGeneration loads."""
    WEIGHTS.save_hf(model, path, max_shard_bytes, state)
