"""Hugging Face checkpoints in and out: a weight adapter (``QwenVLWeights``), not renamed modules.

On disk (the published Qwen2.5-VL layout, which transformers reads and writes):
``visual.*`` (encoder + merger), ``model.*`` (decoder), ``lm_head.weight``.
transformers 5 keeps them in memory as ``model.visual.*`` / ``model.language_model.*``;
both spellings are accepted on load. Our modules are ``visual.*`` and ``language.*``
(``lm_head`` lives inside ``language``, since the text group owns it).

Fused projections: our SwiGLUs hold one ``mlp.gate_up_proj`` (rows ``[gate; up]``) where a checkpoint holds
``mlp.gate_proj`` and ``mlp.up_proj``; our text attention holds one ``self_attn.qkv_proj`` (rows ``[q; k; v]``,
GQA: ``H * hd``, ``KV * hd``, ``KV * hd`` rows) where a checkpoint holds ``q_proj``, ``k_proj`` and ``v_proj``
(weights and biases). On load the parts are concatenated on dim 0, on export the fused tensor is cut into them
(``dhp.models.adapter``); ``WEIGHTS.hf_names(key)`` names them, which the shard-local loader reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from dhp.models.adapter import Fused, RuleAdapter
from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.model import Qwen2_5_VL
from dhp.models.qwen2_5_vl.text import text_qkv_sizes

GATE_UP = Fused(r".*\.mlp\.", "gate_up_proj", ("gate_proj", "up_proj"))  # vision and text SwiGLUs: equal halves
TEXT_QKV = Fused(r"language\.layers\.\d+\.self_attn\.", "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                 lambda model_cfg: text_qkv_sizes(model_cfg.text))  # GQA: unequal parts


class QwenVLWeights(RuleAdapter):
    """Qwen2.5-VL's checkpoints (``Qwen2_5_VLForConditionalGeneration``'s names)."""

    family = "qwen2_5_vl"
    from_hf_rules = (  # (pattern on a checkpoint key, replacement giving our key); first match wins
        (r"^model\.visual\.", "visual."),
        (r"^model\.language_model\.", "language."),
        (r"^visual\.", "visual."),
        (r"^model\.", "language."),
        (r"^lm_head\.", "language.lm_head."),
    )
    to_hf_rules = (
        (r"^visual\.", "visual."),
        (r"^language\.lm_head\.", "lm_head."),
        (r"^language\.", "model."),
    )
    fused = (TEXT_QKV, GATE_UP)

    def hf_config(self, model_cfg: Any, dtype: torch.dtype) -> dict:
        return model_cfg.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")}

    def tied(self, model_cfg: Any) -> dict[str, str]:
        return {"language.lm_head.weight": "language.embed_tokens.weight"} if model_cfg.text.tie_word_embeddings \
            else {}


WEIGHTS = QwenVLWeights()


def read_hf_config(path: str | Path) -> Qwen2_5_VLConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint directory needs config.json")
    return Qwen2_5_VLConfig.from_hf_dict(json.loads(cfg_file.read_text()))


def load_hf_state_dict(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Our-named tensors from a checkpoint directory; ``keys`` (our names) limits what is read."""
    return WEIGHTS.load_hf(path, keys)


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Qwen2_5_VL:
    """Build a model from a Hugging Face directory (config.json + *.safetensors, sharded or not).

    Tensors keep the checkpoint's dtype. Missing or unknown keys are an error that lists them.
    """
    return build_from_hf(Qwen2_5_VL, read_hf_config(path), path, WEIGHTS, device)


def build_from_hf(model_class: type, cfg: Any, path: str | Path, weights: RuleAdapter,
                  device: str | torch.device) -> Any:
    """``model_class(cfg)`` built on meta and filled from the checkpoint at ``path`` through ``weights`` (missing
    or unknown keys: an error listing them), its rotary tables rebuilt, then moved to ``device``. Shared by the
    families whose whole model has ``visual`` and ``language`` halves (Qwen2.5-VL, Qwen3-VL)."""
    with torch.device("meta"):
        model = model_class(cfg)
    load_into(model, weights.load_hf(path), source=str(path))
    _rebuild_buffers(model)
    return model.to(device)


def load_into(model: Qwen2_5_VL, state: dict[str, torch.Tensor], source: str) -> None:
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


def _rebuild_buffers(model: Qwen2_5_VL) -> None:
    """Non-persistent buffers (rotary frequencies) are not in checkpoints: build them on the CPU."""
    model.visual.rotary = type(model.visual.rotary)(model.cfg.vision)  # the family's own rotary classes
    model.language.rotary = model.language.rotary_class(model.cfg.text)


def hf_state_dict(model: Qwen2_5_VL) -> dict[str, torch.Tensor]:
    """Our weights under HF's keys (fused q/k/v and gate/up cut in their parts)."""
    return WEIGHTS.hf_state(model)


def save_hf_checkpoint(
    model: Qwen2_5_VL, path: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None
) -> None:
    """Write config.json and safetensors shards that transformers' Qwen2_5_VLForConditionalGeneration loads."""
    WEIGHTS.save_hf(model, path, max_shard_bytes, state)
