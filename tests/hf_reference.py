"""Helpers that build the transformers reference model from a dhp config (tests only)."""

from __future__ import annotations

import torch

from dhp.models.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLConfig, save_hf_checkpoint


def hf_model_like(model: Qwen2_5_VL, tmp_path) -> torch.nn.Module:
    """transformers' Qwen2_5_VLForConditionalGeneration with our weights, through a saved checkpoint."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    save_hf_checkpoint(model, tmp_path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                            attn_implementation="sdpa")
    return hf.eval()


def tiny_cfg(tie: bool = False) -> Qwen2_5_VLConfig:
    from dataclasses import replace

    from dhp.models.qwen2_5_vl.config import tiny

    cfg = tiny(vocab_size=300, image_token_id=290, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293)
    return replace(cfg, text=replace(cfg.text, tie_word_embeddings=tie))
