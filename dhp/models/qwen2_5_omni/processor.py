"""Qwen2.5-Omni's data side: Qwen2.5-VL's images and videos, audio clips as Whisper log-mel, TMRoPE positions.

The audio pipeline of the thinker: files -> 16 kHz mono -> Whisper log-mel -> token counts.

* **Exact token counts before decoding.** ``probe_audio`` reads only the file header and predicts, exactly,
  the length that ``load_audio`` will return after resampling (``dhp.data.audio.resampled_length``), hence
  the number of log-mel frames and of audio placeholder tokens.
* **Parity with the HF processor.** ``log_mel`` reproduces, within 1e-5, what ``Qwen2_5OmniProcessor`` feeds
  the audio tower: ``WhisperFeatureExtractor(feature_size=128)`` with ``padding="max_length"``, i.e. every
  clip zero-padded to 30 s *before* the STFT, the log spectrum clamped at ``max - 8`` with the max taken over
  the padded 30 s, then only the valid frames kept. ``load_audio`` matches ``librosa.load(path, sr=16000,
  mono=True)`` without librosa.
* **No silent truncation.** The HF extractor truncates clips longer than 30 s; dhp raises instead (the
  probe compares the clip's length with ``data.max_audio_seconds`` first).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dhp.data import audio as generic
from dhp.data.audio import AudioError
from dhp.data.processor import Media, Placeholder, Processor
from dhp.data.tokenizer import TokenizerError
from dhp.models.qwen2_5_vl.processor import Images, Videos, VideoSettings, check_geometry, vision_placeholders

SAMPLING_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
CHUNK_SECONDS = 30  # Whisper's window: the HF Qwen2.5-Omni processor pads (or truncates) every clip to it
MAX_SAMPLES = CHUNK_SECONDS * SAMPLING_RATE  # 480000
MAX_FRAMES = MAX_SAMPLES // HOP_LENGTH  # 3000


@dataclass(frozen=True)
class AudioInfo:
    """What the header of an audio file says, and what the thinker will make of it (without decoding it)."""

    path: str
    sample_rate: int  # the file's rate
    channels: int
    frames: int  # at the file's rate
    seconds: float
    samples_16k: int  # len(load_audio(path)): after mixing to mono and resampling to 16 kHz
    feature_frames: int  # valid log-mel frames (capped at 3000 = 30 s)
    num_tokens: int  # audio placeholder tokens in the thinker's sequence


def resampled_length(frames: int, sample_rate: int) -> int:
    """The length of ``frames`` samples at ``sample_rate`` after resampling to 16 kHz (soxr's rule)."""
    return generic.resampled_length(frames, sample_rate, SAMPLING_RATE)


def feature_frames(samples_16k: int) -> int:
    """Valid log-mel frames of a clip of ``samples_16k`` samples, as WhisperFeatureExtractor's attention mask counts
    them: ceil(n / 160), capped at 3000 (30 s)."""
    if samples_16k < 0:
        raise ValueError(f"feature_frames: samples_16k={samples_16k} < 0")
    return min(-(-samples_16k // HOP_LENGTH), MAX_FRAMES)


def audio_tokens(feature_frames: int) -> int:
    """Audio placeholder tokens for ``feature_frames`` log-mel frames (Qwen2.5-Omni's
    ``_get_feat_extract_output_lengths``: the stride-2 conv, then the stride-2 average pool).

    Note that 1 or 2 frames (clips up to 320 samples, 20 ms) give 0 tokens."""
    if feature_frames < 0:
        raise ValueError(f"audio_tokens: feature_frames={feature_frames} < 0")
    after_conv = (feature_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def probe_audio(path: str | os.PathLike) -> AudioInfo:
    """The ``AudioInfo`` of an audio file from its header alone (nothing is decoded).

    Raises AudioError naming the file if it does not exist, cannot be read, or holds no frames."""
    head = generic.read_header(path)
    n16 = resampled_length(head.frames, head.sample_rate)
    frames = feature_frames(n16)
    return AudioInfo(head.path, head.sample_rate, head.channels, head.frames, head.seconds, n16, frames,
                     audio_tokens(frames))


def load_audio(path: str | os.PathLike) -> np.ndarray:
    """Decode an audio file to mono float32 [n] at 16 kHz (``librosa.load(path, sr=16000, mono=True)``)."""
    return generic.load_audio(path, SAMPLING_RATE)


def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log_region] - 15.0))
    return freq


def mel_filter_bank() -> np.ndarray:
    """The Whisper/Qwen2.5-Omni mel filters, float64 [201, 128]: Slaney mel scale, 0..8000 Hz, triangles in Hz,
    Slaney area normalisation (= transformers.audio_utils.mel_filter_bank(201, 128, 0, 8000, 16000,
    norm="slaney", mel_scale="slaney"))."""
    return _mel_filter_bank().copy()


@lru_cache(maxsize=1)
def _mel_filter_bank() -> np.ndarray:
    num_bins = N_FFT // 2 + 1
    mel_edges = np.linspace(_hertz_to_mel(np.array([0.0]))[0], _hertz_to_mel(np.array([8000.0]))[0], N_MELS + 2)
    edges_hz = _mel_to_hertz(mel_edges)  # N_MELS + 2 band edges: filter m rises on [m, m+1], falls on [m+1, m+2]
    bins_hz = np.linspace(0, SAMPLING_RATE // 2, num_bins)
    slopes = edges_hz[None, :] - bins_hz[:, None]  # [201, 130]
    widths = np.diff(edges_hz)
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


@lru_cache(maxsize=1)
def _torch_filters() -> torch.Tensor:
    return torch.from_numpy(_mel_filter_bank()).to(torch.float32)


def log_mel(wave: np.ndarray) -> torch.Tensor:
    """Whisper log-mel features of a 16 kHz mono clip: float32 [128, feature_frames(len(wave))].

    Exactly what the HF Qwen2.5-Omni processor computes (then slices by its attention mask): the clip is
    zero-padded to 30 s, STFT with a periodic Hann window (n_fft 400, hop 160, centred, reflect padding,
    last frame dropped), power spectrum, mel filters, log10 of max(., 1e-10), clamp at (max over the padded
    30 s) - 8, then (x + 4) / 4. No dither, no normalisation. Clips over 30 s raise AudioError."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise AudioError(f"log_mel: expected a mono clip [n], got shape {tuple(wave.shape)}")
    n = wave.shape[0]
    if n == 0:
        raise AudioError("log_mel: the clip is empty (0 samples)")
    if n > MAX_SAMPLES:
        raise AudioError(
            f"log_mel: the clip is {n / SAMPLING_RATE:.2f} s long, over the {CHUNK_SECONDS} s the audio encoder "
            "sees; dhp never truncates: lower data.max_audio_seconds to skip such samples, or cut the file"
        )
    padded = torch.zeros(MAX_SAMPLES, dtype=torch.float32)
    padded[:n] = torch.from_numpy(wave)
    window = torch.hann_window(N_FFT)
    stft = torch.stft(padded, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()  # [201, 3000]
    mel = _torch_filters().T @ power  # [128, 3000]
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    log_spec = (log_spec + 4.0) / 4.0
    return log_spec[:, : feature_frames(n)].contiguous()


def features(path: str | os.PathLike) -> tuple[torch.Tensor, AudioInfo]:
    """probe + load + log_mel: (log-mel [128, info.feature_frames], info) of an audio file.

    Raises AudioError naming the file if it cannot be read, is over 30 s, or decodes to another length than its
    header promised (a truncated or lying file: the token count computed from the header would be wrong)."""
    info = probe_audio(path)
    if info.samples_16k > MAX_SAMPLES:
        raise AudioError(
            f"audio file {info.path} is {info.seconds:.2f} s long, over the {CHUNK_SECONDS} s the audio encoder "
            "sees; dhp never truncates: lower data.max_audio_seconds to skip such samples, or cut the file"
        )
    wave = load_audio(path)
    if wave.shape[0] != info.samples_16k:
        raise AudioError(
            f"audio file {info.path} decodes to {wave.shape[0]} samples at 16 kHz but its header promises "
            f"{info.frames} frames at {info.sample_rate} Hz (= {info.samples_16k}); the file is damaged: re-encode it"
        )
    return log_mel(wave), info


# ---- the processor -----------------------------------------------------------------------------------------


class AudioClips(Media):
    """Audio clips: ``audio_features`` [128, frames of all clips] (log-mel, clips in time order) and
    ``audio_feature_lens`` [A] (frames per clip)."""

    kind, noun = "audio", "audio clip"

    def __init__(self, placeholder: Placeholder, max_seconds: float) -> None:
        self.placeholder, self.max_seconds = placeholder, max_seconds

    def probe(self, source: Path) -> AudioInfo:
        info = probe_audio(source)
        if info.num_tokens == 0:
            raise AudioError(f"audio {source} lasts {info.seconds * 1000:.0f} ms: too short for one audio token (the "
                             "encoder needs more than 20 ms); drop the clip or the sample")
        if info.seconds > self.max_seconds:
            raise AudioError(f"audio {source} lasts {info.seconds:.2f} s, longer than data.max_audio_seconds="
                             f"{self.max_seconds:g} (clips are never cut); cut the clip, or raise "
                             f"data.max_audio_seconds (at most {CHUNK_SECONDS})")
        return info

    def num_tokens(self, fact: AudioInfo) -> int:
        return fact.num_tokens

    def decode(self, source: Path, fact: AudioInfo) -> torch.Tensor:
        mel, _ = features(source)
        if mel.shape[1] != fact.feature_frames:
            raise AudioError(f"audio {source} changed since validation ({mel.shape[1]} frames, "
                             f"{fact.feature_frames} before)")
        return mel

    def collate(self, facts: Sequence[Any], decoded: Sequence[Any] | None) -> dict[str, torch.Tensor]:
        return {"audio_features": torch.cat(list(decoded), dim=1) if decoded else torch.zeros(N_MELS, 0),
                "audio_feature_lens": torch.tensor([f.feature_frames for f in facts], dtype=torch.long).reshape(-1)}

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        return {"audio_frames": tuple(f.feature_frames for f in facts)}  # what the audio encoder's cost reads

    def shrink_hint(self) -> str:
        return "shorten the audio clips"


AUDIO_TOKENS = {"audio_token_id": "<|AUDIO|>", "audio_start_token_id": "<|audio_bos|>",
                "audio_end_token_id": "<|audio_eos|>"}  # the model config's audio token ids -> their spellings


def audio_token_ids(tokenizer: Any) -> dict[str, int]:
    """The audio token ids of a model config, from the tokenizer; raises TokenizerError without them."""
    if not tokenizer.has(*AUDIO_TOKENS.values()):
        raise TokenizerError(f"tokenizer {tokenizer.path} has no audio tokens ({', '.join(AUDIO_TOKENS.values())}); "
                             "use a Qwen2.5-Omni tokenizer")
    return tokenizer.ids(AUDIO_TOKENS, "use a Qwen2.5-Omni tokenizer")


def audio_placeholder(tokenizer: Any) -> Placeholder:
    """``<|audio_bos|>``, ``<|AUDIO|>`` per token, ``<|audio_eos|>``; raises TokenizerError without them."""
    ids = audio_token_ids(tokenizer)
    return Placeholder(ids["audio_token_id"], (ids["audio_start_token_id"],), (ids["audio_end_token_id"],))


class Qwen2_5OmniProcessor(Processor):
    """Images, videos and audio clips; TMRoPE position ids [3, L] (``rope.omni_rope_index``), which need the
    model config (its token ids, ``position_id_per_seconds``, ``seconds_per_chunk``)."""

    family = "qwen2_5_omni"

    def __init__(self, data_cfg: Any, tokenizer: Any, model_cfg: Any) -> None:
        check_geometry(model_cfg)
        image, video = vision_placeholders(tokenizer)
        self.media = (Images(image, data_cfg.min_pixels, data_cfg.max_pixels),
                      Videos(video, VideoSettings.from_data(data_cfg)),
                      AudioClips(audio_placeholder(tokenizer), data_cfg.max_audio_seconds))
        self.model_cfg = model_cfg

    def position_ids(self, sample: Any) -> torch.Tensor:
        from dhp.models.qwen2_5_omni.rope import omni_rope_index

        def some(t: torch.Tensor) -> torch.Tensor | None:
            return t if t.shape[0] else None

        return omni_rope_index(sample.input_ids[None], some(sample.image_grid_thw), some(sample.video_grid_thw),
                               some(sample.audio_feature_lens), some(sample.second_per_grid_ts),
                               self.model_cfg)[:, 0]


def audio_token_counts(sample: Any) -> list[int]:
    """Audio placeholder tokens per clip of a decoded sample (``<|AUDIO|>`` slots), from its frame counts."""
    return [audio_tokens(int(n)) for n in sample.audio_feature_lens]
