"""Hugging Face checkpoints of the Qwen2.5-Omni thinker in and out: a weight adapter (``OmniThinkerWeights``),
not renamed modules.

On disk, a thinker saved by transformers (``Qwen2_5OmniThinkerForConditionalGeneration.save_pretrained``) has
``audio_tower.*``, ``visual.*`` (encoder + merger), ``model.*`` (decoder) and ``lm_head.weight``. transformers 5
keeps them in memory as ``model.audio_tower.*`` / ``model.visual.*`` / ``model.language_model.*``, and the
published full Qwen2.5-Omni checkpoints (thinker + talker + token2wav) have them under ``thinker.``. All three
spellings load. Only the thinker is read: ``talker.*`` and ``token2wav.*`` tensors (speech output) are skipped.

Our modules are ``visual.*``, ``audio.*`` and ``language.*`` (``lm_head`` inside ``language``). Fused parameters
(``dhp.models.adapter.Fused``): our vision attention has a fused ``attn.qkv`` where the Omni checkpoint has
``attn.q``, ``attn.k``, ``attn.v`` (concatenated on dim 0, q, k, v, on load; split on save); the language model is
Qwen2.5-VL's, so its ``self_attn.qkv_proj`` and every SwiGLU's ``mlp.gate_up_proj`` map as in the Qwen2.5-VL
adapter (``q_proj``/``k_proj``/``v_proj``; ``gate_proj``/``up_proj``). The audio encoder keeps HF's names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from dhp.models.adapter import Fused
from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from dhp.models.qwen2_5_omni.model import Qwen2_5OmniThinker
from dhp.models.qwen2_5_vl.weights import GATE_UP, TEXT_QKV, QwenVLWeights, _rebuild_buffers, load_into

_T = r"^(?:thinker\.)?"  # a full Qwen2.5-Omni checkpoint's thinker prefix, optional
VISION_QKV = Fused(r"visual\.blocks\.\d+\.attn\.", "qkv", ("q", "k", "v"))  # equal parts: C rows each


class OmniThinkerWeights(QwenVLWeights):
    """The Qwen2.5-Omni thinker's checkpoints (thinker-only or full Omni layout); config and tying as Qwen2.5-VL's."""

    family = "qwen2_5_omni"
    from_hf_rules = (  # (pattern on a checkpoint key, replacement giving our key); first match wins
        (_T + r"model\.audio_tower\.", "audio."),
        (_T + r"model\.visual\.", "visual."),
        (_T + r"model\.language_model\.", "language."),
        (_T + r"audio_tower\.", "audio."),
        (_T + r"visual\.", "visual."),
        (_T + r"model\.", "language."),
        (_T + r"lm_head\.", "language.lm_head."),
    )
    to_hf_rules = (
        (r"^audio\.", "audio_tower."),
        (r"^visual\.", "visual."),
        (r"^language\.lm_head\.", "lm_head."),
        (r"^language\.", "model."),
    )
    fused = (VISION_QKV, TEXT_QKV, GATE_UP)
    skipped = ("talker.", "token2wav.")  # the speech-output halves of a full Qwen2.5-Omni checkpoint


WEIGHTS = OmniThinkerWeights()


def read_hf_config(path: str | Path) -> Qwen2_5OmniConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint directory needs config.json")
    return Qwen2_5OmniConfig.from_hf_dict(json.loads(cfg_file.read_text()))


def load_hf_state_dict(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Our-named tensors from a checkpoint directory (thinker-only or full Omni layout); ``keys`` (our names)
    limits what is read. Talker/token2wav tensors are skipped; any other unknown key is an error."""
    return WEIGHTS.load_hf(path, keys)


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Qwen2_5OmniThinker:
    """Build a thinker from a Hugging Face directory (config.json + *.safetensors, sharded or not; a thinker
    checkpoint or a full Qwen2.5-Omni one, whose talker and token2wav are ignored).

    Tensors keep the checkpoint's dtype. Missing or unknown keys are an error that lists them."""
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Qwen2_5OmniThinker(cfg)
    load_into(model, WEIGHTS.load_hf(path), source=str(path))
    _rebuild_buffers(model)  # vision and text rotary tables
    model.audio.register_buffer("positional_embedding", model.audio._positions(), persistent=False)
    return model.to(device)


def hf_state_dict(model: Qwen2_5OmniThinker) -> dict[str, torch.Tensor]:
    """Our weights under the keys of a transformers-saved thinker checkpoint (vision qkv split in q, k, v, text
    qkv_proj in q_proj, k_proj, v_proj, every fused gate/up in gate and up)."""
    return WEIGHTS.hf_state(model)


def save_hf_checkpoint(
    model: Qwen2_5OmniThinker, path: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None
) -> None:
    """Write config.json and safetensors shards that transformers' ``Qwen2_5OmniThinkerForConditionalGeneration``
    loads with no missing and no unexpected keys. ``state``: HF-named tensors to write instead of the model's."""
    WEIGHTS.save_hf(model, path, max_shard_bytes, state)
