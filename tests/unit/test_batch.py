"""Packing: positions restart, targets shift per sample, and a packed batch's loss is the sum of its samples'."""

from __future__ import annotations

import torch

from dhp.data.batch import IGNORE_INDEX, Sample, pack, shifted_targets
from dhp.data.mrope import rope_index
from dhp.models.qwen2_5_vl import build_model
from tests.hf_reference import tiny_cfg

CFG = tiny_cfg()


def _sample(index: int, text_lens: list[int], grids: list[tuple[int, int, int]], seed: int) -> Sample:
    """text, then (image, text) pairs; labels supervise the last text piece."""
    g = torch.Generator().manual_seed(seed)
    ids: list[torch.Tensor] = [torch.randint(1, 280, (text_lens[0],), generator=g)]
    for (t, h, w), n in zip(grids, text_lens[1:], strict=True):
        ids += [torch.tensor([CFG.vision_start_token_id]), torch.full((t * h * w // 4,), CFG.image_token_id),
                torch.tensor([CFG.vision_end_token_id]), torch.randint(1, 280, (n,), generator=g)]
    input_ids = torch.cat(ids)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[-text_lens[-1]:] = input_ids[-text_lens[-1]:]
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    n_patches = int(grid.prod(-1).sum()) if len(grids) else 0
    return Sample(
        index=index,
        input_ids=input_ids,
        labels=labels,
        position_ids=rope_index(input_ids[None], grid, CFG.image_token_id, CFG.vision_start_token_id)[:, 0],
        pixel_values=torch.randn(n_patches, 1176, generator=g),
        image_grid_thw=grid,
    )


SAMPLES = [
    _sample(7, [5, 6], [(1, 12, 8)], seed=1),  # 96 patches: spans several 8x8-patch windows
    _sample(3, [9], [], seed=2),  # text only
    _sample(11, [2, 3, 4], [(1, 4, 4), (1, 6, 10)], seed=3),  # two images
]


def test_shifted_targets() -> None:
    assert shifted_targets(torch.tensor([-100, 5, 6, -100, 7])).tolist() == [5, 6, -100, 7, -100]


def test_sample_properties() -> None:
    s = SAMPLES[2]
    assert s.num_patches == 16 + 60 and s.num_image_tokens == 19
    assert s.num_tokens == 2 + 3 + 4 + 2 * 2 + 19
    assert SAMPLES[1].num_patches == 0 and SAMPLES[1].num_image_tokens == 0


def test_pack_layout() -> None:
    b = pack(SAMPLES)
    lens = [s.num_tokens for s in SAMPLES]
    assert b.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert b.input_ids.shape == (1, sum(lens)) and b.position_ids.shape == (3, 1, sum(lens))
    assert b.sample_ids == [7, 3, 11]
    assert b.pixel_values.shape == (96 + 76, 1176)
    assert b.image_grid_thw.tolist() == [[1, 12, 8], [1, 4, 4], [1, 6, 10]]
    for k, start in enumerate(b.cu_seqlens[:-1].tolist()):
        assert b.position_ids[:, 0, start].tolist() == [0, 0, 0]  # positions restart per sample
        end = b.cu_seqlens[k + 1].item()
        assert b.targets[0, end - 1].item() == IGNORE_INDEX  # no target crosses into the next sample
        assert torch.equal(b.targets[0, start:end], shifted_targets(SAMPLES[k].labels))
    assert b.num_supervised == sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in SAMPLES) == 18


def test_packed_loss_equals_sum_of_sample_losses() -> None:
    model = build_model(CFG, seed=0).eval()
    samples = SAMPLES  # sample 3 is fully supervised: its first token must not be a target of sample 7
    assert samples[1].labels[0].item() != IGNORE_INDEX
    with torch.no_grad():
        b = pack(samples)
        packed = model.language.loss_sum(b.input_ids, b.position_ids, b.targets,
                                         model.visual(b.pixel_values, b.image_grid_thw), b.cu_seqlens)
        singles = []
        for s in samples:
            embeds = model.visual(s.pixel_values, s.image_grid_thw) if s.num_patches else None
            singles.append(model.language.loss_sum(s.input_ids[None], s.position_ids[:, None],
                                                   shifted_targets(s.labels)[None], embeds))
    total = torch.stack(singles).sum()
    assert torch.allclose(packed, total, rtol=1e-5, atol=1e-4), (packed.item(), total.item())
    # and it is sensitive to what it should be: without cu_seqlens attention crosses samples
    with torch.no_grad():
        crossing = model.language.loss_sum(b.input_ids, b.position_ids, b.targets,
                                           model.visual(b.pixel_values, b.image_grid_thw), None)
    assert not torch.allclose(crossing, total, rtol=1e-5, atol=1e-4)


def test_batch_meta_is_host_metadata_of_the_packed_row():
    """``Batch.meta``: the sample boundaries, every placeholder's positions and the supervised rows of the packed
    row, as the model would find them on the device; only from host tensors (before ``to(device)``)."""
    import pytest

    b = pack(SAMPLES)
    meta = b.meta([CFG.image_token_id, CFG.video_token_id])
    assert meta.cu_seqlens == tuple(b.cu_seqlens.tolist()) and meta.cu_seqlens[-1] == b.num_tokens
    flat = b.input_ids.reshape(-1)
    assert torch.equal(meta.placeholders[CFG.image_token_id], torch.nonzero(flat == CFG.image_token_id).flatten())
    assert meta.placeholders[CFG.image_token_id].numel() == sum(s.num_image_tokens for s in SAMPLES) == 24 + 4 + 15
    assert meta.placeholders[CFG.video_token_id].numel() == 0
    assert torch.equal(b.targets.reshape(-1)[meta.label_rows], b.targets[b.targets != IGNORE_INDEX])
    assert meta.num_supervised == b.num_supervised
    with pytest.raises(ValueError, match="before Batch.to"):
        b.to("meta").meta()
