"""dhp's Qwen2.5-Omni thinker against transformers' Qwen2_5OmniThinkerForConditionalGeneration (random tiny weights,
float32): logits, gradients and TMRoPE position ids for audio, image + audio, text and audio-in-video inputs; the
checkpoint adapter both ways; the chunked audio encoder cut at chunk boundaries; the real presets' sizes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dhp.models.qwen2_5_omni import (
    PRESETS,
    Qwen2_5OmniThinker,
    build_model,
    load_hf_checkpoint,
    omni_rope_index,
    preset,
    save_hf_checkpoint,
)
from dhp.models.qwen2_5_omni.audio import after_conv_lengths, audio_output_lengths, chunk_features
from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig, tiny
from dhp.models.qwen2_5_omni.weights import WEIGHTS

pytest.importorskip("transformers")

TOKENS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293,
              audio_token_id=294, audio_start_token_id=295, audio_end_token_id=296)


def tiny_cfg(tie: bool = False) -> Qwen2_5OmniConfig:
    cfg = tiny(vocab_size=300, **TOKENS)
    return replace(cfg, text=replace(cfg.text, tie_word_embeddings=tie))


def hf_thinker(model: Qwen2_5OmniThinker, path) -> torch.nn.Module:
    """transformers' thinker with our weights, through a saved checkpoint; it must use every tensor and miss none."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    save_hf_checkpoint(model, path)
    hf, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = tiny_cfg()
    model = build_model(cfg, seed=0)
    return cfg, model, hf_thinker(model, tmp_path_factory.mktemp("ckpt"))


# ---- inputs laid out as Qwen2_5OmniProcessor lays them out -----------------------------------------------------------
class Inputs:
    def __init__(self, cfg: Qwen2_5OmniConfig, seed: int) -> None:
        self.cfg, self.g = cfg, torch.Generator().manual_seed(seed)
        self.ids: list[int] = []
        self.clips: list[torch.Tensor] = []  # [128, F] each
        self.images: list[list[int]] = []
        self.videos: list[list[int]] = []
        self.seconds: list[float] = []

    def text(self, n: int) -> Inputs:
        self.ids += torch.randint(0, 280, (n,), generator=self.g).tolist()
        return self

    def _clip(self, frames: int) -> int:
        self.clips.append(torch.randn(self.cfg.audio.num_mel_bins, frames, generator=self.g))
        return int(audio_output_lengths(torch.tensor(frames)))

    def audio(self, frames: int) -> Inputs:
        c = self.cfg
        self.ids += [c.audio_start_token_id] + [c.audio_token_id] * self._clip(frames) + [c.audio_end_token_id]
        return self

    def image(self, t: int, h: int, w: int) -> Inputs:
        c = self.cfg
        self.images.append([t, h, w])
        self.ids += [c.vision_start_token_id] + [c.image_token_id] * (t * h * w // 4) + [c.vision_end_token_id]
        return self

    def video(self, t: int, h: int, w: int, seconds: float) -> Inputs:
        c = self.cfg
        self.videos.append([t, h, w])
        self.seconds.append(seconds)
        self.ids += [c.vision_start_token_id] + [c.video_token_id] * (t * h * w // 4) + [c.vision_end_token_id]
        return self

    def video_with_audio(self, t: int, h: int, w: int, seconds: float, frames: int) -> Inputs:
        """processing_qwen2_5_omni.replace_video_with_audio_token: 2-second chunks of video then audio tokens."""
        from transformers import Qwen2_5OmniProcessor

        c = self.cfg
        self.videos.append([t, h, w])
        self.seconds.append(seconds)
        n_audio = self._clip(frames)
        video_times = (torch.arange(t).repeat_interleave(h * w // 4) * seconds * c.position_id_per_seconds).numpy()
        per_chunk = int(c.position_id_per_seconds * c.seconds_per_chunk)
        v_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, video_times, per_chunk)
        a_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, torch.arange(n_audio).numpy(), per_chunk)
        assert len(v_chunks) > 1 and len(a_chunks) > 1  # really interleaved
        self.ids += [c.vision_start_token_id, c.audio_start_token_id]
        for j in range(max(len(v_chunks), len(a_chunks))):
            if j < len(v_chunks):
                self.ids += [c.video_token_id] * (v_chunks[j][1] - v_chunks[j][0])
            if j < len(a_chunks):
                self.ids += [c.audio_token_id] * (a_chunks[j][1] - a_chunks[j][0])
        self.ids += [c.audio_end_token_id, c.vision_end_token_id]
        return self

    def hf_kwargs(self) -> dict:
        p = self.cfg.vision.patch_dim
        out: dict = {"input_ids": torch.tensor([self.ids])}
        if self.clips:
            frames = [x.shape[1] for x in self.clips]
            feats = torch.zeros(len(frames), self.cfg.audio.num_mel_bins, max(frames))
            mask = torch.zeros(len(frames), max(frames), dtype=torch.long)
            for i, x in enumerate(self.clips):
                feats[i, :, : x.shape[1]], mask[i, : x.shape[1]] = x, 1
            out |= {"input_features": feats, "feature_attention_mask": mask}
        if self.images:
            grid = torch.tensor(self.images)
            out |= {"pixel_values": torch.randn(int(grid.prod(-1).sum()), p, generator=self.g), "image_grid_thw": grid}
        if self.videos:
            grid = torch.tensor(self.videos)
            out |= {"pixel_values_videos": torch.randn(int(grid.prod(-1).sum()), p, generator=self.g),
                    "video_grid_thw": grid, "video_second_per_grid": torch.tensor(self.seconds),
                    "use_audio_in_video": True}
        return out


def audio_only(cfg):  # two clips: 37 frames (3 chunks of 16, the last partial), 11 frames (shorter than a chunk)
    return Inputs(cfg, 1).text(4).audio(37).text(3).audio(11).text(5)


def image_and_audio(cfg):
    return Inputs(cfg, 2).text(3).image(1, 8, 12).text(2).audio(50).text(4)


def text_only(cfg):
    return Inputs(cfg, 3).text(17)


def video_with_audio(cfg):  # 3 frame groups 1 s apart (2 video chunks), 240 frames = 60 audio tokens (2 chunks)
    return Inputs(cfg, 4).text(3).video_with_audio(3, 4, 4, 1.0, 240).text(2).audio(20).text(3)


def hf_name(ours: str) -> list[str]:
    """transformers' in-memory parameter names of one of ours (three for a fused vision qkv)."""
    memory = {"audio_tower.": "model.audio_tower.", "visual.": "model.visual.", "model.": "model.language_model."}
    out = []
    for disk in WEIGHTS.hf_names(ours):
        prefix = next((p for p in memory if disk.startswith(p)), None)
        out.append(memory[prefix] + disk[len(prefix):] if prefix else disk)
    return out


@pytest.mark.parametrize("make", [audio_only, image_and_audio, text_only, video_with_audio],
                         ids=["audio", "image_audio", "text", "audio_in_video"])
def test_logits_gradients_and_positions_match_transformers(pair, make):
    cfg, model, hf = pair
    kw = make(cfg).hf_kwargs()
    ids = kw["input_ids"]
    # TMRoPE position ids
    lens = kw["feature_attention_mask"].sum(-1) if "feature_attention_mask" in kw else None
    ref_pos, _ = hf.model.get_rope_index(ids, kw.get("image_grid_thw"), kw.get("video_grid_thw"), torch.ones_like(ids),
                                         kw.get("use_audio_in_video", False), lens, kw.get("video_second_per_grid"))
    ours_pos = omni_rope_index(ids, kw.get("image_grid_thw"), kw.get("video_grid_thw"), lens,
                               kw.get("video_second_per_grid"), cfg, kw.get("use_audio_in_video", False))
    assert torch.equal(ours_pos, ref_pos)
    # logits and gradients
    weights = torch.randn(cfg.text.vocab_size, generator=torch.Generator().manual_seed(7))
    model.zero_grad()
    hf.zero_grad()
    ours = model(**kw)
    ref = hf(**kw, attention_mask=torch.ones_like(ids)).logits
    assert ours.shape == ref.shape == (1, ids.shape[1], cfg.text.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    hf_params = dict(hf.named_parameters())
    checked = {"visual": 0, "audio": 0, "language": 0}
    for name, p in model.named_parameters():
        grads = [hf_params[n].grad for n in hf_name(name)]
        if p.grad is None:  # an encoder this input does not use (or audio_bos_eos_token, which nothing uses)
            assert all(g is None or not g.any() for g in grads), name
            continue
        ref_grad = torch.cat(grads)
        scale = ref_grad.abs().max().item() + 1e-6
        assert (p.grad - ref_grad).abs().max().item() / scale < 1e-4, name
        checked[name.split(".")[0]] += 1
    assert checked["language"] > 10
    if "input_features" in kw:
        assert checked["audio"] > 10
    if "pixel_values" in kw or "pixel_values_videos" in kw:
        assert checked["visual"] > 10


def _batch(inputs: Inputs, rows: list) -> torch.Tensor:
    """Several rows built by ``rows`` (functions of ``inputs``) on one media list, right-filled with text."""
    built = []
    for make in rows:
        inputs.ids = []
        make(inputs)
        built.append(inputs.ids)
    width = max(len(r) for r in built)
    return torch.tensor([r + [7] * (width - len(r)) for r in built])


@pytest.mark.parametrize("in_video", [False, True], ids=["separate", "audio_in_video"])
def test_positions_of_a_batch_match_transformers(pair, in_video):
    """Several images, videos and clips per row, consumed in order across the rows; videos 2 s per frame group
    (temporal ids jumping by 50: one chunk per group)."""
    cfg, _, hf = pair
    x = Inputs(cfg, 6)
    if in_video:
        rows = [lambda x: x.text(2).image(1, 4, 8).audio(30).video_with_audio(3, 4, 4, 2.0, 520).text(2),
                lambda x: x.video_with_audio(5, 4, 8, 0.5, 300).text(1).image(2, 4, 4).audio(9)]
    else:
        rows = [lambda x: x.text(2).image(1, 4, 8).audio(30).video(3, 4, 4, 2.0).image(1, 8, 4).text(2),
                lambda x: x.audio(64).video(2, 4, 8, 0.5).text(1).image(2, 4, 4).audio(9)]
    ids = _batch(x, rows)
    lens = torch.tensor([c.shape[1] for c in x.clips])
    images, videos, seconds = torch.tensor(x.images), torch.tensor(x.videos), torch.tensor(x.seconds)
    ref, _ = hf.model.get_rope_index(ids, images, videos, torch.ones_like(ids), in_video, lens, seconds)
    ours = omni_rope_index(ids, images, videos, lens, seconds, cfg, in_video)
    assert ours.shape == (3, 2, ids.shape[1])
    assert torch.equal(ours, ref)
    assert not torch.equal(ours[0], ours[1])  # real 3-D positions


def test_audio_in_video_positions_interleave(pair):
    """TMRoPE itself: a video and an audio token of the same second share the temporal id."""
    cfg, _, _ = pair
    kw = video_with_audio(cfg).hf_kwargs()
    pos = omni_rope_index(kw["input_ids"], None, kw["video_grid_thw"], kw["feature_attention_mask"].sum(-1),
                          kw["video_second_per_grid"], cfg, True)[:, 0]
    ids = kw["input_ids"][0]
    start = int(pos[0, ids == cfg.vision_start_token_id][0]) + 1
    video_t = pos[0, ids == cfg.video_token_id] - start
    audio_t = pos[0, ids == cfg.audio_token_id][:60] - start
    assert video_t.unique().tolist() == [0, 25, 50]
    assert audio_t.tolist() == list(range(60))


def test_audio_encoder_matches_transformers_and_splits_at_chunks(pair):
    cfg, model, hf = pair
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([80, 37, 11])  # 5 full chunks; 3 chunks, the last partial; one short chunk
    feats = torch.randn(cfg.audio.num_mel_bins, int(lens.sum()), generator=g)
    with torch.no_grad():
        ours = model.audio(feats, lens)
        ref = hf.model.audio_tower(feats, feature_lens=lens).last_hidden_state
        assert ours.shape == ref.shape == (int(audio_output_lengths(lens).sum()), cfg.text.hidden_size)
        assert (ours - ref).abs().max().item() < 1e-5
        # chunks 2 and 3 of the first clip alone (rows 16..31 of it) give its tokens 8..15
        padded, chunk_lens = chunk_features(feats, lens, cfg.audio.n_window)
        assert chunk_lens.tolist() == [16] * 5 + [16, 16, 5] + [11]
        part = model.audio.encode_chunks(padded[2:4], chunk_lens[2:4])
        assert part.shape[0] == int(after_conv_lengths(chunk_lens[2:4]).sum()) == 16
        pooled = model.audio.pool_project(part, torch.tensor([part.shape[0]]))
        assert (pooled - ours[8:16]).abs().max().item() < 1e-5
        # the second clip's last two chunks (rows 8..18: 11 rows, the odd last one dropped) give its tokens 4..8
        part = model.audio.encode_chunks(padded[6:8], chunk_lens[6:8])
        pooled = model.audio.pool_project(part, torch.tensor([part.shape[0]]))
        assert (pooled - ours[20 + 4: 20 + 9]).abs().max().item() < 1e-5


def test_round_trip_and_full_omni_layout(tmp_path, pair):
    from safetensors.torch import load_file, save_file

    cfg, model, _ = pair
    save_hf_checkpoint(model, tmp_path / "thinker")
    back = load_hf_checkpoint(tmp_path / "thinker")
    assert back.cfg == cfg
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    assert torch.equal(back.audio.positional_embedding, model.audio.positional_embedding)
    # the published layout: everything under thinker., plus the speech-output halves, which are ignored
    tensors = {"thinker." + k: v for k, v in load_file(str(tmp_path / "thinker" / "model.safetensors")).items()}
    tensors["talker.model.embed_tokens.weight"] = torch.zeros(3, 2)
    tensors["token2wav.code_embedding.weight"] = torch.zeros(3, 2)
    (tmp_path / "full").mkdir()
    save_file(tensors, str(tmp_path / "full" / "model.safetensors"))
    thinker_cfg = json.loads((tmp_path / "thinker" / "config.json").read_text())
    full_cfg = {"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniModel"], "thinker_config": thinker_cfg,
                "talker_config": {"model_type": "qwen2_5_omni_talker"}, "enable_audio_output": True}
    (tmp_path / "full" / "config.json").write_text(json.dumps(full_cfg))
    full = load_hf_checkpoint(tmp_path / "full")
    for (k, a), (_, b) in zip(model.state_dict().items(), full.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_key_names():
    names = WEIGHTS.hf_names
    assert names("audio.layers.0.self_attn.k_proj.weight") == ("audio_tower.layers.0.self_attn.k_proj.weight",)
    assert names("visual.blocks.3.attn.qkv.bias") == (
        "visual.blocks.3.attn.q.bias", "visual.blocks.3.attn.k.bias", "visual.blocks.3.attn.v.bias")
    assert names("language.layers.1.self_attn.qkv_proj.weight") == tuple(
        f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    assert names("language.lm_head.weight") == ("lm_head.weight",)
    assert names("language.norm.weight") == ("model.norm.weight",)
    for spelling in ("model.norm.weight", "model.language_model.norm.weight", "thinker.model.norm.weight"):
        assert WEIGHTS.dhp_key(spelling) == "language.norm.weight"
    assert WEIGHTS.dhp_key("thinker.visual.blocks.1.attn.k.weight") == "visual.blocks.1.attn.qkv.weight"
    assert WEIGHTS.dhp_key("thinker.model.layers.0.self_attn.v_proj.bias") == (
        "language.layers.0.self_attn.qkv_proj.bias")
    assert WEIGHTS.dhp_key("model.audio_tower.layers.0.self_attn.v_proj.bias") == "audio.layers.0.self_attn.v_proj.bias"
    assert WEIGHTS.dhp_key("model.audio_tower.proj.bias") == "audio.proj.bias"
    assert WEIGHTS.dhp_key("talker.model.norm.weight") is None and WEIGHTS.ignored("talker.model.norm.weight")


def test_tied_embeddings_round_trip(tmp_path):
    cfg = tiny_cfg(tie=True)
    model = build_model(cfg, seed=3)
    assert model.language.lm_head.weight is model.language.embed_tokens.weight
    hf = hf_thinker(model, tmp_path)
    kw = audio_only(cfg).hf_kwargs()
    ref = hf(**kw, attention_mask=torch.ones_like(kw["input_ids"])).logits
    assert (model(**kw) - ref).abs().max().item() < 1e-5
    back = load_hf_checkpoint(tmp_path)
    assert back.language.lm_head.weight is back.language.embed_tokens.weight
    assert torch.equal(back.language.lm_head.weight, model.language.embed_tokens.weight)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def test_presets_parameter_counts():
    """7b: ~0.64B audio, ~0.68B vision, ~7.6B language (lm_head included), as transformers builds the same config."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    assert set(PRESETS) == {"tiny", "3b", "7b"}
    with pytest.raises(ValueError, match="3b"):
        preset("nope")
    for name, expected in (("7b", (0.64e9, 0.68e9, 7.6e9)), ("3b", (0.64e9, 0.67e9, 3.1e9))):
        cfg = preset(name)
        ours = build_model(cfg, device="meta")
        counts = (_count(ours.audio), _count(ours.visual), _count(ours.language))
        for got, want in zip(counts, expected, strict=True):
            assert abs(got - want) / want < 0.03, (name, counts)
        with torch.device("meta"):
            hf = Qwen2_5OmniThinkerForConditionalGeneration(Qwen2_5OmniThinkerConfig.from_dict(cfg.to_hf_dict()))
        ref = (_count(hf.model.audio_tower), _count(hf.model.visual),
               _count(hf.model.language_model) + (0 if cfg.text.tie_word_embeddings else hf.lm_head.weight.numel()))
        assert counts == ref, name
    # the 7b preset is transformers' default thinker (but for the vision width, which transformers defaults wrongly)
    default = Qwen2_5OmniThinkerConfig()
    seven = preset("7b")
    assert seven.text.hidden_size == default.text_config.hidden_size
    assert seven.text.num_hidden_layers == default.text_config.num_hidden_layers
    assert seven.text.vocab_size == default.text_config.vocab_size
    assert seven.audio.d_model == default.audio_config.d_model
    assert seven.audio.encoder_layers == default.audio_config.encoder_layers
    assert seven.audio.output_dim == default.audio_config.output_dim
    assert seven.vision.depth == default.vision_config.depth


def test_config_round_trip():
    cfg = tiny_cfg()
    assert Qwen2_5OmniConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert Qwen2_5OmniConfig.from_hf_dict({"model_type": "qwen2_5_omni", "thinker_config": cfg.to_hf_dict()}) == cfg
    with pytest.raises(ValueError, match="width"):
        replace(cfg, audio=replace(cfg.audio, output_dim=64))


@pytest.mark.parametrize("make", [image_and_audio, video_with_audio], ids=["image_audio", "audio_in_video"])
def test_evaluation_helpers_match_forward(pair, make):
    """encode_media + sample_logits on a dhp Sample (clips concatenated in time) give the forward's logits."""
    from dhp.data.batch import Sample

    cfg, model, _ = pair
    kw = make(cfg).hf_kwargs()
    ids = kw["input_ids"]
    mask = kw["feature_attention_mask"]
    frames = kw["input_features"].permute(0, 2, 1)[mask.bool()].T
    empty = torch.zeros(0, 3, dtype=torch.long)
    sample = Sample(index=0, input_ids=ids[0], labels=ids[0], position_ids=torch.zeros(3, ids.shape[1]),
                    pixel_values=kw.get("pixel_values", torch.zeros(0, cfg.vision.patch_dim)),
                    image_grid_thw=kw.get("image_grid_thw", empty),
                    pixel_values_videos=kw.get("pixel_values_videos", torch.zeros(0, cfg.vision.patch_dim)),
                    video_grid_thw=kw.get("video_grid_thw", empty),
                    second_per_grid_ts=kw.get("video_second_per_grid", torch.zeros(0)),
                    audio_features=frames, audio_feature_lens=mask.sum(-1))
    with torch.no_grad():
        ours = model.sample_logits(ids, sample, model.encode_media(sample))
        assert torch.allclose(ours, model(**kw), atol=1e-6)
