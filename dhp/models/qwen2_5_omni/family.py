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
from typing import Any

import torch
from torch import nn

from dhp.models.layers import host_metadata
from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig, preset
from dhp.models.qwen2_5_vl.family import FAMILY as QWEN_VL
from dhp.models.qwen2_5_vl.family import LANGUAGE, VISION
from dhp.models.spec import EncoderSpec, FamilySpec, ParallelizeOptions, SampleInfo
from dhp.parallel.sharding import apply_activation_checkpointing, apply_fsdp

PRESET_PREFIX = "omni-"
PRESETS = ("omni-tiny", "omni-3b", "omni-7b")

# ---- audio encoder -------------------------------------------------------------------------------------


def build_audio(model_cfg: Qwen2_5OmniConfig) -> nn.Module:
    from dhp.models.qwen2_5_omni.audio import AudioEncoder

    return AudioEncoder(model_cfg.audio)


def init_audio(module: nn.Module, seed: int, transforms: dict | None = None) -> None:
    """Each parameter from ``(seed, its name)`` on whatever shard this rank holds (as every family module)."""
    from dhp.models.qwen2_5_omni.audio import init_audio as init

    init(module, seed, transforms)


def parallelize_audio(module: nn.Module, par: Any, opts: ParallelizeOptions) -> None:
    """The audio encoder's layout, in the one fixed order."""
    # 1. sequence parallelism: nothing changes in the module; each rank encodes whole chunks (encode_audio)
    # 2. activation checkpointing: each encoder layer recomputed in backward
    if opts.activation_checkpointing:
        apply_activation_checkpointing(module.layers)
    # 3. FSDP2 (ZeRO-3): every layer a unit; the stem, ln_post and proj in the root
    if opts.fsdp_mesh is not None:
        apply_fsdp(module, opts.fsdp_mesh, list(module.layers), mp_policy=opts.mp_policy,
                   forward_methods=("encode_chunks", "pool_project"))


def _audio_inputs(samples: list, device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
    """The batch's mel frames [M, F_total] (samples, then clips, in order) and frames per clip."""
    feats = torch.cat([torch.zeros(samples[0].audio_features.shape[0] if samples else 128, 0)]
                      + [s.audio_features for s in samples], dim=1).to(device)
    lens = [int(n) for s in samples for n in s.audio_feature_lens]
    return feats, lens


def encode_audio(module: nn.Module, samples: list, par: Any,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (this rank's audio token embeddings [n, D], their index among the batch's audio tokens: host metadata,
    a CPU tensor)."""
    from dhp.models.qwen2_5_omni.audio import chunk_features

    feats, lens = _audio_inputs(samples, device)
    if par.inner_kind != "sp":
        out = module(feats, torch.tensor(lens, dtype=torch.long))  # [N, D], clip order
        with host_metadata():
            return out, torch.arange(out.shape[0])
    from dhp.models.qwen2_5_omni.sequence_parallel import shard_audio, shard_features

    n_window = module.cfg.n_window
    shard = shard_audio(lens, n_window, par.spec.sp)[par.inner_rank]
    if shard.units:
        unit_frames = torch.tensor([sum(u.frames) for u in shard.units], dtype=torch.long)
        padded, chunk_lengths = chunk_features(shard_features(feats, lens, shard), unit_frames, n_window)
    else:  # fewer chunks than ranks: this one runs the module on nothing (its gradients are zeros)
        padded, chunk_lengths = feats.new_zeros(0, feats.shape[0], 2 * n_window), torch.zeros(0, dtype=torch.long)
    rows = module.encode_chunks(padded, chunk_lengths)  # [rows of my chunks, d_model]
    out = module.pool_project(rows, torch.tensor(shard.segments(), dtype=torch.long))  # [my tokens, D]
    return out, shard.token_index


def check_audio_layout(model_cfg: Qwen2_5OmniConfig, sp: int, tp: int) -> str | None:
    return None  # any sp: ranks take whole chunks (a rank may get none when a batch has fewer)


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


def audio_cost(info: SampleInfo, model_cfg: Qwen2_5OmniConfig) -> float:
    """What the audio group balances: the forward FLOPs of the sample's clips."""
    return sum(audio_forward_flops(f, model_cfg.audio) for f in info.audio_frames)


def audio_sample_flops(info: SampleInfo, model_cfg: Qwen2_5OmniConfig) -> tuple[float, float]:
    """(forward, backward) model FLOPs: backward twice the forward, less conv1's input gradient (mel frames)."""
    fwd = audio_cost(info, model_cfg)
    conv1 = sum(2 * f * 3 * model_cfg.audio.num_mel_bins * model_cfg.audio.d_model for f in info.audio_frames)
    return fwd, 2 * fwd - conv1


def audio_tokens(info: SampleInfo, model_cfg: Qwen2_5OmniConfig) -> int:
    from dhp.data.audio import audio_tokens as tokens_of

    return sum(tokens_of(f) for f in info.audio_frames)


def reset_audio_buffers(module: nn.Module) -> None:
    """Recompute the sinusoid position table (a non-persistent buffer) after ``to_empty``."""
    module.reset_buffers()


AUDIO = EncoderSpec(
    name="audio",
    weight_prefix="audio",
    build=build_audio,
    init=init_audio,
    parallelize=parallelize_audio,
    seed_offset=2,
    inner=("sp",),
    check_layout=check_audio_layout,
    forward_methods=("encode_chunks", "pool_project"),
    reset_buffers=reset_audio_buffers,
    cost=audio_cost,
    flops=audio_sample_flops,
    num_tokens=lambda sample, model_cfg: sample.num_audio_tokens,
    token_id=lambda model_cfg: model_cfg.audio_token_id,
    encode=encode_audio,
    info_tokens=audio_tokens,
    modalities=("audio",),
)


# ---- the whole model -----------------------------------------------------------------------------------


def _preset_name(name: str) -> str:
    return name.removeprefix(PRESET_PREFIX)


def model_config(cfg: Any, tok: Any) -> Qwen2_5OmniConfig:
    """The model config: from ``model.hf_path``'s config.json, or a preset with the tokenizer's token ids.

    Raises ValueError naming the key when the tokenizer does not fit the model."""
    tokens = tok.special_token_ids() | tok.audio_token_ids()
    if cfg.model.hf_path:
        from dhp.models.qwen2_5_omni.weights import read_hf_config

        model_cfg = read_hf_config(cfg.model.hf_path)
    elif _preset_name(cfg.model.preset) == "tiny":
        from dhp.models.qwen2_5_omni.config import tiny

        model_cfg = tiny(vocab_size=64 * math.ceil(tok.vocab_size / 64), **tokens)
    else:
        model_cfg = preset(_preset_name(cfg.model.preset)).with_tokens(**tokens)
    if tok.vocab_size > model_cfg.text.vocab_size:
        raise ValueError(f"data.tokenizer: {tok.path} has {tok.vocab_size} tokens but the model's vocabulary has "
                         f"{model_cfg.text.vocab_size}; use the model's own tokenizer")
    for name, tid in tokens.items():
        if getattr(model_cfg, name) != tid:
            raise ValueError(f"data.tokenizer: {tok.path} gives {name}={tid} but the model expects "
                             f"{getattr(model_cfg, name)}; use the model's own tokenizer")
    return model_cfg


def position_ids(model_cfg: Qwen2_5OmniConfig, sample: Any) -> torch.Tensor:
    """TMRoPE position ids [3, L] of one sample (its ids, image/video grids, audio clip lengths)."""
    from dhp.models.qwen2_5_omni.rope import omni_rope_index

    def some(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is not None and t.shape[0] else None

    return omni_rope_index(sample.input_ids[None], some(sample.image_grid_thw), some(sample.video_grid_thw),
                           some(sample.audio_feature_lens), some(sample.second_per_grid_ts), model_cfg)[:, 0]


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


def save_hf(model: nn.Module, out: Path) -> None:
    from dhp.models.qwen2_5_omni.weights import save_hf_checkpoint

    save_hf_checkpoint(model, out)


def load_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    from dhp.models.qwen2_5_omni.weights import load_hf_state_dict

    return load_hf_state_dict(path)


def hf_key(key: str) -> str:
    from dhp.models.qwen2_5_omni.weights import dhp_to_hf_key

    return dhp_to_hf_key(key)


def describe(model_cfg: Qwen2_5OmniConfig) -> list[tuple[str, int, str]]:
    from dhp.models.qwen2_5_vl.model import count_parameters

    with torch.device("meta"):
        vision, audio, text = VISION.build(model_cfg), AUDIO.build(model_cfg), LANGUAGE.build(model_cfg)
    v, a, t = model_cfg.vision, model_cfg.audio, model_cfg.text
    return [
        ("vision encoder + merger", count_parameters(vision),
         f"depth {v.depth}, hidden {v.hidden_size}, heads {v.num_heads}"),
        ("audio encoder + projection", count_parameters(audio),
         f"layers {a.encoder_layers}, d_model {a.d_model}, heads {a.encoder_attention_heads}, "
         f"{a.num_mel_bins} mel bins, attention chunks of {2 * a.n_window} frames"),
        ("language model + lm_head", count_parameters(text),
         f"layers {t.num_hidden_layers}, hidden {t.hidden_size}, heads {t.num_attention_heads}/"
         f"{t.num_key_value_heads} kv, vocab {t.vocab_size}, tied {t.tie_word_embeddings}"),
    ]


def preset_config(name: str) -> Qwen2_5OmniConfig:
    if Path(name).is_dir():
        from dhp.models.qwen2_5_omni.weights import read_hf_config

        return read_hf_config(name)
    return preset(_preset_name(name))


def demo_data() -> Path:
    """The dial-tone and digit-picture demo set (generated once into the cache)."""
    from dhp.data.omni_demo import ensure_omni_demo_dataset

    return ensure_omni_demo_dataset()


FAMILY = FamilySpec(
    name="qwen2_5_omni",
    encoders=(VISION, AUDIO),
    language=LANGUAGE,
    hf_model_types=("qwen2_5_omni_thinker", "qwen2_5_omni"),
    presets=PRESETS,
    model_config=model_config,
    load_hf_state=load_hf_state,
    full_model=full_model,
    save_hf=save_hf,
    describe=describe,
    hf_key=hf_key,
    hf_config=QWEN_VL.hf_config,  # model_cfg.to_hf_dict() plus the dtype: the same rule
    tied=QWEN_VL.tied,  # lm_head shares embed_tokens when the text config ties them
    preset_config=preset_config,
    position_ids=position_ids,
    demo_data=demo_data,
)
