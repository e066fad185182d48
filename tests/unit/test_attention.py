"""packed_attention equals attention with an explicit block-diagonal mask, and builds no global mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dhp.ops.attention import Segments, packed_attention


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


@pytest.mark.parametrize("causal", [False, True])
def test_segments_host_metadata_equal_the_tensor_boundaries(causal):
    """``Segments`` (host metadata, made once per batch) gives the tensor path's result, on uneven segments and
    on equal ones end to end (a view, no gather); its device tensors are made once and shared by every call."""
    g = torch.Generator().manual_seed(3)
    for bounds in ([0, 16, 32, 40, 56, 59, 75], [0, 25, 50, 75], [0, 0, 75, 75]):
        q, k, v = (torch.randn(75, 4, 8, generator=g) for _ in range(3))
        segments = Segments(bounds)
        out = packed_attention(q, k, v, segments, causal)
        ref = masked_reference(q, k, v, torch.tensor(bounds), causal)
        assert (out - ref).abs().max() < 1e-5, bounds
        groups = segments.length_groups(q.device)
        assert packed_attention(q, k, v, segments, causal).equal(out)
        assert segments.length_groups(q.device) is groups  # cached: no second index build per layer
    assert Segments([0, 25, 50, 75]).length_groups(q.device)[0][2] is None  # equal segments: no gather index
    base = Segments([0, 5, 9])
    assert base.padded(3).bounds == (0, 5, 9, 12) and base.padded(3) is base.padded(3) and base.padded(0) is base
    with pytest.raises(ValueError, match="never decrease"):
        Segments([0, 5, 3])


def test_attention_kernel_selection():
    """auto: varlen only for a CUDA tensor in half precision where a kernel is installed (never on the CPU, in
    float32, or in the planner's shape-only run); varlen asked where it cannot run is an error naming the key."""
    from dhp.ops.attention import attention_kernel, varlen_kernel

    cpu = torch.zeros(4, 2, 8)
    assert attention_kernel("auto", cpu) == attention_kernel("sdpa", cpu) == "sdpa"
    assert attention_kernel("auto", cpu.bfloat16()) == "sdpa"
    assert attention_kernel("varlen", torch.zeros(4, 2, 8, device="meta")) == "sdpa"  # shape only: SDPA's price
    with pytest.raises(ValueError, match="train.attention=varlen"):
        attention_kernel("varlen", cpu)
    assert varlen_kernel() == "torch"  # torch.nn.attention.varlen ships with this torch
    with pytest.raises(ValueError, match="attention kernel"):
        Segments([0, 4], kernel="flash")


def test_the_attention_setting_is_checked_and_reaches_the_modules(demo_overrides):
    from dhp.backends.local import LocalBackend
    from dhp.config import load_config
    from dhp.inputs import dataset_spec, open_dataset, resolve_inputs

    with pytest.raises(Exception, match="train.attention"):
        load_config(None, ["train.attention=flash"])
    cfg = load_config(None, [*demo_overrides, "train.attention=sdpa"])
    inputs = resolve_inputs(cfg)
    backend = LocalBackend(inputs, open_dataset(dataset_spec(inputs, inputs.train_path)))
    assert {e.module.attention_kernel for e in backend.engines} == {"sdpa"}
