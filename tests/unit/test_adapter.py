"""The weight adapter objects (``dhp.models.adapter``): the HF names of every key, fused tensors cut and joined,
whole checkpoints in and out, and the adapter of a family without Hugging Face weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dhp.errors import ConfigError
from dhp.models.adapter import WeightAdapter
from dhp.models.qwen2_5_omni import build_model as build_omni
from dhp.models.qwen2_5_omni.config import tiny as omni_tiny
from dhp.models.qwen2_5_omni.weights import WEIGHTS as OMNI
from dhp.models.qwen2_5_vl import build_model
from dhp.models.qwen2_5_vl.config import tiny
from dhp.models.qwen2_5_vl.weights import WEIGHTS as VL
from dhp.models.spec import Family

TOKENS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)


def vl_cfg(tie: bool = False):
    cfg = tiny(vocab_size=300, **TOKENS)
    return replace(cfg, text=replace(cfg.text, tie_word_embeddings=tie))


def omni_cfg():
    return omni_tiny(vocab_size=300, audio_token_id=294, audio_start_token_id=295, audio_end_token_id=296, **TOKENS)


def test_hf_names_of_plain_and_fused_keys() -> None:
    assert VL.hf_names("language.norm.weight") == ("model.norm.weight",)
    assert VL.hf_names("language.lm_head.weight") == ("lm_head.weight",)
    assert VL.hf_names("visual.blocks.0.attn.qkv.weight") == ("visual.blocks.0.attn.qkv.weight",)  # fused in HF too
    assert VL.hf_names("language.layers.3.self_attn.qkv_proj.bias") == tuple(
        f"model.layers.3.self_attn.{p}_proj.bias" for p in "qkv")
    assert VL.hf_names("visual.blocks.1.mlp.gate_up_proj.weight") == (
        "visual.blocks.1.mlp.gate_proj.weight", "visual.blocks.1.mlp.up_proj.weight")
    # every spelling transformers uses locates the same key and part
    for name in ("model.layers.3.self_attn.k_proj.bias", "model.language_model.layers.3.self_attn.k_proj.bias"):
        assert VL.locate(name) == ("language.layers.3.self_attn.qkv_proj.bias", 1)
    assert VL.locate("model.visual.blocks.1.mlp.up_proj.weight") == ("visual.blocks.1.mlp.gate_up_proj.weight", 1)
    assert VL.locate("something_else.weight") is None


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_every_key_maps_to_hf_names_and_back(family: str) -> None:
    """A bijection: each of our keys' HF tensors locate that key, at their own position, and no two keys share
    an HF name."""
    adapter, model = (VL, build_model(vl_cfg(), seed=0)) if family == "qwen2_5_vl" else (
        OMNI, build_omni(omni_cfg(), seed=0))
    seen: set[str] = set()
    for key in model.state_dict():
        names = adapter.hf_names(key)
        for i, name in enumerate(names):
            assert adapter.locate(name) == (key, i), name
        assert not seen & set(names), key
        seen |= set(names)
    assert len(seen) > len(model.state_dict())  # fused keys have several


def test_to_hf_cuts_gqa_qkv_in_unequal_parts_and_from_hf_joins_them() -> None:
    cfg = vl_cfg()
    model = build_model(cfg, seed=1)
    key = "language.layers.0.self_attn.qkv_proj.weight"
    fused = model.state_dict()[key]
    parts = VL.to_hf(key, fused, cfg)
    hd, heads, kv = cfg.text.head_dim, cfg.text.num_attention_heads, cfg.text.num_key_value_heads
    assert [t.shape[0] for t in parts.values()] == [heads * hd, kv * hd, kv * hd] == [96, 48, 48]
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], fused[96:144])
    assert torch.equal(VL.from_hf(key, parts), fused)
    del parts["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(KeyError, match=r"v_proj\.weight is missing"):
        VL.from_hf(key, parts)
    with pytest.raises(ValueError, match="does not cut into parts"):
        VL.to_hf(key, fused[:-24], cfg)  # a tensor the config's q/k/v rows do not fit


@pytest.mark.parametrize("tie", [False, True])
def test_save_and_load_hf_round_trip(tmp_path, tie: bool) -> None:
    cfg = vl_cfg(tie)
    model = build_model(cfg, seed=2)
    VL.save_hf(model, tmp_path, max_shard_bytes=100_000)  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").is_file() and (tmp_path / "config.json").is_file()
    state = VL.load_hf(tmp_path)
    want = model.state_dict()
    assert ("language.lm_head.weight" in state) is not tie  # a tied head is written once, as HF expects
    assert set(state) == set(want) - ({"language.lm_head.weight"} if tie else set())
    for k, t in state.items():
        assert torch.equal(t, want[k]), k
    assert VL.tied(cfg) == ({"language.lm_head.weight": "language.embed_tokens.weight"} if tie else {})
    only = VL.load_hf(tmp_path, keys=["language.layers.1.self_attn.qkv_proj.bias"])
    assert list(only) == ["language.layers.1.self_attn.qkv_proj.bias"]


def test_a_family_without_hf_weights_says_so() -> None:
    class Bare(Family):
        name = "bare_family"

    weights = Bare().weights
    assert isinstance(weights, WeightAdapter) and weights.tied(None) == {}
    for call in (lambda: weights.hf_names("language.norm.weight"), lambda: weights.locate("model.norm.weight"),
                 lambda: weights.hf_config(None, torch.float32),
                 lambda: weights.to_hf("language.norm.weight", torch.ones(1), None)):
        with pytest.raises(ConfigError, match="model family bare_family has no Hugging Face weight adapter"):
            call()
