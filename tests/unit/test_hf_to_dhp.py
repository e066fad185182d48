"""Hugging Face -> dhp: checkpoints that transformers itself creates and saves (not dhp's export read back), on
shapes of their own (none of the tiny presets'), load with dhp's ``load_hf_checkpoint`` and give transformers'
logits, for every family: Qwen2.5-VL and Qwen2.5-Omni's thinker (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

VL_TOKENS = dict(image_token_id=310, video_token_id=311, vision_start_token_id=312, vision_end_token_id=313)
OMNI_TOKENS = dict(VL_TOKENS, audio_token_id=314, audio_start_token_id=315, audio_end_token_id=316)

# fresh shapes: 3 vision blocks (the first and last full attention), 2 heads, a 3-layer text model with one KV head
VISION = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=80,
              fullatt_block_indexes=[0, 2], window_size=112, spatial_merge_size=2, patch_size=14,
              temporal_patch_size=2, in_channels=3)
TEXT = dict(vocab_size=320, hidden_size=80, intermediate_size=144, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 4, 4], "rope_theta": 50000.0})


def _ids(tokens: dict, grids: list[list[int]], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for t, h, w in grids:
        ids += torch.randint(0, 300, (4,), generator=g).tolist()
        ids += [tokens["vision_start_token_id"], *[tokens["image_token_id"]] * (t * h * w // 4),
                tokens["vision_end_token_id"]]
    return torch.tensor([ids + torch.randint(0, 300, (7,), generator=g).tolist()])


def test_qwen2_5_vl_saved_by_transformers_loads_into_dhp(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from dhp.models.qwen2_5_vl import load_hf_checkpoint

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(vision_config=VISION, text_config=dict(TEXT, tie_word_embeddings=True),
                           tie_word_embeddings=True, **VL_TOKENS)
    hf = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path).eval()
    assert ours.cfg.text.num_key_value_heads == 1 and ours.cfg.vision.depth == 3
    grids = [[1, 8, 12], [1, 4, 4]]
    ids = _ids(VL_TOKENS, grids, seed=1)
    grid = torch.tensor(grids)
    pv = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pv, image_grid_thw=grid,
                 mm_token_type_ids=(ids == VL_TOKENS["image_token_id"]).int()).logits
        got = ours(ids, pv, grid)
    assert got.shape == ref.shape == (1, ids.shape[1], TEXT["vocab_size"])
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_qwen2_5_omni_thinker_saved_by_transformers_loads_into_dhp(tmp_path):
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    from dhp.models.qwen2_5_omni import load_hf_checkpoint
    from dhp.models.qwen2_5_omni.audio import audio_output_lengths

    torch.manual_seed(0)
    audio = dict(num_mel_bins=128, d_model=48, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=96,
                 n_window=8, output_dim=TEXT["hidden_size"], max_source_positions=1500)
    cfg = Qwen2_5OmniThinkerConfig(audio_config=audio, vision_config=dict(VISION, out_hidden_size=80),
                                   text_config=dict(TEXT, tie_word_embeddings=False), **OMNI_TOKENS)
    hf = Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path).eval()
    assert ours.cfg.audio.d_model == 48 and ours.cfg.text.num_hidden_layers == 3
    g = torch.Generator().manual_seed(3)
    frames = 45
    n_audio = int(audio_output_lengths(torch.tensor(frames)))
    image = [1, 8, 8]
    ids = (torch.randint(0, 300, (3,), generator=g).tolist()
           + [OMNI_TOKENS["vision_start_token_id"], *[OMNI_TOKENS["image_token_id"]] * 16,
              OMNI_TOKENS["vision_end_token_id"]]
           + torch.randint(0, 300, (2,), generator=g).tolist()
           + [OMNI_TOKENS["audio_start_token_id"], *[OMNI_TOKENS["audio_token_id"]] * n_audio,
              OMNI_TOKENS["audio_end_token_id"]]
           + torch.randint(0, 300, (5,), generator=g).tolist())
    kw = {"input_ids": torch.tensor([ids]),
          "input_features": torch.randn(1, 128, frames, generator=g),
          "feature_attention_mask": torch.ones(1, frames, dtype=torch.long),
          "pixel_values": torch.randn(64, 3 * 2 * 14 * 14, generator=g),
          "image_grid_thw": torch.tensor([image])}
    with torch.no_grad():
        ref = hf(**kw, attention_mask=torch.ones_like(kw["input_ids"])).logits
        got = ours(**kw)
    assert got.shape == ref.shape == (1, len(ids), TEXT["vocab_size"])
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
