"""A synthetic, offline "which digits were dialed?" audio corpus: telephone-keypad (DTMF) tones.

Why: the audio pipeline (files -> 16 kHz log-mel -> Qwen2.5-Omni's audio tower) needs a demo and test corpus
that is tiny, made on the spot without downloads, and still a real task with a checkable answer. A DTMF clip
encodes its digits unambiguously (one row and one column tone per key), so a model can learn to transcribe it
and a 40-line Goertzel decoder (``dtmf_digits``, used by the tests only) can prove each clip encodes what its
label says. Clips are made at the telephone rate, 8 kHz, so that the loader's resampling is exercised, and some
are written as FLAC so that both decoders are. Everything is deterministic given the ``numpy`` Generator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

ROWS_HZ = (697.0, 770.0, 852.0, 941.0)
COLS_HZ = (1209.0, 1336.0, 1477.0)
KEYS = {  # digit -> (row, column) on the keypad
    "1": (0, 0), "2": (0, 1), "3": (0, 2),
    "4": (1, 0), "5": (1, 1), "6": (1, 2),
    "7": (2, 0), "8": (2, 1), "9": (2, 2),
    "0": (3, 1),
}  # fmt: skip
TELEPHONE_RATE = 8000
TONE_SECONDS = (0.12, 0.25)
GAP_SECONDS = (0.05, 0.2)
EDGE_SECONDS = (0.05, 0.3)  # leading and trailing silence
AMPLITUDE = (0.2, 0.6)  # of each of the two sines of a key
SNR_DB = (10.0, 30.0)
PEAK = 0.95
FADE_SECONDS = 0.005  # raised-cosine ramps: no clicks at tone edges


@dataclass(frozen=True)
class DtmfClip:
    """One written clip of the corpus."""

    path: str
    digits: str
    sample_rate: int
    seconds: float


def key_frequencies(digit: str) -> tuple[float, float]:
    """(row Hz, column Hz) of a key 0-9."""
    if digit not in KEYS:
        raise ValueError(f"dtmf: {digit!r} is not a key 0-9")
    row, col = KEYS[digit]
    return ROWS_HZ[row], COLS_HZ[col]


def _uniform_samples(rng: np.random.Generator, seconds: tuple[float, float], sample_rate: int) -> int:
    return int(round(rng.uniform(*seconds) * sample_rate))


def _tone(digit: str, n: int, amplitude: float, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    """One key press: the sum of its row and column sines (random phases), with short fades at both ends."""
    t = np.arange(n) / sample_rate
    low, high = key_frequencies(digit)
    phases = rng.uniform(0.0, 2 * np.pi, 2)
    wave = amplitude * (np.sin(2 * np.pi * low * t + phases[0]) + np.sin(2 * np.pi * high * t + phases[1]))
    ramp = min(int(FADE_SECONDS * sample_rate), n // 2)
    if ramp > 0:
        fade = 0.5 - 0.5 * np.cos(np.pi * np.arange(ramp) / ramp)
        wave[:ramp] *= fade
        wave[n - ramp :] *= fade[::-1]
    return wave


def dial(digits: str, rng: np.random.Generator, sample_rate: int = TELEPHONE_RATE,
         slot_seconds: float | None = None, tone_seconds: tuple[float, float] = TONE_SECONDS) -> np.ndarray:
    """A noisy recording of ``digits`` being dialed: float32 [n] at ``sample_rate``, peak below 1.

    Each key is a tone of random length (0.12-0.25 s), keys are separated by random gaps (0.05-0.2 s), with
    random leading/trailing silence (0.05-0.3 s), a random level and white noise at a random SNR (10-30 dB).

    ``slot_seconds``: an auto-dialer's cadence instead: key ``k`` sounds in its own slot ``[k*slot, (k+1)*slot)``,
    its tone of random length (``tone_seconds``) after a random delay (up to half the slot's slack), the rest of
    the slot silent, so gaps vary too; leading and trailing silence 0.02-0.05 s. A key's place in the sequence
    is then where it is in time, as a digit's place in a picture of digits is where it is in space."""
    if not digits or any(d not in KEYS for d in digits):
        raise ValueError(f"dial: digits must be a non-empty string of 0-9, got {digits!r}")
    if slot_seconds is not None and slot_seconds < tone_seconds[1] + 0.03:
        raise ValueError(f"dial: slot_seconds={slot_seconds} leaves no gap after a {tone_seconds[1]} s tone")
    amplitude = rng.uniform(*AMPLITUDE)
    edge = EDGE_SECONDS if slot_seconds is None else (0.02, 0.05)
    pieces = [np.zeros(_uniform_samples(rng, edge, sample_rate))]
    for i, digit in enumerate(digits):
        if slot_seconds is None:
            if i:
                pieces.append(np.zeros(_uniform_samples(rng, GAP_SECONDS, sample_rate)))
            pieces.append(_tone(digit, _uniform_samples(rng, tone_seconds, sample_rate), amplitude, rng,
                                sample_rate))
            continue
        tone = _tone(digit, _uniform_samples(rng, tone_seconds, sample_rate), amplitude, rng, sample_rate)
        slack = int(round(slot_seconds * sample_rate)) - tone.shape[0]
        delay = int(rng.integers(0, max(1, slack // 2)))
        slot = np.zeros(int(round(slot_seconds * sample_rate)))
        slot[delay:delay + tone.shape[0]] = tone
        pieces.append(slot)
    pieces.append(np.zeros(_uniform_samples(rng, edge, sample_rate)))
    clean = np.concatenate(pieces)
    tone_power = amplitude**2  # two sines of amplitude a: a^2 / 2 each
    noise_power = tone_power / 10 ** (rng.uniform(*SNR_DB) / 10)
    noisy = clean + rng.normal(0.0, np.sqrt(noise_power), clean.shape[0])
    peak = np.abs(noisy).max()
    if peak > PEAK:
        noisy *= PEAK / peak
    return noisy.astype(np.float32)


def random_digits(rng: np.random.Generator, min_len: int = 3, max_len: int = 8) -> str:
    """A random digit string of ``min_len``..``max_len`` keys."""
    n = int(rng.integers(min_len, max_len + 1))
    return "".join(str(d) for d in rng.integers(0, 10, n))


def write_wav(path: str | os.PathLike, wave: np.ndarray, sample_rate: int, fmt: str = "WAV") -> Path:
    """Write a mono clip as 16-bit PCM (``fmt`` "WAV" or "FLAC"); returns the path."""
    path = Path(path)
    sf.write(path, np.asarray(wave, dtype=np.float32), sample_rate, subtype="PCM_16", format=fmt)
    return path


def write_flac(path: str | os.PathLike, wave: np.ndarray, sample_rate: int) -> Path:
    """Write a mono clip as 16-bit FLAC; returns the path."""
    return write_wav(path, wave, sample_rate, fmt="FLAC")


def write_corpus(directory: str | os.PathLike, count: int, seed: int = 0, flac_every: int = 3) -> list[DtmfClip]:
    """Write ``count`` clips (``dtmf_00000.wav``, ...; every ``flac_every``-th one a FLAC) under ``directory``."""
    rng = np.random.default_rng(seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    clips = []
    for i in range(count):
        digits = random_digits(rng)
        wave = dial(digits, rng)
        fmt = "FLAC" if flac_every and i % flac_every == flac_every - 1 else "WAV"
        path = write_wav(out / f"dtmf_{i:05d}.{fmt.lower()}", wave, TELEPHONE_RATE, fmt=fmt)
        clips.append(DtmfClip(str(path), digits, TELEPHONE_RATE, wave.shape[0] / TELEPHONE_RATE))
    return clips


def _goertzel_power(blocks: np.ndarray, freqs: np.ndarray, sample_rate: int) -> np.ndarray:
    """|X(f)|^2 of each block [B, N] at each frequency [K] by the Goertzel recurrence -> [B, K]."""
    coeff = 2.0 * np.cos(2.0 * np.pi * freqs / sample_rate)  # [K]
    s1 = np.zeros((blocks.shape[0], freqs.shape[0]))
    s2 = np.zeros_like(s1)
    for x in blocks.T:  # over the N samples of every block at once
        s1, s2 = x[:, None] + coeff * s1 - s2, s1
    return s1**2 + s2**2 - coeff * s1 * s2


def _block_keys(wave: np.ndarray, sample_rate: int) -> list[str | None]:
    """The key heard in each 25.6 ms block (hop 10 ms), or None."""
    n = int(round(0.0256 * sample_rate))
    hop = int(round(0.010 * sample_rate))
    if wave.shape[0] < n:
        return []
    starts = np.arange(0, wave.shape[0] - n + 1, hop)
    blocks = np.stack([wave[s : s + n] for s in starts]).astype(np.float64)
    power = _goertzel_power(blocks, np.array(ROWS_HZ + COLS_HZ), sample_rate) * (2.0 / n)  # ~ energy per sine
    energy = (blocks**2).sum(axis=1)
    rows, cols = power[:, : len(ROWS_HZ)], power[:, len(ROWS_HZ) :]
    by_position = {pos: digit for digit, pos in KEYS.items()}
    keys: list[str | None] = []
    for b in range(blocks.shape[0]):
        r, c = int(rows[b].argmax()), int(cols[b].argmax())
        clear = np.sort(rows[b])[-2] * 4 < rows[b, r] and np.sort(cols[b])[-2] * 4 < cols[b, c]
        dominant = rows[b, r] + cols[b, c] > 0.5 * energy[b]
        keys.append(by_position.get((r, c)) if clear and dominant else None)
    return keys


def dtmf_digits(wave: np.ndarray, sample_rate: int, min_blocks: int = 3) -> str:
    """Decode the digits dialed in a clip (Goertzel; a key counts once it is heard in ``min_blocks`` blocks in a row,
    and again only after a pause). For checking generated clips, not for real-world telephony."""
    digits = []
    run_key, run = None, 0
    for key in _block_keys(np.asarray(wave, dtype=np.float64), sample_rate):
        run = run + 1 if key == run_key else 1
        run_key = key
        if key is not None and run == min_blocks:
            digits.append(key)
    return "".join(digits)


__all__ = [
    "COLS_HZ",
    "KEYS",
    "ROWS_HZ",
    "TELEPHONE_RATE",
    "DtmfClip",
    "dial",
    "dtmf_digits",
    "key_frequencies",
    "random_digits",
    "write_corpus",
    "write_flac",
    "write_wav",
]
