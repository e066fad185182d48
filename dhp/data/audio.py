"""Audio files for any family's processor: the header without decoding, and decoding to mono at a given rate.

Why a module of its own, and why it looks like this:

* **Exact lengths before decoding.** Packing and load balancing need each sample's sequence length before
  any audio is decoded. ``read_header`` reads only the file header, and ``resampled_length`` predicts,
  exactly, the length that ``load_audio`` will return after resampling (the rule is soxr's own output-length
  rule, found by measurement and checked by the tests on many lengths and rates). What a family makes of
  the samples (its features, its token count) is its processor's.
* **librosa's result without librosa.** ``load_audio(path, rate)`` matches ``librosa.load(path, sr=rate,
  mono=True)``: channel average, soxr "HQ" resampling.
* **A leaf library.** numpy, soundfile and soxr only (plus ``dhp.errors``). Nothing happens at import time.
  A clip is a path or an open file object (a clip in an object store, fetched by ``dhp.storage.open_media``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf
import soxr

from dhp.data.processor import MediaError
from dhp.errors import DataError

RESAMPLE_QUALITY = "HQ"  # librosa.load's default res_type "soxr_hq"


class AudioError(DataError, MediaError):
    """An audio file or clip that cannot be used; the message names the file (a ``ValueError`` and a ``DataError``)."""


@dataclass(frozen=True)
class AudioHeader:
    """What the header of an audio file says (nothing decoded)."""

    path: str
    sample_rate: int  # the file's rate
    channels: int
    frames: int  # at the file's rate

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def resampled_length(frames: int, sample_rate: int, rate: int) -> int:
    """The length soxr.resample(x, sample_rate, rate) returns for ``frames`` input samples.

    Measured on soxr 1.x ("HQ"; lengths 1..3e6 at 6000..192000 Hz to 16 kHz, integer and odd rates alike): the
    output length is ``frames * rate / sample_rate`` rounded half *up* (not to even), computed here in exact
    integers. At the same rate the input is returned unchanged (as librosa does), which is the same rule.
    """
    if frames < 0 or sample_rate <= 0 or rate <= 0:
        raise ValueError(f"resampled_length: frames={frames}, sample_rate={sample_rate}, rate={rate}")
    return (2 * frames * rate + sample_rate) // (2 * sample_rate)


def _describe(path: str | os.PathLike) -> str:
    return f"audio file {os.fspath(path)!s}"


def _opened(path: Any) -> tuple[str, Any]:
    """(the file's name, what soundfile opens): a path, or an open file object (a medium fetched from an object
    store, ``dhp.storage.MediaFile``; its ``str`` is its URL). Raises AudioError for a local file that is missing."""
    if hasattr(path, "read"):
        return str(path), path
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise AudioError(f"{_describe(name)} does not exist (or is not a file); check the path in the data file")
    return name, name


def read_header(path: str | os.PathLike | Any) -> AudioHeader:
    """The ``AudioHeader`` of an audio file or open file object (soundfile.info; nothing is decoded).

    Raises AudioError naming the file if it does not exist, cannot be read (soundfile's message is given), or
    holds no frames."""
    name, source = _opened(path)
    try:
        info = sf.info(source)
    except (sf.SoundFileError, OSError) as e:
        raise AudioError(f"{_describe(name)} cannot be read: {e}; is it a WAV, FLAC or OGG file?") from e
    if info.frames <= 0:
        raise AudioError(f"{_describe(name)} is empty (0 frames); remove the sample or replace the file")
    return AudioHeader(name, int(info.samplerate), int(info.channels), int(info.frames))


def to_mono(data: np.ndarray) -> np.ndarray:
    """[frames, channels] -> [frames] float32, contiguous: the channel average (librosa.to_mono)."""
    if data.shape[1] == 1:
        return np.ascontiguousarray(data[:, 0], dtype=np.float32)
    return np.ascontiguousarray(data.mean(axis=1, dtype=np.float32))


def resample(wave: np.ndarray, sample_rate: int, rate: int) -> np.ndarray:
    """Mono float32 [n] at ``sample_rate`` -> float32 [resampled_length(n, sample_rate, rate)] (soxr "HQ")."""
    if sample_rate == rate:
        return wave
    return soxr.resample(wave, sample_rate, rate, quality=RESAMPLE_QUALITY)


def load_audio(path: str | os.PathLike | Any, rate: int) -> np.ndarray:
    """Decode an audio file (WAV, FLAC, OGG, ... through libsndfile) to mono float32 [n] at ``rate`` Hz.

    Same as ``librosa.load(path, sr=rate, mono=True)``: channels averaged, then soxr "HQ" resampling."""
    name, source = _opened(path)
    try:
        data, file_rate = sf.read(source, dtype="float32", always_2d=True)
    except (sf.SoundFileError, OSError) as e:
        raise AudioError(f"{_describe(name)} cannot be decoded: {e}; is it a WAV, FLAC or OGG file?") from e
    if data.shape[0] == 0:
        raise AudioError(f"{_describe(name)} is empty (0 frames); remove the sample or replace the file")
    return resample(to_mono(data), int(file_rate), rate)
