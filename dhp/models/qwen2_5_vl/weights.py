"""Hugging Face checkpoints in and out: a weight adapter, not renamed modules.

On disk (the published Qwen2.5-VL layout, which transformers reads and writes):
``visual.*`` (encoder + merger), ``model.*`` (decoder), ``lm_head.weight``.
transformers 5 keeps them in memory as ``model.visual.*`` / ``model.language_model.*``;
both spellings are accepted on load. Our modules are ``visual.*`` and ``language.*``
(``lm_head`` lives inside ``language``, since the text group owns it).

Fused projections: our SwiGLU holds one ``mlp.gate_up_proj`` (rows ``[gate; up]``) where a checkpoint holds
``mlp.gate_proj`` and ``mlp.up_proj``. On load the two are concatenated on dim 0; on export the fused tensor
is cut in its two halves; ``dhp_to_hf_key`` names a fused parameter as its parts joined by ``|``
(``dhp.parallel.materialize.FUSED``), which the shard-local loader and the checkpoint export read and write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.model import Qwen2_5_VL
from dhp.models.qwen2_5_vl.text import MRotary
from dhp.models.qwen2_5_vl.vision import VisionRotary
from dhp.parallel.materialize import split_fused

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# (pattern on a checkpoint key, replacement giving our key); first match wins
_FROM_HF = [
    (r"^model\.visual\.", "visual."),
    (r"^model\.language_model\.", "language."),
    (r"^visual\.", "visual."),
    (r"^model\.", "language."),
    (r"^lm_head\.", "language.lm_head."),
]
_TO_HF = [
    (r"^visual\.", "visual."),
    (r"^language\.lm_head\.", "lm_head."),
    (r"^language\.", "model."),
]


_PARTS = re.compile(r"^(.*\.mlp\.)(gate|up)_proj\.(weight|bias)$")  # a part of a fused tensor (our prefixes)
_FUSED = re.compile(r"^(.*\.mlp\.)gate_up_proj\.(weight|bias)$")  # our fused tensor
FUSED_PARTS = ("gate", "up")  # the order of the parts on dim 0


def _rename(key: str, rules: list[tuple[str, str]]) -> str | None:
    for pattern, repl in rules:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key, count=1)
    return None


def hf_to_dhp_key(key: str) -> str | None:
    """Our name of a checkpoint key; ``mlp.gate_proj``/``mlp.up_proj`` both map to our fused ``mlp.gate_up_proj``."""
    return fused_key(_rename(key, _FROM_HF))


def fused_key(key: str | None) -> str | None:
    """Our-prefixed ``...mlp.gate_proj.weight`` (or ``up_proj``, or a bias) -> ``...mlp.gate_up_proj.weight``."""
    m = None if key is None else _PARTS.match(key)
    return f"{m.group(1)}gate_up_proj.{m.group(3)}" if m else key


def fused_part(key: str) -> str | None:
    """Which part (``gate``/``up``) of a fused tensor a checkpoint key (or our-prefixed one) is, else None."""
    m = _PARTS.match(key)
    return m.group(2) if m else None


def split_names(key: str) -> list[str]:
    """Our-prefixed names of the parts behind one of our keys, in dim-0 order: the key itself, unless fused."""
    m = _FUSED.match(key)
    return [f"{m.group(1)}{part}_proj.{m.group(2)}" for part in FUSED_PARTS] if m else [key]


def dhp_to_hf_key(key: str) -> str:
    """The checkpoint key of one of our parameters; a fused gate/up maps to its parts joined by ``|``
    (gate, up: concatenated on dim 0)."""
    names = []
    for name in split_names(key):
        out = _rename(name, _TO_HF)
        if out is None:
            raise KeyError(f"no Hugging Face name for parameter {key!r}")
        names.append(out)
    return "|".join(names)


def fuse_parts(parts: dict[str, dict[str, torch.Tensor]], source: str) -> dict[str, torch.Tensor]:
    """``{our fused key: {part: tensor}}`` -> ``{our fused key: the parts concatenated on dim 0}``; a fused key
    missing a part is an error naming it."""
    out = {}
    for key, got in parts.items():
        missing = [p for p in FUSED_PARTS if p not in got]
        if missing:
            raise KeyError(f"{source}: {key} needs {[n.rsplit('.', 2)[-2] for n in split_names(key)]}; "
                           f"{', '.join(missing)} is missing")
        out[key] = torch.cat([got[p] for p in FUSED_PARTS], dim=0)
    return out


def _checkpoint_files(path: Path) -> list[Path]:
    if (path / INDEX_FILE).exists():
        index = json.loads((path / INDEX_FILE).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (expected {SINGLE_FILE} or {INDEX_FILE})")
    return files


def read_hf_config(path: str | Path) -> Qwen2_5_VLConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint directory needs config.json")
    return Qwen2_5_VLConfig.from_hf_dict(json.loads(cfg_file.read_text()))


def load_hf_state_dict(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Our-named tensors from a checkpoint directory; ``keys`` (our names) limits what is read."""
    path = Path(path)
    wanted = None if keys is None else set(keys)
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # our fused key -> {"gate"|"up": tensor}
    unknown: list[str] = []
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_key in f.keys():
                key = hf_to_dhp_key(hf_key)
                if key is None:
                    unknown.append(hf_key)
                elif wanted is None or key in wanted:
                    part = fused_part(hf_key)
                    if part:
                        parts.setdefault(key, {})[part] = f.get_tensor(hf_key)
                    else:
                        out[key] = f.get_tensor(hf_key)
    if unknown:
        raise KeyError(f"{path}: checkpoint keys that are not part of Qwen2.5-VL: {sorted(unknown)}")
    return out | fuse_parts(parts, str(path))


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Qwen2_5_VL:
    """Build a model from a Hugging Face directory (config.json + *.safetensors, sharded or not).

    Tensors keep the checkpoint's dtype. Missing or unknown keys are an error that lists them.
    """
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Qwen2_5_VL(cfg)
    state = load_hf_state_dict(path)
    load_into(model, state, source=str(path))
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
    model.visual.rotary = VisionRotary(model.cfg.vision)
    model.language.rotary = MRotary(model.cfg.text)


def hf_state_dict(model: Qwen2_5_VL) -> dict[str, torch.Tensor]:
    """Our weights under HF's keys (a fused gate/up cut in its parts)."""
    out = {}
    for key, tensor in model.state_dict().items():
        if key == "language.lm_head.weight" and model.cfg.text.tie_word_embeddings:
            continue
        out.update({k: v.contiguous() for k, v in split_fused(dhp_to_hf_key(key), tensor.detach().cpu()).items()})
    return out


def save_hf_checkpoint(
    model: Qwen2_5_VL, path: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None
) -> None:
    """Write config.json and safetensors shards that transformers' Qwen2_5_VLForConditionalGeneration loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = state if state is not None else hf_state_dict(model)
    dtype = next(iter(tensors.values())).dtype
    config = model.cfg.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
