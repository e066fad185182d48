"""Qwen2.5-Omni's thinker as a dhp model family: a vision encoder, an audio encoder and a language model.

Three modules, three groups, three cost profiles. The vision encoder and the language model are
Qwen2.5-VL's (the same module specs: build, init, parallelize, encode); what is new here is the audio
encoder's spec (chunk-local attention, so its sequence parallelism cuts at chunk boundaries with no
communication in the forward: ``sequence_parallel.py``), the TMRoPE position ids of the data, and
the whole-model adapters (presets, HF thinker checkpoints). The talker and the vocoder (speech
output) are not part of the thinker and not trained here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dhp.data.loader import cat_to_device
from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig, preset
from dhp.models.qwen2_5_vl.family import LANGUAGE, VISION, check_tokenizer
from dhp.models.spec import Encoder, Family, ParallelizeOptions, SampleInfo
from dhp.ops.attention import host_metadata
from dhp.parallel.sharding import apply_activation_checkpointing, apply_fsdp

if TYPE_CHECKING:
    from dhp.models.adapter import WeightAdapter

PRESET_PREFIX = "omni-"
PRESETS = ("omni-tiny", "omni-3b", "omni-7b")

# ---- audio encoder -------------------------------------------------------------------------------------


def _audio_inputs(samples: list, device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
    """The batch's mel frames [M, F_total] (samples, then clips, in order) and frames per clip."""
    feats = cat_to_device([torch.zeros(samples[0].audio_features.shape[0] if samples else 128, 0)]
                          + [s.audio_features for s in samples], device, dim=1)  # pinned, non-blocking
    with host_metadata():  # clip lengths: host metadata (real even under the planner's FakeTensorMode)
        lens = [int(n) for s in samples for n in s.audio_feature_lens]
    return feats, lens


def encode_audio(module: nn.Module, samples: list, par: Any,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (this rank's audio token embeddings [n, D], their index among the batch's audio tokens: host metadata,
    a CPU tensor)."""
    from dhp.models.qwen2_5_omni.audio import chunk_features

    feats, lens = _audio_inputs(samples, device)
    if par.inner_kind != "sp":
        with host_metadata():
            clip_frames = torch.tensor(lens, dtype=torch.long)
        out = module(feats, clip_frames)  # [N, D], clip order
        with host_metadata():
            return out, torch.arange(out.shape[0])
    from dhp.models.qwen2_5_omni.sequence_parallel import shard_audio, shard_features

    n_window = module.cfg.n_window
    shard = shard_audio(lens, n_window, par.config.sp)[par.inner_rank]
    with host_metadata():
        unit_frames = torch.tensor([sum(u.frames) for u in shard.units], dtype=torch.long)
        segments = torch.tensor(shard.segments(), dtype=torch.long)
        no_chunks = torch.zeros(0, dtype=torch.long)
    if shard.units:
        padded, chunk_lengths = chunk_features(shard_features(feats, lens, shard), unit_frames, n_window)
    else:  # fewer chunks than ranks: this one runs the module on nothing (its gradients are zeros)
        padded, chunk_lengths = feats.new_zeros(0, feats.shape[0], 2 * n_window), no_chunks
    rows = module.encode_chunks(padded, chunk_lengths)  # [rows of my chunks, d_model]
    out = module.pool_project(rows, segments)  # [my tokens, D]
    return out, shard.token_index


def audio_forward_flops(frames: int, cfg: Any) -> float:
    """Forward FLOPs of the audio encoder on one clip of ``frames`` mel frames (matmuls and convolutions).

    Rows after the stem ``R = ceil(F/2)``, width ``d``, MLP ``f``, chunk rows ``r_c``:
    ``2*F*3*M*d`` (conv1) + ``2*R*3*d*d`` (conv2) + ``layers * (2R(4d^2 + 2df) + 4d sum_c r_c^2)`` +
    ``2*(R/2)*d*out`` (projection after pooling)."""
    from dhp.models.qwen2_5_omni.sequence_parallel import after_stem, chunk_frames

    d = cfg.d_model
    rows = after_stem(frames)
    attn = sum(after_stem(f) ** 2 for f in chunk_frames(frames, cfg.n_window))
    layers = cfg.encoder_layers * (2 * rows * (4 * d * d + 2 * d * cfg.encoder_ffn_dim) + 4 * d * attn)
    return float(2 * frames * 3 * cfg.num_mel_bins * d + 2 * rows * 3 * d * d + layers
                 + 2 * (rows // 2) * d * cfg.output_dim)


def audio_sample_flops(info: SampleInfo, model_cfg: Qwen2_5OmniConfig) -> tuple[float, float]:
    """(forward, backward) model FLOPs: backward twice the forward, less conv1's input gradient (mel frames)."""
    fwd = sum(audio_forward_flops(f, model_cfg.audio) for f in info.audio_frames)
    conv1 = sum(2 * f * 3 * model_cfg.audio.num_mel_bins * model_cfg.audio.d_model for f in info.audio_frames)
    return fwd, 2 * fwd - conv1


class Audio(Encoder):
    """The audio encoder and its projection: log-mel clips into audio tokens."""

    name = "audio"
    weight_prefix = "audio"
    seed_offset = 2
    inner = ("sp",)  # any sp: ranks take whole chunks (a rank may get none when a batch has fewer)
    forward_methods = ("encode_chunks", "pool_project")
    modalities = ("audio",)

    def build(self, model_cfg: Qwen2_5OmniConfig) -> nn.Module:
        from dhp.models.qwen2_5_omni.audio import AudioEncoder

        return AudioEncoder(model_cfg.audio)

    def init(self, module: nn.Module, seed: int, transforms: dict | None = None) -> None:
        """Qwen's rule, but He-normal for the conv stem (``audio_init_rule`` says why)."""
        from dhp.models.qwen2_5_omni.audio import init_audio

        init_audio(module, seed, transforms)

    def reset_buffers(self, module: nn.Module) -> None:
        module.reset_buffers()  # the sinusoid position table, a non-persistent buffer

    def set_train_options(self, module: nn.Module, train: Any) -> None:
        module.attention_kernel = train.attention  # packed attention's kernel (auto, sdpa, varlen)

    def placeholder_ids(self, model_cfg: Qwen2_5OmniConfig) -> tuple[int, ...]:
        return (model_cfg.audio_token_id,)

    def parallelize(self, module: nn.Module, par: Any, opts: ParallelizeOptions) -> None:
        """The audio encoder's layout, in the one fixed order."""
        # 1. sequence parallelism: nothing changes in the module; each rank encodes whole chunks (encode_audio)
        # 2. activation checkpointing: each encoder layer recomputed in backward
        if opts.activation_checkpointing:
            apply_activation_checkpointing(module.layers)
        # 3. FSDP2 (ZeRO-3): every layer a unit; the stem, ln_post and proj in the root
        if opts.fsdp_mesh is not None:
            apply_fsdp(module, opts.fsdp_mesh, list(module.layers), mp_policy=opts.mp_policy,
                       forward_methods=self.forward_methods)

    def flops(self, info: SampleInfo, model_cfg: Qwen2_5OmniConfig) -> tuple[float, float]:
        return audio_sample_flops(info, model_cfg)

    def depth_variants(self, model_cfg: Qwen2_5OmniConfig) -> tuple[list[Any], float] | None:
        from dhp.models.qwen2_5_omni.synthetic import depth_variants

        return depth_variants(self.name, model_cfg)

    def encode(self, module: nn.Module, samples: list, par: Any,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        return encode_audio(module, samples, par, device)


AUDIO = Audio()


# ---- the whole model -----------------------------------------------------------------------------------


def _preset_name(name: str) -> str:
    return name.removeprefix(PRESET_PREFIX)


def full_model(model_cfg: Qwen2_5OmniConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    from dhp.models.qwen2_5_omni.model import Qwen2_5OmniThinker

    with torch.device("meta"):
        model = Qwen2_5OmniThinker(model_cfg)
    state = dict(state)
    if model_cfg.text.tie_word_embeddings:
        state.pop("language.lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (model_cfg.text.tie_word_embeddings
                                                      and k == "language.lm_head.weight")}
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise KeyError(f"trained weights: missing keys {missing[:5]}; unknown keys {unknown[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if model_cfg.text.tie_word_embeddings:
        model.language.lm_head.weight = model.language.embed_tokens.weight
    for spec, sub in ((VISION, model.visual), (AUDIO, model.audio), (LANGUAGE, model.language)):
        _to_cpu_buffers(sub)
        spec.reset_buffers(sub)
    return model


def _to_cpu_buffers(module: nn.Module) -> None:
    """Non-persistent buffers are still on meta after ``load_state_dict(assign=True)``: give them CPU storage."""
    for owner in module.modules():
        for name, buf in list(owner._buffers.items()):
            if buf is not None and buf.is_meta:
                owner._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype)


class Qwen2_5OmniFamily(Family):
    """Qwen2.5-Omni's thinker: Qwen2.5-VL's vision encoder, an audio encoder, the language model."""

    name = "qwen2_5_omni"
    encoders = (VISION, AUDIO)
    language = LANGUAGE
    hf_model_types = ("qwen2_5_omni_thinker", "qwen2_5_omni")
    presets = PRESETS

    def model_config(self, cfg: Any, tok: Any) -> Qwen2_5OmniConfig:
        """From ``model.hf_path``'s config.json, or a preset with the tokenizer's token ids."""
        from dhp.models.qwen2_5_omni.processor import audio_token_ids
        from dhp.models.qwen2_5_vl.processor import vision_token_ids

        tokens = vision_token_ids(tok) | audio_token_ids(tok)
        if cfg.model.hf_path:
            from dhp.models.qwen2_5_omni.weights import read_hf_config

            model_cfg = read_hf_config(cfg.model.hf_path)
        elif _preset_name(cfg.model.preset) == "tiny":
            from dhp.models.qwen2_5_omni.config import tiny

            model_cfg = tiny(vocab_size=64 * math.ceil(tok.vocab_size / 64), **tokens)
        else:
            model_cfg = preset(_preset_name(cfg.model.preset)).with_tokens(**tokens)
        check_tokenizer(model_cfg, tok, tokens)
        return model_cfg

    def preset_config(self, name: str) -> Qwen2_5OmniConfig:
        if Path(name).is_dir():
            from dhp.models.qwen2_5_omni.weights import read_hf_config

            return read_hf_config(name)
        return preset(_preset_name(name))

    def describe(self, model_cfg: Qwen2_5OmniConfig) -> list[tuple[str, int, str]]:
        v, a, t = model_cfg.vision, model_cfg.audio, model_cfg.text
        return [
            ("vision encoder + merger", VISION.num_parameters(model_cfg),
             f"depth {v.depth}, hidden {v.hidden_size}, heads {v.num_heads}"),
            ("audio encoder + projection", AUDIO.num_parameters(model_cfg),
             f"layers {a.encoder_layers}, d_model {a.d_model}, heads {a.encoder_attention_heads}, "
             f"{a.num_mel_bins} mel bins, attention chunks of {2 * a.n_window} frames"),
            ("language model + lm_head", LANGUAGE.num_parameters(model_cfg),
             f"layers {t.num_hidden_layers}, hidden {t.hidden_size}, heads {t.num_attention_heads}/"
             f"{t.num_key_value_heads} kv, vocab {t.vocab_size}, tied {t.tie_word_embeddings}"),
        ]

    def synthetic_sample(self, model_cfg: Qwen2_5OmniConfig, media_tokens: dict[str, int], text_tokens: int,
                         index: int = 0) -> Any:
        """An image of ``media_tokens["vision"]`` patches, a clip of ``media_tokens["audio"]`` mel frames, and
        ``text_tokens`` text tokens (``synthetic.py``)."""
        from dhp.models.qwen2_5_omni.synthetic import synthetic_sample

        return synthetic_sample(model_cfg, media_tokens, text_tokens, index)

    def demo_data(self) -> Path:
        """The dial-tone and digit-picture demo set (generated once into the cache)."""
        from dhp.data.omni_demo import ensure_omni_demo_dataset

        return ensure_omni_demo_dataset()

    def processor(self, data_cfg: Any, tokenizer: Any, model_cfg: Qwen2_5OmniConfig) -> Any:
        """Qwen2.5-VL's images and video, Whisper-style log-mel audio, and TMRoPE positions."""
        from dhp.models.qwen2_5_omni.processor import Qwen2_5OmniProcessor

        return Qwen2_5OmniProcessor(data_cfg, tokenizer, model_cfg)

    def full_model(self, model_cfg: Qwen2_5OmniConfig, state: dict[str, torch.Tensor]) -> nn.Module:
        return full_model(model_cfg, state)

    @property
    def weights(self) -> WeightAdapter:
        """The thinker's HF names (full Omni or thinker-only layout), fused tensors, tying, config.json."""
        from dhp.models.qwen2_5_omni.weights import WEIGHTS

        return WEIGHTS


FAMILY = Qwen2_5OmniFamily()
