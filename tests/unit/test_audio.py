"""dhp.data.audio against the HF Whisper feature extractor / Qwen2.5-Omni processor, soundfile and soxr; and the
synthetic DTMF corpus of dhp.data.dtmf (its clips really encode their digits, and load through the pipeline)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

from dhp.data import dtmf as D
from dhp.errors import DataError
from dhp.models.qwen2_5_omni import processor as A


@pytest.fixture(scope="module")
def extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=128)  # Qwen2.5-Omni's preprocessor_config: 128 mels, else defaults


def hf_features(extractor: WhisperFeatureExtractor, wave: np.ndarray) -> tuple[torch.Tensor, int]:
    """What Qwen2.5-Omni's processor computes: (valid input_features [128, F], F = attention-mask sum)."""
    out = extractor(wave, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    frames = int(out["attention_mask"][0].sum())
    return out["input_features"][0][:, :frames], frames


def signal(kind: str, n: int, seed: int = 0) -> np.ndarray:
    if kind == "noise":
        return (0.3 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)
    if kind == "tone":
        return (0.5 * np.sin(2 * np.pi * 440.0 * np.arange(n) / 16000)).astype(np.float32)
    return np.zeros(n, np.float32)


# ---- log-mel parity -------------------------------------------------------------------------------------------


def test_mel_filter_bank_matches_transformers():
    ref = hf_mel_filter_bank(num_frequency_bins=201, num_mel_filters=128, min_frequency=0.0, max_frequency=8000.0,
                             sampling_rate=16000, norm="slaney", mel_scale="slaney")
    mine = A.mel_filter_bank()
    assert mine.shape == (201, 128)
    np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-7)
    assert (mine > 0).sum(axis=0).min() >= 1  # every filter covers at least one bin
    mine[:] = 0  # a copy: the cached bank is not corrupted by callers
    np.testing.assert_allclose(A.mel_filter_bank(), ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n", [160, 8000, 16000 + 37, 116800, 479840, 480000])  # 0.01 s ... 29.99 s, exactly 30 s
@pytest.mark.parametrize("kind", ["noise", "tone", "silence"])
def test_log_mel_matches_whisper_feature_extractor(extractor, n, kind):
    wave = signal(kind, n, seed=n)
    ref, frames = hf_features(extractor, wave)
    mine = A.log_mel(wave)
    assert mine.dtype == torch.float32
    assert mine.shape == (128, frames) == (128, A.feature_frames(n))
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-5)


def test_log_mel_clamps_at_the_max_of_the_padded_30_seconds(extractor):
    """A loud click at the start sets the global max; the quiet tail is clamped to max - 8 (in log10 units) —
    whether the clamp is applied and over which span is visible in the values."""
    wave = np.full(16000, 1e-6, np.float32)
    wave[:400] = 0.9
    mine = A.log_mel(wave)
    assert float(mine.max() - mine.min()) == pytest.approx(2.0, abs=1e-5)  # (8 log10 units) / 4
    torch.testing.assert_close(mine, hf_features(extractor, wave)[0], rtol=0, atol=1e-5)


def test_log_mel_rejects_clips_over_30_seconds_and_bad_shapes():
    with pytest.raises(A.AudioError, match="30 s"):
        A.log_mel(np.zeros(480001, np.float32))
    with pytest.raises(A.AudioError):
        A.log_mel(np.zeros((2, 100), np.float32))
    with pytest.raises(A.AudioError):
        A.log_mel(np.zeros(0, np.float32))


# ---- token counts -----------------------------------------------------------------------------------------------


def test_feature_frames_and_audio_tokens_match_the_qwen_omni_processor(extractor):
    """The placeholder count of a clip of n samples at 16 kHz is _get_feat_extract_output_lengths(attention-mask sum)
    in the HF processor; dhp computes it from n alone: F = ceil(n / 160) (<= 3000), tokens = (F + 1) // 4."""
    lengths = [1, 159, 160, 161, 320, 321, 480, 481, 640, 641, 1000, 15999, 16000, 16001, 33333, 100000, 240160,
               479839, 479840, 479841, 480000]
    for n in lengths:
        _, frames = hf_features(extractor, np.ones(n, np.float32))
        hf_tokens = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
        assert A.feature_frames(n) == frames, n
        assert A.audio_tokens(A.feature_frames(n)) == hf_tokens, n


def test_audio_tokens_closed_form_over_all_frame_counts():
    frames = torch.arange(0, 3001)
    hf = _get_feat_extract_output_lengths(frames)
    mine = torch.tensor([A.audio_tokens(int(f)) for f in frames])
    assert torch.equal(mine, hf)
    assert torch.equal(mine[1:], (frames[1:] + 1) // 4)  # 25 tokens per second; 1-2 frames (<= 20 ms) give none
    assert A.audio_tokens(A.feature_frames(480000)) == 750
    assert A.audio_tokens(A.feature_frames(320)) == 0 and A.audio_tokens(A.feature_frames(321)) == 1


def test_feature_frames_is_ceil_capped_at_3000():
    n = np.arange(0, 480_001, 7)
    assert [A.feature_frames(int(v)) for v in n] == list(-(-n // 160))
    assert A.feature_frames(480_000) == 3000 and A.feature_frames(10 * 480_000) == 3000
    with pytest.raises(ValueError):
        A.feature_frames(-1)


# ---- the soxr length rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 32000, 44100, 48000, 96000])
def test_resampled_length_is_what_soxr_returns(rate):
    rng = np.random.default_rng(rate)
    lengths = list(range(1, 120)) + [int(v) for v in rng.integers(120, 1_500_000, 12)] + [rate * 30, rate * 30 + 1]
    for n in lengths:
        x = np.zeros(n, np.float32)
        expected = n if rate == 16000 else soxr.resample(x, rate, 16000, quality="HQ").shape[0]
        assert A.resampled_length(n, rate) == expected, (rate, n)
    # ties round half *up*: 5 samples at 32 kHz are 2.5 at 16 kHz -> 3 (Python's round-to-even would give 2)
    assert A.resampled_length(5, 32000) == 3 == soxr.resample(np.zeros(5, np.float32), 32000, 16000).shape[0]


# ---- files ------------------------------------------------------------------------------------------------------


def write(path, data: np.ndarray, rate: int, subtype: str, fmt: str | None = None) -> str:
    sf.write(path, data, rate, subtype=subtype, format=fmt)
    return str(path)


@pytest.mark.parametrize(
    ("name", "rate", "subtype", "fmt"),
    [("a.wav", 8000, "PCM_16", None), ("b.wav", 44100, "FLOAT", None), ("c.flac", 48000, "PCM_16", None),
     ("d.wav", 16000, "PCM_16", None), ("e.flac", 22050, "PCM_24", None), ("f.wav", 11025, "PCM_16", None),
     ("g.ogg", 32000, "VORBIS", "OGG")],
)
@pytest.mark.parametrize("channels", [1, 2])
def test_probe_predicts_load_and_load_is_soxr_of_the_channel_average(tmp_path, name, rate, subtype, fmt, channels):
    rng = np.random.default_rng(rate + channels)
    n = int(rate * 0.731) + 3
    data = rng.uniform(-0.5, 0.5, (n, channels)).astype(np.float32)
    path = write(tmp_path / name, data, rate, subtype, fmt)
    info = A.probe_audio(path)
    wave = A.load_audio(path)
    assert (info.path, info.sample_rate, info.channels, info.frames) == (path, rate, channels, n)
    assert info.seconds == pytest.approx(n / rate)
    assert info.samples_16k == wave.shape[0] == round(n * 16000 / rate)
    assert info.feature_frames == -(-info.samples_16k // 160) and info.num_tokens == (info.feature_frames + 1) // 4
    assert wave.dtype == np.float32 and wave.ndim == 1
    decoded, _ = sf.read(path, dtype="float32", always_2d=True)
    mono = decoded.mean(axis=1, dtype=np.float32)
    expected = mono if rate == 16000 else soxr.resample(mono, rate, 16000, quality="HQ")
    np.testing.assert_array_equal(wave, expected)
    if channels == 2:  # an average, not the first channel
        first = decoded[:, 0] if rate == 16000 else soxr.resample(np.ascontiguousarray(decoded[:, 0]), rate, 16000)
        assert np.abs(wave - first).max() > 0.1


def test_stereo_is_averaged_exactly(tmp_path):
    rng = np.random.default_rng(3)
    left, right = rng.uniform(-0.5, 0.5, (2, 12345)).astype(np.float32)
    path = write(tmp_path / "s.wav", np.stack([left, right], axis=1), 8000, "FLOAT")
    expected = soxr.resample((left + right) / np.float32(2), 8000, 16000, quality="HQ")
    np.testing.assert_allclose(A.load_audio(path), expected, rtol=0, atol=1e-6)


def test_resampling_keeps_pitch_and_time(tmp_path):
    """An 8 kHz 440 Hz tone loads as a 16 kHz 440 Hz tone of the same duration (not a shifted or stretched one)."""
    t8 = np.arange(8000) / 8000
    path = write(tmp_path / "tone.wav", (0.5 * np.sin(2 * np.pi * 440 * t8)).astype(np.float32), 8000, "FLOAT")
    wave = A.load_audio(path)
    assert wave.shape == (16000,)
    t16 = np.arange(16000) / 16000
    inner = slice(400, 15600)  # away from the edges the resampling filter sees as steps
    np.testing.assert_allclose(wave[inner], 0.5 * np.sin(2 * np.pi * 440 * t16)[inner], atol=2e-3)


def test_features_of_a_file(tmp_path):
    rng = np.random.default_rng(5)
    path = write(tmp_path / "x.flac", rng.uniform(-0.5, 0.5, (12345, 2)).astype(np.float32), 8000, "PCM_16")
    mel, info = A.features(path)
    assert (info.samples_16k, info.feature_frames, info.num_tokens) == (24690, 155, 39)
    assert mel.shape == (128, 155)
    torch.testing.assert_close(mel, A.log_mel(A.load_audio(path)), rtol=0, atol=0)


def test_features_reject_a_file_over_30_seconds_before_decoding(tmp_path):
    path = write(tmp_path / "long.wav", np.zeros(8000 * 31, np.float32), 8000, "PCM_16")
    info = A.probe_audio(path)  # probing is fine: the caller compares info.seconds with data.max_audio_seconds
    assert info.seconds == 31.0 and info.feature_frames == 3000
    with pytest.raises(A.AudioError, match="long.wav.*over the 30 s"):
        A.features(path)


def test_features_reject_a_file_that_decodes_to_another_length(tmp_path, monkeypatch):
    path = write(tmp_path / "liar.wav", np.zeros(8000, np.float32), 8000, "PCM_16")
    monkeypatch.setattr(A, "load_audio", lambda p: np.zeros(15999, np.float32))
    with pytest.raises(A.AudioError, match="liar.wav decodes to 15999 samples"):
        A.features(path)


def bad_files(tmp_path) -> dict[str, str]:
    good = tmp_path / "good.wav"
    sf.write(good, np.zeros(1000, np.float32), 8000, subtype="PCM_16")
    (tmp_path / "random.wav").write_bytes(np.random.default_rng(0).bytes(3000))
    (tmp_path / "truncated.wav").write_bytes(good.read_bytes()[:30])
    sf.write(tmp_path / "empty.wav", np.zeros(0, np.float32), 8000, subtype="PCM_16")
    (tmp_path / "folder.wav").mkdir()
    return {
        "random": str(tmp_path / "random.wav"),
        "truncated": str(tmp_path / "truncated.wav"),
        "empty": str(tmp_path / "empty.wav"),
        "missing": str(tmp_path / "missing.wav"),
        "folder": str(tmp_path / "folder.wav"),
    }


@pytest.mark.parametrize("reader", [A.probe_audio, A.load_audio, A.features])
@pytest.mark.parametrize("case", ["random", "truncated", "empty", "missing", "folder"])
def test_unusable_files_raise_audio_error_naming_the_file(tmp_path, reader, case):
    path = bad_files(tmp_path)[case]
    with pytest.raises(A.AudioError) as raised:
        reader(path)
    message = str(raised.value)
    assert path in message
    expected = {"random": "Format not recognised", "truncated": "data", "empty": "empty", "missing": "does not exist",
                "folder": "does not exist"}[case]
    assert expected in message
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, DataError)


# ---- the DTMF corpus --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_dialed_clips_decode_to_their_digits(seed):
    rng = np.random.default_rng(seed)
    digits = D.random_digits(rng, 1, 10)
    wave = D.dial(digits, rng)
    assert wave.dtype == np.float32 and 0.1 < np.abs(wave).max() < 1.0
    assert D.dtmf_digits(wave, 8000) == digits
    assert D.dtmf_digits(soxr.resample(wave, 8000, 16000), 16000) == digits


def test_repeated_and_all_keys_decode():
    rng = np.random.default_rng(11)
    for digits in ["0123456789", "1111", "90", "5"]:
        assert D.dtmf_digits(D.dial(digits, rng), 8000) == digits


def test_the_decoder_hears_nothing_in_noise_and_tells_keys_apart():
    rng = np.random.default_rng(0)
    assert D.dtmf_digits(rng.normal(0, 0.2, 16000), 8000) == ""
    assert D.dtmf_digits(D.dial("12", rng), 8000) == "12"
    assert D.dtmf_digits(D.dial("21", rng), 8000) == "21"


def test_dial_is_deterministic_given_the_rng_and_varies_across_seeds():
    same = [D.dial("4711", np.random.default_rng(1)) for _ in range(2)]
    np.testing.assert_array_equal(*same)
    lengths = {D.dial("4711", np.random.default_rng(s)).shape[0] for s in range(10)}
    assert len(lengths) >= 8  # random tone, gap and silence lengths
    low, high = 4 * 0.12 + 3 * 0.05 + 2 * 0.05, 4 * 0.25 + 3 * 0.2 + 2 * 0.3
    assert all(low * 8000 - 10 <= n <= high * 8000 + 10 for n in lengths)
    with pytest.raises(ValueError):
        D.dial("12a", np.random.default_rng(0))
    with pytest.raises(ValueError):
        D.dial("", np.random.default_rng(0))


def test_key_frequencies():
    assert D.key_frequencies("1") == (697.0, 1209.0)
    assert D.key_frequencies("0") == (941.0, 1336.0)
    assert D.key_frequencies("9") == (852.0, 1477.0)


def test_corpus_files_round_trip_through_the_loader(tmp_path):
    clips = D.write_corpus(tmp_path, 6, seed=7)
    assert [c.path.rsplit(".", 1)[1] for c in clips] == ["wav", "wav", "flac"] * 2
    assert len({c.digits for c in clips}) > 1
    for clip in clips:
        info = A.probe_audio(clip.path)
        assert (info.sample_rate, info.channels, info.seconds) == (8000, 1, pytest.approx(clip.seconds))
        assert sf.info(clip.path).subtype == "PCM_16"
        wave = A.load_audio(clip.path)
        assert wave.shape == (2 * info.frames,) == (info.samples_16k,)
        assert D.dtmf_digits(wave, 16000) == clip.digits
    again = D.write_corpus(tmp_path / "again", 6, seed=7)
    assert [c.digits for c in again] == [c.digits for c in clips]


def test_write_wav_and_flac_round_trip(tmp_path):
    wave = D.dial("305", np.random.default_rng(2))
    for path in (D.write_wav(tmp_path / "a.wav", wave, 8000), D.write_flac(tmp_path / "a.flac", wave, 8000)):
        back, rate = sf.read(path, dtype="float32")
        assert rate == 8000
        np.testing.assert_allclose(back, wave, atol=1 / 32768 + 1e-7)
    assert sf.info(tmp_path / "a.flac").format == "FLAC"


@pytest.mark.parametrize("seed", range(5))
def test_keypad_cadence_puts_each_key_in_its_slot(seed):
    """``slot_seconds``: key k sounds inside its own slot (its energy there), the clip decodes to its keys."""
    rng = np.random.default_rng(seed)
    digits = "".join(str(d) for d in rng.integers(0, 10, size=3))
    slot, rate = 0.25, 8000
    wave = D.dial(digits, rng, rate, slot_seconds=slot, tone_seconds=(0.15, 0.21))
    assert D.dtmf_digits(wave, rate) == digits
    lead = next(i for i, x in enumerate(np.abs(wave) > 0.5 * np.abs(wave).max()) if x)  # first tone's onset
    assert 0.02 * rate <= lead <= (0.05 + 0.05) * rate
    for k, d in enumerate(digits):
        start = int((0.02 + k * slot) * rate)
        part = wave[start:start + int(0.2 * rate)]
        assert D.dtmf_digits(np.concatenate([part, np.zeros(rate // 10, np.float32)]), rate).startswith(d)
    with pytest.raises(ValueError, match="leaves no gap"):
        D.dial("1", rng, rate, slot_seconds=0.2, tone_seconds=(0.15, 0.21))
