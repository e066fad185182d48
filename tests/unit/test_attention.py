"""packed_attention equals attention with an explicit block-diagonal mask, and builds no global mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dhp.models.layers import packed_attention


def masked_reference(q, k, v, cu, causal):
    seq = q.shape[0]
    seg = torch.zeros(seq, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        seg[a:b] = i
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= torch.ones(seq, seq, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed)
    return out.transpose(0, 1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_matches_block_mask(causal, kv_heads):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 16, 32, 40, 56, 59, 75])  # repeated and odd lengths
    q = torch.randn(75, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(75, kv_heads, 8, generator=g, requires_grad=True)
    v = torch.randn(75, kv_heads, 8, generator=g, requires_grad=True)
    out = packed_attention(q, k, v, cu, causal)
    ref = masked_reference(q, k, v, cu, causal)
    assert (out - ref).abs().max() < 1e-5
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max() < 1e-4


def test_sequence_length_mismatch_is_an_error():
    q = torch.zeros(10, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens ends at 8"):
        packed_attention(q, q, q, torch.tensor([0, 8]), causal=False)


def test_zero_tokens_keep_q_k_v_in_the_graph():
    """A rank with no tokens must still give its projections a gradient (zeros), as its FSDP peers do."""
    qkv = torch.nn.Linear(8, 3 * 8)
    x = torch.zeros(0, 8)
    q, k, v = qkv(x).view(0, 3, 2, 4).unbind(1)
    out = packed_attention(q, k, v, torch.tensor([0]), causal=False)
    assert out.shape == (0, 2, 4)
    out.sum().backward()
    assert qkv.weight.grad is not None and qkv.bias.grad is not None
    assert not qkv.weight.grad.any() and not qkv.bias.grad.any()
