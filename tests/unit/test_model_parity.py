"""dhp's Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration (random tiny weights, float32)."""

from __future__ import annotations

import pytest
import torch

from dhp.models.qwen2_5_vl import build_model, load_hf_checkpoint, save_hf_checkpoint
from dhp.models.qwen2_5_vl.weights import WEIGHTS
from tests.hf_reference import hf_model_like, tiny_cfg

pytest.importorskip("transformers")

# (t, h, w) in patches. 12x20 patches = 6x10 merged tokens: 2x3 windows of 4x4, the border ones padded.
ONE_IMAGE = [[1, 12, 20]]
TWO_IMAGES = [[1, 12, 20], [1, 6, 10]]


def make_inputs(cfg, grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for t, h, w in grids:
        ids += torch.randint(0, 280, (3,), generator=g).tolist()
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id]
    ids += torch.randint(0, 280, (9,), generator=g).tolist()
    n_patches = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(n_patches, cfg.vision.patch_dim, generator=g)
    return torch.tensor([ids]), pixel_values, torch.tensor(grids, dtype=torch.long).view(-1, 3)


def hf_forward(hf, cfg, ids, pixel_values, grid):
    if grid.shape[0] == 0:
        return hf(input_ids=ids).logits
    mm = (ids == cfg.image_token_id).int()
    return hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=mm).logits


def dhp_forward(model, ids, pixel_values, grid):
    if grid.shape[0] == 0:
        return model(ids)
    return model(ids, pixel_values, grid)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = tiny_cfg()
    model = build_model(cfg, seed=0)
    hf = hf_model_like(model, tmp_path_factory.mktemp("ckpt"))
    return cfg, model, hf


@pytest.mark.parametrize("grids", [ONE_IMAGE, TWO_IMAGES, []], ids=["one_image", "two_images", "text_only"])
def test_logits_match_transformers(pair, grids):
    cfg, model, hf = pair
    ids, pv, grid = make_inputs(cfg, grids)
    ours = dhp_forward(model, ids, pv, grid)
    ref = hf_forward(hf, cfg, ids, pv, grid)
    assert ours.shape == ref.shape == (1, ids.shape[1], cfg.text.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-4


def test_gradients_match_transformers(pair):
    cfg, model, hf = pair
    ids, pv, grid = make_inputs(cfg, TWO_IMAGES, seed=1)
    weights = torch.randn(cfg.text.vocab_size, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    hf.zero_grad()
    (dhp_forward(model, ids, pv, grid) * weights).sum().backward()
    (hf_forward(hf, cfg, ids, pv, grid) * weights).sum().backward()
    hf_params = dict(hf.named_parameters())
    # transformers 5 keeps the modules as model.visual / model.language_model in memory
    def hf_name(disk: str) -> str:
        if disk.startswith("visual."):
            return "model." + disk
        if disk.startswith("model."):
            return "model.language_model." + disk[len("model."):]
        return disk

    checked = {"visual": 0, "language": 0}
    for name, p in model.named_parameters():
        # a fused q/k/v or gate/up is HF's q_proj, k_proj, v_proj or gate_proj, up_proj, concatenated on dim 0
        parts = [hf_params[hf_name(disk)].grad for disk in WEIGHTS.hf_names(name)]
        assert p.grad is not None and all(g is not None for g in parts), name
        ref = torch.cat(parts)
        scale = ref.abs().max().item() + 1e-6
        assert (p.grad - ref).abs().max().item() / scale < 1e-4, name
        checked[name.split(".")[0]] += 1
    assert checked["visual"] > 10 and checked["language"] > 10


def test_images_never_attend_to_each_other(pair):
    """Changing the pixels of image 2 leaves the embeddings of image 1 unchanged."""
    cfg, model, _ = pair
    _, pv, grid = make_inputs(cfg, TWO_IMAGES)
    n1 = 12 * 20
    emb = model.visual(pv, grid)
    pv2 = pv.clone()
    pv2[n1:] += 1.0
    emb2 = model.visual(pv2, grid)
    assert torch.equal(emb[: n1 // 4], emb2[: n1 // 4])
    assert not torch.allclose(emb[n1 // 4:], emb2[n1 // 4:])


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_through_transformers(tmp_path, tie):
    """dhp -> safetensors -> transformers gives the same logits; transformers' save -> dhp too."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = tiny_cfg(tie=tie)
    model = build_model(cfg, seed=3)
    ids, pv, grid = make_inputs(cfg, ONE_IMAGE, seed=4)
    ours = dhp_forward(model, ids, pv, grid)
    hf = hf_model_like(model, tmp_path / "dhp_saved")
    assert hf.config.tie_word_embeddings == tie
    assert (hf_forward(hf, cfg, ids, pv, grid) - ours).abs().max().item() < 1e-4
    # and back: transformers writes, dhp reads
    hf.save_pretrained(str(tmp_path / "hf_saved"))
    back = load_hf_checkpoint(tmp_path / "hf_saved")
    assert (dhp_forward(back, ids, pv, grid) - ours).abs().max().item() < 1e-5
    assert isinstance(hf, Qwen2_5_VLForConditionalGeneration)


def test_sharded_checkpoint_and_dtype(tmp_path):
    cfg = tiny_cfg()
    model = build_model(cfg, seed=5).to(torch.bfloat16)
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    back = load_hf_checkpoint(tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in back.parameters())
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_missing_and_unknown_keys_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = tiny_cfg()
    save_hf_checkpoint(build_model(cfg, seed=6), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mystery.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError) as e:
        load_hf_checkpoint(tmp_path)
    assert "language.norm.weight" in str(e.value) and "mystery" in str(e.value)
    tensors["something_else.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="something_else.weight"):
        load_hf_checkpoint(tmp_path)
