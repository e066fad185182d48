"""Typed configuration of the Qwen2.5-Omni thinker (audio + vision encoders and the language model) and its presets.

The thinker is Qwen2.5-VL's vision encoder and language model plus a Whisper-style
audio encoder. The vision and text parts reuse ``dhp.models.qwen2_5_vl.config``'s
``VisionConfig`` and ``TextConfig`` unchanged, and the attribute names shared with
``Qwen2_5_VLConfig`` (``vision``, ``text``, ``image_token_id``, ``video_token_id``,
``vision_start_token_id``, ``vision_end_token_id``) are spelled the same, so dhp's VL
module code works on this config as it is.

Talker and token2wav (speech output) are out of scope: ``from_hf_dict`` reads the
``thinker_config`` of a full published Qwen2.5-Omni ``config.json`` and ignores the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dhp.models.qwen2_5_vl.config import TextConfig, VisionConfig, _pick, text_hf_dict, vision_hf_dict


@dataclass(frozen=True)
class AudioConfig:
    """Qwen2.5-Omni's audio encoder (transformers' ``Qwen2_5OmniAudioEncoderConfig``; a Whisper-large-v3 encoder).

    ``n_window``: half a chunk, in mel frames: the encoder cuts each clip in chunks of ``2 * n_window`` frames
    and attention never crosses a chunk. transformers does not require it to be even; an even value keeps every
    full chunk's after-conv length even too, so the pairs that pooling averages never straddle a chunk.
    """

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    n_window: int = 100
    output_dim: int = 3584
    max_source_positions: int = 1500
    layer_norm_eps: float = 1e-5  # nn.LayerNorm's default, which transformers uses

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def chunk_frames(self) -> int:
        """Mel frames per attention chunk (the last chunk of a clip may be shorter)."""
        return 2 * self.n_window

    def validate(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"audio d_model {self.d_model} not divisible by encoder_attention_heads "
                             f"{self.encoder_attention_heads}")
        if self.d_model % 2:
            raise ValueError(f"audio d_model {self.d_model} must be even (sinusoidal positions)")
        if self.n_window < 1:
            raise ValueError(f"audio n_window {self.n_window} must be positive")
        if (self.chunk_frames - 1) // 2 + 1 > self.max_source_positions:
            raise ValueError(f"a chunk of {self.chunk_frames} frames needs more than max_source_positions "
                             f"{self.max_source_positions} positions")


@dataclass(frozen=True)
class Qwen2_5OmniConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    text: TextConfig = field(default_factory=TextConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_token_id: int = 151646
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    position_id_per_seconds: int = 25  # TMRoPE: temporal position ids per second (one per 40 ms)
    seconds_per_chunk: float = 2.0  # TMRoPE: audio and video of a clip interleave in chunks this long

    def __post_init__(self) -> None:
        self.vision.validate()
        self.audio.validate()
        self.text.validate()
        widths = {"vision out_hidden_size": self.vision.out_hidden_size, "text hidden_size": self.text.hidden_size,
                  "audio output_dim": self.audio.output_dim}
        if len(set(widths.values())) != 1:
            raise ValueError(f"the encoders must output the language model's width: {widths}")

    def with_tokens(self, **token_ids: int) -> Qwen2_5OmniConfig:
        """The same model with special token ids taken from a tokenizer."""
        return replace(self, **token_ids)

    # ---- Hugging Face config.json ------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """A thinker ``config.json`` (``Qwen2_5OmniThinkerForConditionalGeneration``) as transformers 5 writes it."""
        v, a, t = self.vision, self.audio, self.text
        text = {"model_type": "qwen2_5_omni_text", **text_hf_dict(t)}
        vision = {"model_type": "qwen2_5_omni_vision_encoder", **vision_hf_dict(v),
                  "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
        audio = {
            "model_type": "qwen2_5_omni_audio_encoder",
            "num_mel_bins": a.num_mel_bins,
            "d_model": a.d_model,
            "encoder_layers": a.encoder_layers,
            "encoder_attention_heads": a.encoder_attention_heads,
            "encoder_ffn_dim": a.encoder_ffn_dim,
            "n_window": a.n_window,
            "output_dim": a.output_dim,
            "max_source_positions": a.max_source_positions,
            "activation_function": "gelu",
            "scale_embedding": False,
        }
        return {
            "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
            "model_type": "qwen2_5_omni_thinker",
            "audio_token_index": self.audio_token_id,
            "image_token_index": self.image_token_id,
            "video_token_index": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "audio_start_token_id": self.audio_start_token_id,
            "audio_end_token_id": self.audio_end_token_id,
            "position_id_per_seconds": self.position_id_per_seconds,
            "seconds_per_chunk": _int_if_whole(self.seconds_per_chunk),  # transformers' config field is an int
            "tie_word_embeddings": t.tie_word_embeddings,
            "audio_config": audio,
            "vision_config": vision,
            "text_config": text,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen2_5OmniConfig:
        """Read a thinker ``config.json`` (model_type ``qwen2_5_omni_thinker``) or a full Qwen2.5-Omni one
        (``qwen2_5_omni``: only its ``thinker_config`` is read)."""
        if d.get("model_type") == "qwen2_5_omni" or "thinker_config" in d:
            d = d["thinker_config"]
        if d.get("model_type") not in ("qwen2_5_omni_thinker", None):
            raise ValueError(f"config.json has model_type {d.get('model_type')!r}, expected 'qwen2_5_omni_thinker' "
                             "or 'qwen2_5_omni'")
        return cls(vision=_vision_from_hf(d.get("vision_config") or {}),
                   audio=_audio_from_hf(d.get("audio_config") or {}),
                   text=_text_from_hf(d), **_tokens_from_hf(d))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _text_from_hf(d: dict[str, Any]) -> TextConfig:
    src = dict(d.get("text_config") or {})
    rope = src.get("rope_parameters") or src.get("rope_scaling") or {}
    act = src.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"text hidden_act {act!r} is not supported (Qwen2.5-Omni uses 'silu')")
    # the thinker's own flag is what transformers ties by; the text config's default (True) is not meaningful
    tie = bool(d.get("tie_word_embeddings", src.get("tie_word_embeddings", False)))
    return TextConfig(
        **_pick(TextConfig, src, exclude={"rope_theta", "mrope_section", "tie_word_embeddings"}),
        rope_theta=float(rope.get("rope_theta", src.get("rope_theta", TextConfig.rope_theta))),
        mrope_section=tuple(rope.get("mrope_section", TextConfig.mrope_section)),
        tie_word_embeddings=tie,
    )


def _vision_from_hf(src: dict[str, Any]) -> VisionConfig:
    src = dict(src)
    if "in_chans" in src:  # original checkpoints spell it this way
        src.setdefault("in_channels", src["in_chans"])
    rope = src.get("rope_parameters") or {}
    return VisionConfig(
        **_pick(VisionConfig, src, exclude={"rope_theta", "fullatt_block_indexes"}),
        fullatt_block_indexes=tuple(src.get("fullatt_block_indexes", VisionConfig.fullatt_block_indexes)),
        rope_theta=float(rope.get("rope_theta", VisionConfig.rope_theta)),
    )


def _audio_from_hf(src: dict[str, Any]) -> AudioConfig:
    act = src.get("activation_function", "gelu")
    if act != "gelu":
        raise ValueError(f"audio activation_function {act!r} is not supported (Qwen2.5-Omni uses 'gelu')")
    return AudioConfig(**_pick(AudioConfig, src, exclude={"layer_norm_eps"}))


# our name -> the names config.json may use (transformers 5 writes the *_index spelling for the placeholders)
_TOKEN_KEYS = {
    "image_token_id": ("image_token_id", "image_token_index"),
    "video_token_id": ("video_token_id", "video_token_index"),
    "audio_token_id": ("audio_token_id", "audio_token_index"),
    "vision_start_token_id": ("vision_start_token_id",),
    "vision_end_token_id": ("vision_end_token_id",),
    "audio_start_token_id": ("audio_start_token_id",),
    "audio_end_token_id": ("audio_end_token_id",),
}


def _tokens_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ours, names in _TOKEN_KEYS.items():
        for name in names:
            if d.get(name) is not None:
                out[ours] = int(d[name])
                break
    if "position_id_per_seconds" in d:
        out["position_id_per_seconds"] = d["position_id_per_seconds"]
    if "seconds_per_chunk" in d:
        out["seconds_per_chunk"] = float(d["seconds_per_chunk"])
    return out


def tiny(vocab_size: int = 512, **token_ids: int) -> Qwen2_5OmniConfig:
    """A few-MB thinker with every path of the real one: VL's tiny vision and text, a 2-layer audio encoder with
    chunks of 16 mel frames."""
    from dhp.models.qwen2_5_vl.config import tiny as vl_tiny

    vl = vl_tiny(vocab_size)
    audio = AudioConfig(num_mel_bins=128, d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                        n_window=8, output_dim=vl.text.hidden_size, max_source_positions=1500)
    return Qwen2_5OmniConfig(vision=vl.vision, audio=audio, text=vl.text, **token_ids)


def _real(width: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool) -> Qwen2_5OmniConfig:
    """A published thinker: VL's vision encoder and a Whisper-large-v3 audio encoder, both projecting to
    ``width``, and a Qwen2.5 language model (32k context)."""
    return Qwen2_5OmniConfig(
        vision=VisionConfig(out_hidden_size=width),
        audio=AudioConfig(output_dim=width),
        text=TextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                        tie_word_embeddings=tie),
    )


PRESETS = {
    "tiny": tiny,
    "3b": lambda: _real(2048, 11008, 36, 16, 2, 151936, True),
    "7b": lambda: _real(3584, 18944, 28, 28, 4, 152064, False),
}


def preset(name: str) -> Qwen2_5OmniConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
