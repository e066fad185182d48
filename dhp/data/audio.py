"""The audio input pipeline of Qwen2.5-Omni's thinker: files -> 16 kHz mono -> Whisper log-mel -> token counts.

Why a module of its own, and why it looks like this:

* **Exact token counts before decoding.** Packing and load balancing need each sample's sequence length
  before any audio is decoded. ``probe_audio`` reads only the file header and predicts, exactly, the length
  that ``load_audio`` will return after resampling (the rule is soxr's own output-length rule, found by
  measurement and checked by the tests on many lengths and rates), hence the number of log-mel frames and of
  audio placeholder tokens.
* **Parity with the HF processor.** ``log_mel`` reproduces, within 1e-5, what
  ``Qwen2_5OmniProcessor`` feeds the audio tower: ``WhisperFeatureExtractor(feature_size=128)`` with
  ``padding="max_length"``, i.e. every clip zero-padded to 30 s *before* the STFT, the log spectrum clamped at
  ``max - 8`` with the max taken over the padded 30 s, then only the valid frames kept. ``load_audio`` matches
  ``librosa.load(path, sr=16000, mono=True)`` (channel average, soxr "HQ" resampling) without librosa.
* **A leaf library.** numpy, torch, soundfile and soxr only (plus ``dhp.errors``); transformers is a test
  dependency and never imported here. Nothing happens at import time.
* **No silent truncation.** The HF extractor truncates clips longer than 30 s; dhp raises instead (the
  caller compares ``AudioInfo.seconds`` with ``data.max_audio_seconds`` first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import soundfile as sf
import soxr
import torch

from dhp.errors import DataError

SAMPLING_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
CHUNK_SECONDS = 30  # Whisper's window: the HF Qwen2.5-Omni processor pads (or truncates) every clip to it
MAX_SAMPLES = CHUNK_SECONDS * SAMPLING_RATE  # 480000
MAX_FRAMES = MAX_SAMPLES // HOP_LENGTH  # 3000
RESAMPLE_QUALITY = "HQ"  # librosa.load's default res_type "soxr_hq"


class AudioError(DataError):
    """An audio file or clip that cannot be used; the message names the file (a ``ValueError`` and a ``DataError``)."""


@dataclass(frozen=True)
class AudioInfo:
    """What the header of an audio file says, and what dhp will make of it (without decoding it)."""

    path: str
    sample_rate: int  # the file's rate
    channels: int
    frames: int  # at the file's rate
    seconds: float
    samples_16k: int  # len(load_audio(path)): after mixing to mono and resampling to 16 kHz
    feature_frames: int  # valid log-mel frames (capped at 3000 = 30 s)
    num_tokens: int  # audio placeholder tokens in the thinker's sequence


def resampled_length(frames: int, sample_rate: int) -> int:
    """The length soxr.resample(x, sample_rate, 16000) returns for ``frames`` input samples.

    Measured on soxr 1.x ("HQ"; lengths 1..3e6 at 6000..192000 Hz, integer and odd rates alike): the output
    length is ``frames * 16000 / sample_rate`` rounded half *up* (not to even), computed here in exact integers.
    At 16 kHz the input is returned unchanged (as librosa does), which is the same rule.
    """
    if frames < 0 or sample_rate <= 0:
        raise ValueError(f"resampled_length: frames={frames}, sample_rate={sample_rate}")
    return (2 * frames * SAMPLING_RATE + sample_rate) // (2 * sample_rate)


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


def _describe(path: str | os.PathLike) -> str:
    return f"audio file {os.fspath(path)!s}"


def probe_audio(path: str | os.PathLike) -> AudioInfo:
    """The ``AudioInfo`` of an audio file from its header alone (soundfile.info; nothing is decoded).

    Raises AudioError naming the file if it does not exist, cannot be read (soundfile's message is given), or
    holds no frames."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise AudioError(f"{_describe(name)} does not exist (or is not a file); check the path in the data file")
    try:
        info = sf.info(name)
    except (sf.SoundFileError, OSError) as e:
        raise AudioError(f"{_describe(name)} cannot be read: {e}; is it a WAV, FLAC or OGG file?") from e
    if info.frames <= 0:
        raise AudioError(f"{_describe(name)} is empty (0 frames); remove the sample or replace the file")
    n16 = resampled_length(info.frames, info.samplerate)
    frames = feature_frames(n16)
    return AudioInfo(
        path=name,
        sample_rate=int(info.samplerate),
        channels=int(info.channels),
        frames=int(info.frames),
        seconds=info.frames / info.samplerate,
        samples_16k=n16,
        feature_frames=frames,
        num_tokens=audio_tokens(frames),
    )


def to_mono(data: np.ndarray) -> np.ndarray:
    """[frames, channels] -> [frames] float32, contiguous: the channel average (librosa.to_mono)."""
    if data.shape[1] == 1:
        return np.ascontiguousarray(data[:, 0], dtype=np.float32)
    return np.ascontiguousarray(data.mean(axis=1, dtype=np.float32))


def resample_16k(wave: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 [n] at ``sample_rate`` -> float32 [resampled_length(n, sample_rate)] at 16 kHz (soxr "HQ")."""
    if sample_rate == SAMPLING_RATE:
        return wave
    return soxr.resample(wave, sample_rate, SAMPLING_RATE, quality=RESAMPLE_QUALITY)


def load_audio(path: str | os.PathLike) -> np.ndarray:
    """Decode an audio file (WAV, FLAC, OGG, ... through libsndfile) to mono float32 [n] at 16 kHz.

    Same as ``librosa.load(path, sr=16000, mono=True)``: channels averaged, then soxr "HQ" resampling."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise AudioError(f"{_describe(name)} does not exist (or is not a file); check the path in the data file")
    try:
        data, rate = sf.read(name, dtype="float32", always_2d=True)
    except (sf.SoundFileError, OSError) as e:
        raise AudioError(f"{_describe(name)} cannot be decoded: {e}; is it a WAV, FLAC or OGG file?") from e
    if data.shape[0] == 0:
        raise AudioError(f"{_describe(name)} is empty (0 frames); remove the sample or replace the file")
    return resample_16k(to_mono(data), int(rate))


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
            f"{_describe(info.path)} is {info.seconds:.2f} s long, over the {CHUNK_SECONDS} s the audio encoder sees;"
            " dhp never truncates: lower data.max_audio_seconds to skip such samples, or cut the file"
        )
    wave = load_audio(path)
    if wave.shape[0] != info.samples_16k:
        raise AudioError(
            f"{_describe(info.path)} decodes to {wave.shape[0]} samples at 16 kHz but its header promises "
            f"{info.frames} frames at {info.sample_rate} Hz (= {info.samples_16k}); the file is damaged: re-encode it"
        )
    return log_mel(wave), info


__all__ = [
    "CHUNK_SECONDS",
    "HOP_LENGTH",
    "MAX_FRAMES",
    "MAX_SAMPLES",
    "N_FFT",
    "N_MELS",
    "SAMPLING_RATE",
    "AudioError",
    "AudioInfo",
    "audio_tokens",
    "feature_frames",
    "features",
    "load_audio",
    "log_mel",
    "mel_filter_bank",
    "probe_audio",
    "resample_16k",
    "resampled_length",
    "to_mono",
]
