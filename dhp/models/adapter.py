"""A model family's weight adapter: our parameter names and layout <-> a Hugging Face checkpoint's.

Why an object: loading (whole-model and shard-local), HF export (``dhp export``, the trainer's ``final/``) and
evaluation all need the same few answers about a family's weights: which HF tensors one of our keys is made of
(several for a fused projection, concatenated on dim 0), how to cut our tensor into them and join them again,
which keys share storage (tied embeddings) and what ``config.json`` says. A family gives one ``WeightAdapter``
(``Family.weights``); generic code calls its methods and never asks whether a hook is set: the base class
itself is the adapter of a family that has none, and every HF method raises a ``ConfigError`` saying so.

``RuleAdapter`` is the adapter given as data (renaming rules on both sides, the fused parameters, the checkpoint
tensors that are not part of the model), which the Qwen families subclass. Our keys are whole-model keys
(``"visual.blocks.0.attn.qkv.weight"``, ``"language.layers.0.self_attn.qkv_proj.weight"``); HF names are the
published on-disk ones (``"model.layers.0.self_attn.q_proj.weight"``).

A leaf: it imports nothing from dhp but the error classes (``dhp.errors``, itself a leaf).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dhp.errors import ConfigError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "Fused", "RuleAdapter", "WeightAdapter", "checkpoint_files",
           "write_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30


class WeightAdapter:
    """The weight adapter of a family without Hugging Face weights, and the base of every family's adapter.

    Naming (subclasses give these two): ``hf_names(key)`` the HF tensors one of our whole-model keys is made of,
    in dim-0 order; ``locate(hf_name)`` the key of ours an HF tensor (in any spelling the family reads) belongs
    to and which of ``hf_names(key)`` it is (None: not part of the model); ``dhp_key`` the key alone.
    Built on them, the same for every family: ``to_hf`` / ``from_hf`` (one tensor of ours <-> its HF tensors),
    ``load_hf`` (an HF directory -> our-named state dict), ``hf_state`` / ``save_hf`` (a whole model -> HF
    tensors / an HF directory). Per family: ``hf_config(model_cfg, dtype)`` (config.json), ``tied(model_cfg)``,
    ``part_rows`` (rows of each part of a fused key, where they are not equal) and ``ignored`` (checkpoint tensors
    to skip on load)."""

    family: str = ""  # the family's name, for messages (a subclass sets it; the default adapter is given it)

    def __init__(self, family: str | None = None) -> None:
        if family is not None:
            self.family = family

    def _none(self) -> ConfigError:
        return ConfigError(f"model family {self.family or '(unnamed)'} has no Hugging Face weight adapter: it "
                           "cannot load model.hf_path nor write Hugging Face checkpoints (set output.save_final="
                           "false and train.eval_at_end=false, and do not run dhp export)")

    # ---- naming: what a family gives -------------------------------------------------------------------------
    def hf_names(self, key: str) -> tuple[str, ...]:
        """The HF tensors our whole-model ``key`` is made of, in dim-0 order (one, or the parts of a fused one)."""
        raise self._none()

    def locate(self, hf_name: str) -> tuple[str, int] | None:
        """(our whole-model key, the part's index in ``hf_names(key)``) of a checkpoint tensor; None if unknown."""
        raise self._none()

    def dhp_key(self, hf_name: str) -> str | None:
        """Our whole-model key of a checkpoint tensor (a part of a fused one: the fused key); None if unknown."""
        hit = self.locate(hf_name)
        return None if hit is None else hit[0]

    def ignored(self, hf_name: str) -> bool:
        """A checkpoint tensor that is not part of the model and is skipped on load (not an error)."""
        return False

    def part_rows(self, key: str, model_cfg: Any) -> tuple[int, ...] | None:
        """Rows of each of ``hf_names(key)`` in our tensor; None: equal parts."""
        return None

    def hf_config(self, model_cfg: Any, dtype: torch.dtype) -> dict:
        """The contents of an HF ``config.json`` for ``model_cfg`` with tensors of ``dtype``."""
        raise self._none()

    def tied(self, model_cfg: Any) -> dict[str, str]:
        """``{our key: the key it shares storage with}``: written once, read from either name."""
        return {}

    # ---- one tensor ------------------------------------------------------------------------------------------
    def to_hf(self, key: str, tensor: torch.Tensor, model_cfg: Any) -> dict[str, torch.Tensor]:
        """Our (canonical, whole) ``tensor`` as its HF tensors: a fused one cut on dim 0 into its parts."""
        names = self.hf_names(key)
        if len(names) == 1:
            return {names[0]: tensor}
        rows = self.part_rows(key, model_cfg)
        if rows is None:
            if tensor.shape[0] % len(names):
                raise ValueError(f"{key}: {list(tensor.shape)} does not cut into {len(names)} equal parts {names}")
            rows = (tensor.shape[0] // len(names),) * len(names)
        if len(rows) != len(names) or sum(rows) != tensor.shape[0]:
            raise ValueError(f"{key}: {list(tensor.shape)} does not cut into parts {names} of rows {list(rows)}")
        return dict(zip(names, tensor.split(list(rows)), strict=True))

    def from_hf(self, key: str, parts: Mapping[str, torch.Tensor], source: str = "the checkpoint") -> torch.Tensor:
        """Our tensor ``key`` from its HF tensors ``{hf name: tensor}``, named as ``hf_names(key)`` names them (a
        fused one: concatenated on dim 0)."""
        names = self.hf_names(key)
        missing = [n for n in names if n not in parts]
        if missing:
            raise KeyError(f"{source}: {key} is made of {list(names)}; {', '.join(missing)} is missing")
        return parts[names[0]] if len(names) == 1 else torch.cat([parts[n] for n in names], dim=0)

    # ---- whole checkpoints -------------------------------------------------------------------------------------
    def load_hf(self, path: str | Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Our-named tensors of an HF directory (sharded or not); ``keys`` (our names) limits what is read.
        Checkpoint tensors that are neither ours nor ``ignored`` are a ``KeyError`` listing them."""
        from safetensors import safe_open

        path = Path(path)
        wanted = None if keys is None else set(keys)
        parts: dict[str, dict[str, torch.Tensor]] = {}  # our key -> {hf name: tensor}
        unknown: list[str] = []
        for file in checkpoint_files(path):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    if self.ignored(hf_name):
                        continue
                    hit = self.locate(hf_name)
                    if hit is None:
                        unknown.append(hf_name)
                    elif wanted is None or hit[0] in wanted:  # under its canonical name (spellings differ)
                        key, part = hit
                        parts.setdefault(key, {})[self.hf_names(key)[part]] = f.get_tensor(hf_name)
        if unknown:
            raise KeyError(f"{path}: checkpoint keys that are not part of {self.family}: {sorted(unknown)}")
        return {key: self.from_hf(key, got, str(path)) for key, got in parts.items()}

    def hf_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A whole model's weights (``model.cfg`` its config) under HF names, tied ones once, on the CPU."""
        tied = self.tied(model.cfg)
        out: dict[str, torch.Tensor] = {}
        for key, tensor in model.state_dict().items():
            if key not in tied:
                out.update({k: v.contiguous() for k, v in self.to_hf(key, tensor.detach().cpu(), model.cfg).items()})
        return out

    def save_hf(self, model: nn.Module, out_dir: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write ``config.json`` and safetensors shards (with their index when there are several) that
        transformers loads. ``state``: HF-named tensors to write instead of the model's own."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = dict(state) if state is not None else self.hf_state(model)
        config = self.hf_config(model.cfg, next(iter(tensors.values())).dtype)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tensors, out_dir, max_shard_bytes)


@dataclass(frozen=True)
class Fused:
    """One parameter of ours that checkpoints store as several tensors, concatenated on dim 0.

    ``within``: a regex on the start of our key (``r"language\\.layers\\.\\d+\\.self_attn\\."``); ``name`` our
    module's name there (``"qkv_proj"``), ``parts`` the checkpoint's (``("q_proj", "k_proj", "v_proj")``), in
    dim-0 order. ``rows(model_cfg)``: the rows of each part where they differ (GQA's q, k, v); None: equal."""

    within: str
    name: str
    parts: tuple[str, ...]
    rows: Callable[[Any], tuple[int, ...]] | None = None

    def match(self, key: str) -> re.Match | None:
        return re.match(rf"^({self.within})" + re.escape(self.name) + r"\.(weight|bias)$", key)

    def match_part(self, key: str) -> re.Match | None:
        """Our-side name of one part (``...self_attn.k_proj.weight``): groups (prefix, part, weight|bias)."""
        alternatives = "|".join(re.escape(p) for p in self.parts)
        return re.match(rf"^({self.within})({alternatives})\.(weight|bias)$", key)


def _rename(key: str, rules: Iterable[tuple[str, str]]) -> str | None:
    for pattern, repl in rules:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key, count=1)
    return None


class RuleAdapter(WeightAdapter):
    """A weight adapter given as data: ``from_hf_rules`` / ``to_hf_rules`` ((regex on a name's start,
    replacement); the first match wins) rename whole prefixes; ``fused`` lists the parameters a checkpoint
    stores in parts; ``skipped`` checkpoint prefixes that are not part of the model (ignored on load)."""

    from_hf_rules: tuple[tuple[str, str], ...] = ()
    to_hf_rules: tuple[tuple[str, str], ...] = ()
    fused: tuple[Fused, ...] = ()
    skipped: tuple[str, ...] = ()

    def _fused(self, key: str) -> tuple[Fused, re.Match] | None:
        for f in self.fused:
            m = f.match(key)
            if m:
                return f, m
        return None

    def hf_names(self, key: str) -> tuple[str, ...]:
        hit = self._fused(key)
        ours = [key] if hit is None else [f"{hit[1].group(1)}{p}.{hit[1].group(2)}" for p in hit[0].parts]
        out = []
        for name in ours:
            hf = _rename(name, self.to_hf_rules)
            if hf is None:
                raise KeyError(f"no Hugging Face name for parameter {key!r} of {self.family}")
            out.append(hf)
        return tuple(out)

    def locate(self, hf_name: str) -> tuple[str, int] | None:
        if self.ignored(hf_name):
            return None
        ours = _rename(hf_name, self.from_hf_rules)
        if ours is None:
            return None
        for f in self.fused:
            m = f.match_part(ours)
            if m:
                return f"{m.group(1)}{f.name}.{m.group(3)}", f.parts.index(m.group(2))
        return ours, 0

    def ignored(self, hf_name: str) -> bool:
        return hf_name.startswith(self.skipped) if self.skipped else False

    def part_rows(self, key: str, model_cfg: Any) -> tuple[int, ...] | None:
        hit = self._fused(key)
        return None if hit is None or hit[0].rows is None else tuple(hit[0].rows(model_cfg))


# ---- files --------------------------------------------------------------------------------------------------------
def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory: those its index names, else every ``*.safetensors``."""
    if (path / INDEX_FILE).exists():
        index = json.loads((path / INDEX_FILE).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (expected {SINGLE_FILE} or {INDEX_FILE})")
    return files


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """``tensors`` as ``model.safetensors``, or as shards of at most ``max_shard_bytes`` with their index (stale
    shards of an earlier write removed first)."""
    from safetensors.torch import save_file

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
