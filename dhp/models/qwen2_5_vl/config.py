"""Typed configuration of Qwen2.5-VL and its presets.

The numbers of the real presets are those of the published Hugging Face
``config.json`` files (Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct). ``tiny`` is a
few-MB model for tests and the demo: every code path of the real model (window
and full attention, GQA, M-RoPE, the merger) with small widths.

``from_hf_dict`` reads both layouts of ``config.json`` found in the wild: the
original flat one (text keys at the top, ``rope_scaling``) and the nested one
that transformers 5 writes (``text_config``, ``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


class VisionGeometry:
    """What a Qwen vision config derives from its fields (``hidden_size``, ``num_heads``, the patch and merge
    sizes): shared by Qwen2.5-VL's and Qwen3-VL's ``VisionConfig``."""

    hidden_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch in ``pixel_values``: C * T * P * P (1176 for Qwen2.5-VL, 1536 for
        Qwen3-VL)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    def validate_heads(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2D rotary)")


@dataclass(frozen=True)
class VisionConfig(VisionGeometry):
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels: 112 / 14 / 2 = 4x4 merged tokens per window
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def window_merged(self) -> int:
        """Side of an attention window in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def validate(self) -> None:
        self.validate_heads()
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes {bad} outside 0..{self.depth - 1}")
        if self.window_merged < 1:
            raise ValueError(f"window_size {self.window_size} smaller than one merged patch")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"text hidden_size {self.hidden_size} not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}"
            )


@dataclass(frozen=True)
class Qwen2_5_VLConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self) -> None:
        self.vision.validate()
        self.text.validate()
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size {self.text.hidden_size}"
            )

    def with_tokens(self, **token_ids: int) -> Qwen2_5_VLConfig:
        """The same model with special token ids taken from a tokenizer."""
        return replace(self, **token_ids)

    # ---- Hugging Face config.json ------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        v, t = self.vision, self.text
        text = {"model_type": "qwen2_5_vl_text", **text_hf_dict(t)}
        vision = {"model_type": "qwen2_5_vl_vision", **vision_hf_dict(v), "tokens_per_second": v.tokens_per_second}
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": t.tie_word_embeddings,
            "text_config": text,
            "vision_config": vision,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen2_5_VLConfig:
        if d.get("model_type") not in ("qwen2_5_vl", None):
            raise ValueError(f"config.json has model_type {d.get('model_type')!r}, expected 'qwen2_5_vl'")
        text_src = dict(d)  # flat layout: text keys at the top
        text_src.update(d.get("text_config") or {})
        rope = text_src.get("rope_parameters") or text_src.get("rope_scaling") or {}
        act = text_src.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"text hidden_act {act!r} is not supported (Qwen2.5-VL uses 'silu')")
        tie = bool(d.get("tie_word_embeddings", text_src.get("tie_word_embeddings", False)))
        text = TextConfig(
            **_pick(TextConfig, text_src, exclude={"rope_theta", "mrope_section", "tie_word_embeddings"}),
            rope_theta=float(rope.get("rope_theta", text_src.get("rope_theta", TextConfig.rope_theta))),
            mrope_section=tuple(rope.get("mrope_section", TextConfig.mrope_section)),
            tie_word_embeddings=tie,
        )
        vsrc = dict(d.get("vision_config") or {})
        if "in_chans" in vsrc:  # original checkpoints spell it this way
            vsrc.setdefault("in_channels", vsrc["in_chans"])
        vrope = vsrc.get("rope_parameters") or {}
        vision = VisionConfig(
            **_pick(VisionConfig, vsrc, exclude={"rope_theta", "fullatt_block_indexes"}),
            fullatt_block_indexes=tuple(vsrc.get("fullatt_block_indexes", VisionConfig.fullatt_block_indexes)),
            rope_theta=float(vrope.get("rope_theta", VisionConfig.rope_theta)),
        )
        tokens = {k: int(d[k]) for k in _TOKEN_KEYS if k in d}
        return cls(vision=vision, text=text, **tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def text_hf_dict(t: TextConfig) -> dict[str, Any]:
    """The language model's part of an HF ``text_config`` (Qwen2.5-VL's and Qwen2.5-Omni's thinker share it)."""
    return {
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)},
        "tie_word_embeddings": t.tie_word_embeddings,
    }


def vision_hf_dict(v: VisionConfig) -> dict[str, Any]:
    """The vision encoder's part of an HF ``vision_config`` (shared by Qwen2.5-VL and Qwen2.5-Omni)."""
    return {
        "depth": v.depth,
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "window_size": v.window_size,
        "out_hidden_size": v.out_hidden_size,
        "fullatt_block_indexes": list(v.fullatt_block_indexes),
        "hidden_act": "silu",
    }


_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _pick(cls: type, src: dict[str, Any], exclude: set[str]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)} - exclude
    return {k: src[k] for k in names if k in src}


def _real(out: int, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool):
    return Qwen2_5_VLConfig(
        vision=VisionConfig(out_hidden_size=out),
        text=TextConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            tie_word_embeddings=tie,
        ),
    )


def tiny(vocab_size: int = 512, **token_ids: int) -> Qwen2_5_VLConfig:
    """A few-MB model with every feature of the real one (4 vision blocks, one of them full attention)."""
    return Qwen2_5_VLConfig(
        vision=VisionConfig(
            depth=4,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=96,
            fullatt_block_indexes=(1, 3),
        ),
        text=TextConfig(
            vocab_size=vocab_size,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            mrope_section=(4, 4, 4),
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        **token_ids,
    )


PRESETS = {
    "tiny": tiny,
    "3b": lambda: _real(2048, 2048, 11008, 36, 16, 2, 151936, True),
    "7b": lambda: _real(3584, 3584, 18944, 28, 28, 4, 152064, False),
    "32b": lambda: _real(5120, 5120, 27648, 64, 40, 8, 152064, False),
    "72b": lambda: _real(8192, 8192, 29568, 80, 64, 8, 152064, False),
}


def preset(name: str) -> Qwen2_5_VLConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
