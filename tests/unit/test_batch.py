"""Packing: positions restart, targets shift per sample, and a packed batch's loss is the sum of its samples'."""

from __future__ import annotations

import torch

from dhp.data.batch import IGNORE_INDEX, Sample, pack, shifted_targets
from dhp.models.qwen2_5_vl import build_model
from dhp.models.qwen2_5_vl.mrope import rope_index
from dhp.models.qwen2_5_vl.processor import num_image_tokens, num_patches
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
    assert num_patches(s) == 16 + 60 and num_image_tokens(s) == 19
    assert s.num_tokens == 2 + 3 + 4 + 2 * 2 + 19
    assert num_patches(SAMPLES[1]) == 0 and num_image_tokens(SAMPLES[1]) == 0
    assert s.token_counts[CFG.image_token_id] == 19 and s.token_counts[CFG.vision_start_token_id] == 2
    assert CFG.image_token_id not in SAMPLES[1].token_counts
    assert sum(s.token_counts.values()) == s.num_tokens


def test_sample_media_fields_are_the_processors() -> None:
    """A sample's media fields are whatever it was given: attributes and ``media`` alike; a missing one is an
    AttributeError naming the fields there are; the loader's tensor mapping and pickling keep them."""
    import pickle

    import pytest

    from dhp.data.loader import map_tensors

    s = SAMPLES[0]
    assert set(s.media) == {"pixel_values", "image_grid_thw"} and s.pixel_values is s.media["pixel_values"]
    with pytest.raises(AttributeError, match="no field 'audio_features'.*pixel_values, image_grid_thw"):
        _ = s.audio_features
    assert getattr(s, "audio_features", None) is None
    s2 = map_tensors(s, lambda t: t + 0)  # a new sample, new tensors: what pinning and to_device do
    assert s2 is not s and s2.pixel_values is not s.pixel_values and torch.equal(s2.pixel_values, s.pixel_values)
    s3 = pickle.loads(pickle.dumps(s))
    assert torch.equal(s3.pixel_values, s.pixel_values) and torch.equal(s3.input_ids, s.input_ids)
    s3.pixel_values = torch.zeros(0, 1176)  # setting a media field sets it in ``media``
    assert s3.media["pixel_values"].shape == (0, 1176) and s.pixel_values.shape[0] == 96


def test_pack_layout() -> None:
    b = pack(SAMPLES)
    lens = [s.num_tokens for s in SAMPLES]
    assert b.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert b.input_ids.shape == (1, sum(lens)) and b.position_ids.shape == (3, 1, sum(lens))
    assert b.sample_ids == [7, 3, 11]
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
        pixels, grids = torch.cat([s.pixel_values for s in samples]), torch.cat([s.image_grid_thw for s in samples])
        assert pixels.shape == (96 + 76, 1176) and grids.tolist() == [[1, 12, 8], [1, 4, 4], [1, 6, 10]]
        packed = model.language.loss_sum(b.input_ids, b.position_ids, b.targets, model.visual(pixels, grids),
                                         b.cu_seqlens)
        singles = []
        for s in samples:
            embeds = model.visual(s.pixel_values, s.image_grid_thw) if num_patches(s) else None
            singles.append(model.language.loss_sum(s.input_ids[None], s.position_ids[:, None],
                                                   shifted_targets(s.labels)[None], embeds))
    total = torch.stack(singles).sum()
    assert torch.allclose(packed, total, rtol=1e-5, atol=1e-4), (packed.item(), total.item())
    # and it is sensitive to what it should be: without cu_seqlens attention crosses samples
    with torch.no_grad():
        crossing = model.language.loss_sum(b.input_ids, b.position_ids, b.targets, model.visual(pixels, grids), None)
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
    assert meta.placeholders[CFG.image_token_id].numel() == sum(num_image_tokens(s) for s in SAMPLES) == 24 + 4 + 15
    assert meta.placeholders[CFG.video_token_id].numel() == 0
    assert torch.equal(b.targets.reshape(-1)[meta.label_rows], b.targets[b.targets != IGNORE_INDEX])
    assert meta.num_supervised == b.num_supervised
    with pytest.raises(ValueError, match="before Batch.to"):
        b.to("meta").meta()


def test_padded_pack_is_the_same_loss_and_gradients() -> None:
    """``pack(samples, multiple)``: the row rounded up to the multiple by one segment of its own (ids ``PAD_ID``,
    positions from 0, no target); the loss and every gradient equal the unpadded row's, and a row already at a
    multiple is left as it is."""
    import pytest

    from dhp.data.batch import PAD_ID, padded_length

    n = sum(s.num_tokens for s in SAMPLES)
    assert [padded_length(k, 16) for k in (0, 1, 16, 17)] == [0, 16, 16, 32]
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        padded_length(5, 0)
    assert torch.equal(pack(SAMPLES, 1).input_ids, pack(SAMPLES).input_ids)
    b = pack(SAMPLES, 64)
    pad = padded_length(n, 64) - n
    assert 0 < pad < 64 and b.num_tokens == n + pad and b.num_tokens % 64 == 0
    assert b.cu_seqlens.tolist() == [*pack(SAMPLES).cu_seqlens.tolist(), n + pad]
    assert b.input_ids[0, n:].eq(PAD_ID).all() and b.targets[0, n:].eq(IGNORE_INDEX).all()
    assert b.position_ids[:, 0, n:].tolist() == [list(range(pad))] * 3
    assert b.num_supervised == pack(SAMPLES).num_supervised and b.sample_ids == [7, 3, 11]
    exact = pack(SAMPLES, n)
    assert exact.num_tokens == n and len(exact.cu_seqlens) == len(SAMPLES) + 1

    model = build_model(CFG, seed=0)
    pixels, grids = torch.cat([s.pixel_values for s in SAMPLES]), torch.cat([s.image_grid_thw for s in SAMPLES])
    embeds = model.visual(pixels, grids).detach()

    def loss_and_grads(batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        model.zero_grad(set_to_none=True)
        leaf = embeds.clone().requires_grad_()
        loss = model.language.loss_sum(batch.input_ids, batch.position_ids, batch.targets, leaf, batch.cu_seqlens)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.language.named_parameters()}, leaf.grad

    loss, grads, media = loss_and_grads(pack(SAMPLES))
    loss_p, grads_p, media_p = loss_and_grads(b)
    assert torch.allclose(loss_p, loss, rtol=1e-6, atol=1e-6)
    for k in grads:
        assert torch.allclose(grads_p[k], grads[k], rtol=1e-5, atol=1e-7), k
    assert torch.allclose(media_p, media, rtol=1e-5, atol=1e-7)
    # and the comparison sees the padding: were its tokens targets, the loss would move
    supervised = pack(SAMPLES, 64)
    supervised.targets[0, n:] = PAD_ID
    assert not torch.allclose(loss_and_grads(supervised)[0], loss, rtol=1e-6, atol=1e-6)
