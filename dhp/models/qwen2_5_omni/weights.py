"""Hugging Face checkpoints of the Qwen2.5-Omni thinker in and out: a weight adapter, not renamed modules.

On disk, a thinker saved by transformers (``Qwen2_5OmniThinkerForConditionalGeneration.save_pretrained``) has
``audio_tower.*``, ``visual.*`` (encoder + merger), ``model.*`` (decoder) and ``lm_head.weight``. transformers 5
keeps them in memory as ``model.audio_tower.*`` / ``model.visual.*`` / ``model.language_model.*``, and the
published full Qwen2.5-Omni checkpoints (thinker + talker + token2wav) have them under ``thinker.``. All three
spellings load. Only the thinker is read: ``talker.*`` and ``token2wav.*`` tensors (speech output) are skipped.

Our modules are ``visual.*``, ``audio.*`` and ``language.*`` (``lm_head`` inside ``language``). One layout
difference: our vision attention has a fused ``attn.qkv`` where the Omni checkpoint has ``attn.q``, ``attn.k``,
``attn.v``: they are concatenated on dim 0 (q, k, v) on load and split on save. Our SwiGLUs (vision and text)
hold one fused ``mlp.gate_up_proj`` where the checkpoint has ``mlp.gate_proj`` and ``mlp.up_proj``: the same,
gate then up (the Qwen2.5-VL adapter's rules).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from dhp.models.qwen2_5_omni.model import Qwen2_5OmniThinker
from dhp.models.qwen2_5_vl.weights import (
    _checkpoint_files,
    _rebuild_buffers,
    _rename,
    fuse_parts,
    fused_key,
    fused_part,
    load_into,
    split_names,
)
from dhp.models.qwen2_5_vl.weights import save_hf_checkpoint as _save_vl_layout
from dhp.parallel.materialize import split_fused

# (pattern on a checkpoint key, after any ``thinker.`` prefix, replacement giving our key); first match wins
_FROM_HF = [
    (r"^model\.audio_tower\.", "audio."),
    (r"^model\.visual\.", "visual."),
    (r"^model\.language_model\.", "language."),
    (r"^audio_tower\.", "audio."),
    (r"^visual\.", "visual."),
    (r"^model\.", "language."),
    (r"^lm_head\.", "language.lm_head."),
]
_TO_HF = [
    (r"^audio\.", "audio_tower."),
    (r"^visual\.", "visual."),
    (r"^language\.lm_head\.", "lm_head."),
    (r"^language\.", "model."),
]
_NOT_THINKER = ("talker.", "token2wav.")  # the speech-output halves of a full Qwen2.5-Omni checkpoint
_QKV = re.compile(r"^(visual\.blocks\.\d+\.attn\.)(q|k|v)\.(weight|bias)$")  # our-side name after renaming
_FUSED = re.compile(r"^(visual\.blocks\.\d+\.attn\.)qkv\.(weight|bias)$")


def hf_to_dhp_key(key: str) -> str | None:
    """Our name of a checkpoint key, None for a key that is not part of the thinker (talker, token2wav, unknown).
    The vision ``attn.q``/``attn.k``/``attn.v`` keys all map to our fused ``attn.qkv`` key."""
    if key.startswith(_NOT_THINKER):
        return None
    ours = _rename(key.removeprefix("thinker."), _FROM_HF)
    if ours is None:
        return None
    m = _QKV.match(ours)
    return f"{m.group(1)}qkv.{m.group(3)}" if m else fused_key(ours)


def dhp_to_hf_key(key: str) -> str:
    """The key of one of our parameters in a thinker checkpoint as transformers saves it. A fused vision qkv maps to
    its three parts joined by ``|`` (q, k, v order), to be concatenated on dim 0."""
    m = _FUSED.match(key)
    if m:
        return "|".join(f"{m.group(1)}{part}.{m.group(2)}" for part in "qkv")
    names = []
    for name in split_names(key):  # a fused gate/up: gate, then up
        out = _rename(name, _TO_HF)
        if out is None:
            raise KeyError(f"no Hugging Face name for parameter {key!r}")
        names.append(out)
    return "|".join(names)


def read_hf_config(path: str | Path) -> Qwen2_5OmniConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint directory needs config.json")
    return Qwen2_5OmniConfig.from_hf_dict(json.loads(cfg_file.read_text()))


def load_hf_state_dict(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Our-named tensors from a checkpoint directory (thinker-only or full Omni layout); ``keys`` (our names)
    limits what is read. Talker/token2wav tensors are skipped; any other unknown key is an error."""
    path = Path(path)
    wanted = None if keys is None else set(keys)
    out: dict[str, torch.Tensor] = {}
    qkv_parts: dict[str, dict[str, torch.Tensor]] = {}  # our fused key -> {"q"|"k"|"v": tensor}
    mlp_parts: dict[str, dict[str, torch.Tensor]] = {}  # our fused key -> {"gate"|"up": tensor}
    unknown: list[str] = []
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_key in f.keys():
                if hf_key.startswith(_NOT_THINKER):
                    continue
                key = hf_to_dhp_key(hf_key)
                if key is None:
                    unknown.append(hf_key)
                elif wanted is None or key in wanted:
                    part = re.search(r"\.attn\.(q|k|v)\.(?:weight|bias)$", hf_key)
                    if _FUSED.match(key) and part:
                        qkv_parts.setdefault(key, {})[part.group(1)] = f.get_tensor(hf_key)
                    elif fused_part(hf_key):
                        mlp_parts.setdefault(key, {})[fused_part(hf_key)] = f.get_tensor(hf_key)
                    else:
                        out[key] = f.get_tensor(hf_key)
    if unknown:
        raise KeyError(f"{path}: checkpoint keys that are not part of the Qwen2.5-Omni thinker: {sorted(unknown)}")
    for key, parts in qkv_parts.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"{path}: {key} needs attn.q, attn.k and attn.v; found only {sorted(parts)}")
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out | fuse_parts(mlp_parts, str(path))


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Qwen2_5OmniThinker:
    """Build a thinker from a Hugging Face directory (config.json + *.safetensors, sharded or not; a thinker
    checkpoint or a full Qwen2.5-Omni one, whose talker and token2wav are ignored).

    Tensors keep the checkpoint's dtype. Missing or unknown keys are an error that lists them."""
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Qwen2_5OmniThinker(cfg)
    load_into(model, load_hf_state_dict(path), source=str(path))
    _rebuild_buffers(model)  # vision and text rotary tables
    model.audio.register_buffer("positional_embedding", model.audio._positions(), persistent=False)
    return model.to(device)


def hf_state_dict(model: Qwen2_5OmniThinker) -> dict[str, torch.Tensor]:
    """Our weights under the keys of a transformers-saved thinker checkpoint (vision qkv split in q, k, v, every
    fused gate/up in gate and up)."""
    out = {}
    for key, tensor in model.state_dict().items():
        if key == "language.lm_head.weight" and model.cfg.text.tie_word_embeddings:
            continue
        out.update({k: v.contiguous() for k, v in split_fused(dhp_to_hf_key(key), tensor.detach().cpu()).items()})
    return out


def save_hf_checkpoint(
    model: Qwen2_5OmniThinker, path: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None
) -> None:
    """Write config.json and safetensors shards that transformers' ``Qwen2_5OmniThinkerForConditionalGeneration``
    loads with no missing and no unexpected keys. ``state``: HF-named tensors to write instead of the model's."""
    _save_vl_layout(model, path, max_shard_bytes, state=state if state is not None else hf_state_dict(model))
