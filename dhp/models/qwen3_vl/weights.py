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
from typing import Any

import torch

from dhp.models.adapter import Fused, RuleAdapter
from dhp.models.qwen3_vl.config import Qwen3VLConfig
from dhp.models.qwen3_vl.model import Qwen3VL
from dhp.models.qwen3_vl.text import InterleavedMRotary, text_qkv_sizes
from dhp.models.qwen3_vl.vision import VisionRotary

TEXT_GATE_UP = Fused(r"language\.layers\.\d+\.mlp\.", "gate_up_proj", ("gate_proj", "up_proj"))
TEXT_QKV = Fused(r"language\.layers\.\d+\.self_attn\.", "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                 lambda model_cfg: text_qkv_sizes(model_cfg.text))


class Qwen3VLWeights(RuleAdapter):
    """Qwen3-VL's checkpoints (``Qwen3VLForConditionalGeneration``'s names)."""

    family = "qwen3_vl"
    from_hf_rules = (  # (pattern on a checkpoint key, replacement giving our key); first match wins
        (r"^model\.visual\.", "visual."),
        (r"^model\.language_model\.", "language."),
        (r"^visual\.", "visual."),
        (r"^model\.", "language."),
        (r"^lm_head\.", "language.lm_head."),
    )
    to_hf_rules = (
        (r"^visual\.", "model.visual."),
        (r"^language\.lm_head\.", "lm_head."),
        (r"^language\.", "model.language_model."),
    )
    fused = (TEXT_QKV, TEXT_GATE_UP)

    def hf_config(self, model_cfg: Any, dtype: torch.dtype) -> dict:
        return model_cfg.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")}

    def tied(self, model_cfg: Any) -> dict[str, str]:
        return {"language.lm_head.weight": "language.embed_tokens.weight"} if model_cfg.text.tie_word_embeddings \
            else {}


WEIGHTS = Qwen3VLWeights()


def read_hf_config(path: str | Path) -> Qwen3VLConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint directory needs config.json")
    return Qwen3VLConfig.from_hf_dict(json.loads(cfg_file.read_text()))


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Qwen3VL:
    """A model from a Hugging Face directory (config.json + *.safetensors, sharded or not), in the checkpoint's
    dtype. Missing or unknown keys are an error that lists them."""
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Qwen3VL(cfg)
    load_into(model, WEIGHTS.load_hf(path), source=str(path))
    model.visual.rotary = VisionRotary(cfg.vision)  # non-persistent: not in checkpoints, built on the CPU
    model.language.rotary = InterleavedMRotary(cfg.text)
    return model.to(device)


def load_into(model: Qwen3VL, state: dict[str, torch.Tensor], source: str) -> None:
    expected = set(model.state_dict().keys())
    if model.cfg.text.tie_word_embeddings:
        expected.discard("language.lm_head.weight")
        state.pop("language.lm_head.weight", None)
    missing = sorted(expected - set(state))
    unknown = sorted(set(state) - expected)
    if missing or unknown:
        raise KeyError(f"{source}: missing keys {missing}; unknown keys {unknown}")
    model.load_state_dict(state, strict=False, assign=True)
    if model.cfg.text.tie_word_embeddings:
        model.language.lm_head.weight = model.language.embed_tokens.weight


def save_hf_checkpoint(model: Qwen3VL, path: str | Path, max_shard_bytes: int = 5 * 2**30,
                       state: dict | None = None) -> None:
    """config.json and safetensors shards that transformers' Qwen3VLForConditionalGeneration loads."""
    WEIGHTS.save_hf(model, path, max_shard_bytes, state)
