"""Typed configuration of the dense Qwen3-VL models and their presets.

The numbers of the real presets are those of the published Hugging Face ``config.json`` files
(Qwen/Qwen3-VL-{2B,4B,8B,32B}-Instruct). ``tiny`` is a few-MB model for tests with every feature of the real
ones: full-attention vision blocks, learned position embeddings, DeepStack mergers, GQA, q/k norms, an explicit
``head_dim`` (4B and 32B have ``head_dim * heads != hidden_size``) and interleaved M-RoPE.

Why a config of its own and not Qwen2.5-VL's: the vision encoder has no windows but LayerNorm, a GELU MLP,
``num_position_embeddings`` and ``deepstack_visual_indexes``; the language model has an explicit ``head_dim``
and no qkv bias. ``from_hf_dict`` reads the nested layout Qwen3-VL checkpoints ship (``text_config``,
``vision_config``, ``rope_parameters`` or the older ``rope_scaling``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dhp.models.qwen2_5_vl.config import _TOKEN_KEYS, VisionGeometry, _pick


@dataclass(frozen=True)
class VisionConfig(VisionGeometry):
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 4096
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    @property
    def grid_per_side(self) -> int:
        """Side of the square table of learned position embeddings (48 for 2304)."""
        return math.isqrt(self.num_position_embeddings)

    def validate(self) -> None:
        self.validate_heads()
        if self.grid_per_side**2 != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} outside 0..{self.depth - 1}")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        s = self.mrope_section
        if 3 * max(s[1], s[2]) > self.head_dim // 2:
            raise ValueError(f"mrope_section {list(s)}: interleaved h/w sections reach past head_dim/2")


@dataclass(frozen=True)
class Qwen3VLConfig:
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
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ValueError(f"{len(self.vision.deepstack_visual_indexes)} DeepStack levels but only "
                             f"{self.text.num_hidden_layers} decoder layers to add them after")

    @property
    def deepstack_levels(self) -> int:
        """DeepStack features per vision token: feature i is added after decoder layer i."""
        return len(self.vision.deepstack_visual_indexes)

    def with_tokens(self, **token_ids: int) -> Qwen3VLConfig:
        """The same model with special token ids taken from a tokenizer."""
        return replace(self, **token_ids)

    # ---- Hugging Face config.json ------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        v, t = self.vision, self.text
        text = {
            "model_type": "qwen3_vl_text",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "head_dim": t.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": t.rms_norm_eps,
            "max_position_embeddings": t.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                "mrope_section": list(t.mrope_section), "mrope_interleaved": True},
            "tie_word_embeddings": t.tie_word_embeddings,
        }
        vision = {
            "model_type": "qwen3_vl_vision",
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "in_channels": v.in_channels,
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "out_hidden_size": v.out_hidden_size,
            "num_position_embeddings": v.num_position_embeddings,
            "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
            "hidden_act": "gelu_pytorch_tanh",
        }
        return {
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": t.tie_word_embeddings,
            "text_config": text,
            "vision_config": vision,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3VLConfig:
        if d.get("model_type") not in ("qwen3_vl", None):
            raise ValueError(f"config.json has model_type {d.get('model_type')!r}, expected 'qwen3_vl'")
        tsrc = dict(d.get("text_config") or {})
        rope = tsrc.get("rope_parameters") or tsrc.get("rope_scaling") or {}
        if tsrc.get("hidden_act", "silu") != "silu":
            raise ValueError(f"text hidden_act {tsrc['hidden_act']!r} is not supported (Qwen3-VL uses 'silu')")
        if tsrc.get("attention_bias", False):
            raise ValueError("text attention_bias=true is not supported (Qwen3-VL has no qkv bias)")
        if rope.get("rope_type", rope.get("type", "default")) != "default" or not rope.get("mrope_interleaved", True):
            raise ValueError(f"text rope {rope}: only the default interleaved M-RoPE is supported")
        tie = bool(d.get("tie_word_embeddings", tsrc.get("tie_word_embeddings", False)))
        text = TextConfig(
            **_pick(TextConfig, tsrc, exclude={"rope_theta", "mrope_section", "tie_word_embeddings"}),
            rope_theta=float(rope.get("rope_theta", tsrc.get("rope_theta", TextConfig.rope_theta))),
            mrope_section=tuple(rope.get("mrope_section", TextConfig.mrope_section)),
            tie_word_embeddings=tie,
        )
        vsrc = dict(d.get("vision_config") or {})
        if vsrc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {vsrc['hidden_act']!r} is not supported (Qwen3-VL uses "
                             "'gelu_pytorch_tanh')")
        vrope = vsrc.get("rope_parameters") or {}
        vision = VisionConfig(
            **_pick(VisionConfig, vsrc, exclude={"rope_theta", "deepstack_visual_indexes"}),
            deepstack_visual_indexes=tuple(vsrc.get("deepstack_visual_indexes",
                                                    VisionConfig.deepstack_visual_indexes)),
            rope_theta=float(vrope.get("rope_theta", VisionConfig.rope_theta)),
        )
        tokens = {k: int(d[k]) for k in _TOKEN_KEYS if k in d}
        return cls(vision=vision, text=text, **tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _real(vision: tuple[int, int, int, tuple[int, ...]], hidden: int, inter: int, layers: int, heads: int,
          tie: bool) -> Qwen3VLConfig:
    depth, v_hidden, v_inter, deepstack = vision
    return Qwen3VLConfig(
        vision=VisionConfig(depth=depth, hidden_size=v_hidden, intermediate_size=v_inter, out_hidden_size=hidden,
                            deepstack_visual_indexes=deepstack),
        text=TextConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=8, tie_word_embeddings=tie),
    )


_SMALL_VIT = (24, 1024, 4096, (5, 11, 17))  # 2B and 4B
_LARGE_VIT = (27, 1152, 4304, (8, 16, 24))  # 8B and 32B


def tiny(vocab_size: int = 512, **token_ids: int) -> Qwen3VLConfig:
    """A few-MB model with every feature of the real ones (3 vision blocks, 2 DeepStack levels, head_dim 32 with
    4 heads on a width of 96: head_dim * heads != hidden_size, as in the 4B and 32B models)."""
    return Qwen3VLConfig(
        vision=VisionConfig(depth=3, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                            out_hidden_size=96, num_position_embeddings=64, deepstack_visual_indexes=(0, 1)),
        text=TextConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=(6, 5, 5),
                        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False),
        **token_ids,
    )


PRESETS = {
    "tiny": tiny,
    "2b": lambda: _real(_SMALL_VIT, 2048, 6144, 28, 16, True),
    "4b": lambda: _real(_SMALL_VIT, 2560, 9728, 36, 32, True),
    "8b": lambda: _real(_LARGE_VIT, 4096, 12288, 36, 32, False),
    "32b": lambda: _real(_LARGE_VIT, 5120, 25600, 64, 64, False),
}
PRESET_PREFIX = "qwen3-vl-"  # the names the CLI and model.preset use: qwen3-vl-8b


def preset(name: str) -> Qwen3VLConfig:
    """``qwen3-vl-8b`` (or ``8b``, ``tiny``, ``qwen3-vl-tiny``) -> its config."""
    key = name.removeprefix(PRESET_PREFIX)
    try:
        return PRESETS[key]()
    except KeyError:
        raise ValueError(f"unknown Qwen3-VL preset {name!r}; choose one of "
                         f"{sorted(PRESET_PREFIX + k for k in PRESETS)}") from None
