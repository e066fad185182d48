"""Qwen2.5-Omni as a dhp family: the audio encoder's chunk-aligned sequence parallelism, the audio data
(dial-tone demo, TMRoPE positions, placeholder counts) and the bad-audio corpus."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import soundfile as sf
import torch

from dhp.config import DataConfig, load_config
from dhp.data.llava import SFTDataset
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError
from dhp.models.qwen2_5_omni.audio import AudioEncoder, init_audio
from dhp.models.qwen2_5_omni.config import tiny
from dhp.models.qwen2_5_omni.family import AUDIO, FAMILY, audio_forward_flops, encode_audio
from dhp.models.qwen2_5_omni.processor import (
    Qwen2_5OmniProcessor,
    audio_token_counts,
    audio_token_ids,
    audio_tokens,
    probe_audio,
)
from dhp.models.qwen2_5_omni.rope import omni_rope_index
from dhp.models.qwen2_5_omni.sequence_parallel import after_stem, clip_units, shard_audio

DATA = DataConfig(min_pixels=3136, max_pixels=9408)


def _samples(lens: list[list[int]], seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [NS(audio_features=torch.randn(128, sum(c), generator=g), audio_feature_lens=torch.tensor(c))
            for c in lens]


@pytest.mark.parametrize("n_window", [8, 7])  # even: every chunk a unit; odd: chunks go in pairs
def test_audio_sp_shards_equal_the_whole_encoder(n_window):
    """Every SP rank's tokens, put together, are the whole encoder's, each exactly once, and the ranks'
    gradients sum to the whole encoder's: for sp larger than the number of chunks too (empty ranks)."""
    cfg = tiny()
    cfg = replace(cfg, audio=replace(cfg.audio, n_window=n_window))
    torch.manual_seed(0)
    module = AudioEncoder(cfg.audio)
    init_audio(module, 3)
    samples = _samples([[37, 16], [5, 50, 2 * n_window]])
    full, index = encode_audio(module, samples, NS(inner_kind=None), "cpu")
    assert index.tolist() == list(range(full.shape[0]))
    assert full.shape[0] == sum(audio_tokens(n) for n in (37, 16, 5, 50, 2 * n_window))
    weight = torch.randn_like(full)
    (full * weight).sum().backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    for sp in (2, 3, 16):
        module.zero_grad()
        got, seen = torch.zeros_like(full), torch.zeros(full.shape[0], dtype=torch.long)
        for rank in range(sp):
            out, idx = encode_audio(module, samples, NS(inner_kind="sp", config=NS(sp=sp), inner_rank=rank), "cpu")
            got[idx], seen[idx] = out.detach(), seen[idx] + 1
            (out * weight[idx]).sum().backward()
        assert seen.tolist() == [1] * full.shape[0], sp
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
        for name, g in want.items():
            # sums of the same terms in another order: float32 rounding relative to the gradient's scale
            torch.testing.assert_close(dict(module.named_parameters())[name].grad, g, rtol=1e-4,
                                       atol=1e-5 * g.abs().max().item())


def test_units_start_at_even_rows_and_cover_each_clip():
    for n_window in (8, 7, 100):
        for frames in (1, 3, 16, 17, 200, 201, 999):
            units = clip_units([frames], n_window)
            assert all(u.row_start % 2 == 0 for u in units)
            assert sum(u.rows for u in units) == after_stem(frames)
            assert sum(sum(u.frames) for u in units) == frames
    shards = shard_audio([600, 30, 401], 50, 4)
    tokens = torch.cat([s.token_index for s in shards])
    assert sorted(tokens.tolist()) == list(range(sum(after_stem(f) // 2 for f in (600, 30, 401))))
    assert all(s.units for s in shards)  # enough chunks: nobody idles


def test_audio_cost_grows_with_length_and_is_the_flop_count():
    cfg = tiny()
    a = AUDIO.cost(NS(audio_frames=(100,)), cfg)
    b = AUDIO.cost(NS(audio_frames=(200,)), cfg)
    assert 1.9 < b / a < 2.1  # chunk-local attention: linear in the clip length
    assert AUDIO.cost(NS(audio_frames=()), cfg) == 0
    # one FLOP source: what the audio group balances is the forward part of what its MFU counts
    assert a == AUDIO.flops(NS(audio_frames=(100,)), cfg)[0] == audio_forward_flops(100, cfg.audio)
    assert AUDIO.flops(NS(audio_frames=(100,)), cfg)[1] < 2 * a  # backward: less conv1's input gradient


@pytest.fixture(scope="module")
def omni(omni_demo_data):
    return omni_demo_data, Tokenizer(omni_demo_data.tokenizer)


def _model_cfg(tok: Tokenizer):
    return FAMILY.model_config(load_config(None, ["model.family=qwen2_5_omni", "model.preset=omni-tiny"]), tok)


def test_demo_samples_carry_audio_and_tmrope_positions(omni):
    data, tok = omni
    model_cfg = _model_cfg(tok)
    ds = SFTDataset(DATA, tok, data.train, processor=Qwen2_5OmniProcessor(DATA, tok, model_cfg))
    kinds = set()
    for i in range(len(ds)):
        s, info = ds[i], ds.info(i)
        counts = [audio_tokens(probe_audio(p).feature_frames) for p in _audio_paths(data.train, ds.source_index(i))]
        assert audio_token_counts(s) == counts
        pad = audio_token_ids(tok)["audio_token_id"]
        assert int((s.input_ids == pad).sum()) == sum(counts) == s.token_counts.get(pad, 0)
        assert s.audio_features.shape == (128, sum(info.audio_frames))
        assert ds.get(i, pixels=False).audio_features.shape[1] == 0  # the text side never decodes audio
        want = omni_rope_index(s.input_ids[None], s.image_grid_thw if len(s.image_grid_thw) else None, None,
                               s.audio_feature_lens if counts else None, None, model_cfg)[:, 0]
        assert torch.equal(s.position_ids, want)
        kinds.add((bool(counts), bool(len(s.image_grid_thw))))
    assert kinds >= {(True, False), (False, True), (True, True)}  # audio only, image only, both


def _audio_paths(file: Path, index: int) -> list[Path]:
    item = json.loads(file.read_text().splitlines()[index])
    return [file.parent / p for p in item.get("audios", [])]


def _tone(path: Path, seconds: float, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    sf.write(str(path), (0.3 * np.sin(2 * math.pi * 440 * t)).astype(np.float32), rate)
    return path.name


def test_bad_audio_is_named_or_skipped(omni, tmp_path):
    """Corrupt, empty, too long, too short and miscounted clips: each named with file and sample, or skipped."""
    _, tok = omni
    good = _tone(tmp_path / "good.wav", 1.0)
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00garbage" * 10)
    sf.write(str(tmp_path / "empty.wav"), np.zeros(0, dtype=np.float32), 16000)
    long = _tone(tmp_path / "long.flac", 3.0)
    short = _tone(tmp_path / "short.wav", 0.01)

    def sample(audios: list[str], tags: int | None = None) -> dict:
        n = len(audios) if tags is None else tags
        return {"messages": [{"role": "user", "content": "<audio>" * n + "Which digits?"},
                             {"role": "assistant", "content": "1 2"}], "audios": audios}

    rows = [sample([good]), sample(["corrupt.wav"]), sample(["empty.wav"]), sample([long]), sample([short]),
            sample([good], tags=2), sample(["missing.wav"]), sample([good, good])]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = replace(DATA, max_audio_seconds=2.0)
    with pytest.raises(DataError) as err:
        SFTDataset(cfg, tok, path, processor=Qwen2_5OmniProcessor(cfg, tok, _model_cfg(tok)))
    text = str(err.value)
    for k, what in ((1, "corrupt.wav"), (2, "empty.wav"), (3, "data.max_audio_seconds=2"), (4, "too short"),
                    (5, "2 <audio> placeholders but 1 audio clip"), (6, "missing.wav")):
        line = next(ln for ln in text.splitlines() if f"sample {k}:" in ln)
        assert what in line and str(path) in line, (k, line)
    skip = replace(cfg, on_error="skip")
    ds = SFTDataset(skip, tok, path, processor=Qwen2_5OmniProcessor(skip, tok, _model_cfg(tok)))
    assert [ds.source_index(i) for i in range(len(ds))] == [0, 7]
    assert audio_token_counts(ds[1]) == [audio_tokens(probe_audio(tmp_path / good).feature_frames)] * 2


def test_audio_needs_an_audio_family(omni, tmp_path):
    """Audio data under Qwen2.5-VL is an error naming the fix (its language model would read the audio
    placeholders as plain tokens)."""
    from dhp.inputs import prepare

    data, _ = omni
    cfg = load_config(None, [f"data.path={data.train}", f"data.tokenizer={data.tokenizer}", "data.max_pixels=9408",
                             "model.family=qwen2_5_vl", f"output.dir={tmp_path}"])
    with pytest.raises(DataError, match="no audio encoder; set model.family=qwen2_5_omni"):
        prepare(cfg)


def test_shard_local_hf_load_reads_fused_qkv_from_separate_tensors(tmp_path):
    """A worker materialises each module straight from an HF thinker checkpoint (q, k and v stored apart,
    read into our fused qkv, a row range at a time): the same weights as the whole model's."""
    from dhp.engine import materialize
    from dhp.models.qwen2_5_omni import build_model, save_hf_checkpoint
    from dhp.parallel.materialize import SafetensorsSource, read_fused

    cfg = tiny(vocab_size=320, image_token_id=300, video_token_id=301, vision_start_token_id=302,
               vision_end_token_id=303, audio_token_id=304, audio_start_token_id=305, audio_end_token_id=306)
    model = build_model(cfg, seed=5)
    save_hf_checkpoint(model, tmp_path / "hf")
    source = SafetensorsSource(tmp_path / "hf")
    names = FAMILY.weights.hf_names("visual.blocks.1.attn.qkv.weight")
    assert len(names) == 3 and all(source.has(n) for n in names)
    rows = read_fused(source, names, (slice(50, 150),))  # spans the q/k and k/v boundaries (64 rows each)
    torch.testing.assert_close(rows, model.visual.blocks[1].attn.qkv.weight[50:150].detach())
    for spec, whole in ((FAMILY.encoders[0], model.visual), (FAMILY.encoders[1], model.audio),
                        (FAMILY.language, model.language)):
        with torch.device("meta"):
            module = spec.build(cfg)
        materialize(spec, module, cfg, "cpu", seed=0, hf_path=str(tmp_path / "hf"), family=FAMILY)
        want = whole.state_dict()
        for name, t in module.state_dict().items():
            torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=name)
