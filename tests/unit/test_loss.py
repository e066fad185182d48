"""The chunked cross entropy through the head equals the whole-logits one: loss and both gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dhp.config import load_config
from dhp.models.loss import chunked_linear_cross_entropy_sum
from dhp.models.qwen2_5_vl.config import preset
from dhp.models.registry import get_family


def _whole(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def _case(seed: int, b: int, n: int, d: int, v: int, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n, d, generator=g, dtype=dtype)
    weight = torch.randn(v, d, generator=g, dtype=dtype) / d**0.5
    targets = torch.randint(0, v, (b, n), generator=g)
    targets[torch.rand(b, n, generator=g) < 0.4] = -100  # unsupervised tokens, some whole chunks of them
    targets[:, :3] = -100
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, targets, scale: float = 1.0):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize(("chunk", "shape"), [(1, (1, 9, 4, 11)), (3, (2, 10, 8, 23)), (7, (3, 17, 6, 31)),
                                              (64, (2, 10, 8, 23))])
def test_equals_whole_logits(chunk, shape):
    """float64 matmuls, the loss in float32 on both paths: equal to float32 rounding (a wrong chunk boundary,
    mask or gradient term is off by far more)."""
    hidden, weight, targets = _case(sum(shape) + chunk, *shape)
    ref = _loss_and_grads(_whole, hidden, weight, targets, scale=0.37)
    got = _loss_and_grads(lambda h, w, t: chunked_linear_cross_entropy_sum(h, w, t, chunk), hidden, weight, targets,
                          scale=0.37)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_follows_the_whole_path():
    """Logits in autocast's bf16, the loss in float32, the weight's gradient back in its own float32."""
    hidden, weight, targets = _case(5, 2, 24, 16, 40, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(_whole, hidden, weight, targets)
        got = _loss_and_grads(lambda h, w, t: chunked_linear_cross_entropy_sum(h, w, t, 5), hidden, weight, targets)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], ref[1:], strict=True):  # bf16 matmuls: blocked sums round differently
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_no_supervised_token_gives_zero_loss_and_gradients():
    hidden, weight, targets = _case(2, 1, 8, 4, 9)
    targets[:] = -100
    loss, gh, gw = _loss_and_grads(lambda h, w, t: chunked_linear_cross_entropy_sum(h, w, t, 3), hidden, weight,
                                   targets)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_chunk_must_be_positive():
    hidden, weight, targets = _case(0, 1, 4, 4, 5)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_linear_cross_entropy_sum(hidden, weight, targets, 0)


def test_text_model_loss_sum_chunks_past_the_setting():
    """The language module with tied embeddings (both uses of the weight get their gradient): the chunked
    ``loss_sum`` equals the whole one, and a micro-batch within the setting takes the whole path."""
    tiny = preset("tiny")
    cfg = dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, tie_word_embeddings=True))
    torch.manual_seed(0)
    model = get_family("qwen2_5_vl").module("text").build(cfg).double()
    assert model.lm_head.weight is model.embed_tokens.weight and model.loss_chunk_tokens == 0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 13), generator=g)
    pos = torch.arange(13).expand(3, 2, 13)
    targets = ids.roll(-1, 1)
    targets[:, :4] = -100

    def run(chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        model.loss_chunk_tokens = chunk
        loss = model.loss_sum(ids, pos, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, chunked, within = run(0), run(5), run(26)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    for n, grad in whole[1].items():
        torch.testing.assert_close(chunked[1][n], grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(within[0], whole[0])


def test_the_setting_reaches_the_language_module_and_is_checked():
    assert load_config(None, []).train.loss_chunk_tokens > 0  # on by default
    with pytest.raises(Exception, match="train.loss_chunk_tokens"):
        load_config(None, ["train.loss_chunk_tokens=-1"])


@pytest.mark.parametrize("chunk", [0, 5])
def test_loss_over_labelled_rows_equals_the_loss_over_all_rows(chunk):
    """With the batch's host metadata (``PackedMeta``) only the supervised rows go through ``lm_head`` (whole or
    chunked), and the placeholders are filled at host positions: the same loss and gradients (embeddings'
    included) as every row through the head and placeholders found on the ids; 9 of 26 rows supervised."""
    from dhp.data.batch import PackedMeta

    tiny = dataclasses.replace(preset("tiny"), image_token_id=300)  # inside the tiny vocabulary
    torch.manual_seed(0)
    model = get_family("qwen2_5_vl").module("text").build(tiny).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 13), generator=g)
    ids[0, 2:5] = ids[1, 7:9] = tiny.image_token_id  # 5 placeholders in two rows
    pos = torch.arange(13).expand(3, 2, 13)
    targets = ids.roll(-1, 1)
    targets[:, :8] = -100
    targets[0, 10] = -100
    embeds = torch.randn(5, tiny.text.hidden_size, generator=g, dtype=torch.float64)
    flat_t, flat_ids = targets.reshape(-1), ids.reshape(-1)
    meta = PackedMeta(cu_seqlens=(0, 13, 26), label_rows=(flat_t != -100).nonzero().flatten(),
                      placeholders={tiny.image_token_id: (flat_ids == tiny.image_token_id).nonzero().flatten()})
    assert meta.num_supervised == 9

    def run(chunk: int, meta: PackedMeta | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        model.zero_grad()
        model.loss_chunk_tokens = chunk
        media = embeds.clone().requires_grad_()
        loss = model.loss_sum(ids, pos, targets, media, meta=meta)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, media.grad

    ref, got = run(0, None), run(chunk, meta)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for n, grad in ref[1].items():
        torch.testing.assert_close(got[1][n], grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="5 placeholder tokens"):  # a count that differs is still an error
        model.loss_sum(ids, pos, targets, embeds[:4], meta=meta)
