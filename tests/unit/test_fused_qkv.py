"""The language model's fused GQA ``qkv_proj``: one matmul for q, k and v, the same attention as three projections,
and under tensor parallelism each rank's rows are its own q, k and v heads (unequal parts).

The distributed checks live beside the existing setups: shard-local HF loading of a TP rank's q/k/v heads in
``test_materialize.py``, TP parity in ``test_tensor_parallel.py`` / ``test_fsdp_tp.py``, the export of a TP-trained
model in ``tests/distributed/test_ray_parity.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dhp.models.layers import apply_rotary
from dhp.models.qwen2_5_vl.config import tiny
from dhp.models.qwen2_5_vl.parallelize import FusedColwise, rows_from_rank_order, rows_to_rank_order
from dhp.models.qwen2_5_vl.text import Attention, MRotary, text_qkv_sizes
from dhp.ops.attention import packed_attention
from dhp.parallel.tensor import check_tp

MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")


def text_cfg():
    cfg = tiny(vocab_size=300, image_token_id=290, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293).text
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 24)  # GQA, group 2
    return cfg


class _Matmuls(TorchDispatchMode):
    """The output shapes of the matrix products an op sequence runs (attention kernels are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in MATMULS:
            self.shapes.append(tuple(out.shape))
        return out


def _inputs(cfg, seq: int = 10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, cfg.hidden_size, generator=g)
    rope = MRotary(cfg)(torch.arange(seq).view(1, 1, -1).expand(3, 1, -1))
    return x, rope, torch.tensor([0, 4, seq])  # two packed segments


def _randomised(attn: Attention) -> Attention:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return attn


def test_text_attention_does_one_matmul_for_q_k_v() -> None:
    cfg = text_cfg()
    attn = Attention(cfg)
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    q_rows, kv_rows, _ = text_qkv_sizes(cfg)
    assert attn.qkv_proj.weight.shape == (q_rows + 2 * kv_rows, cfg.hidden_size) == (192, 96)
    assert attn.qkv_proj.bias is not None  # Qwen2's qkv bias
    x, rope, cu = _inputs(cfg)
    with _Matmuls() as seen:
        attn(x, rope, cu)
    assert seen.shapes == [(10, 192), (10, 96)]  # q, k and v in one product; then o_proj


def test_fused_attention_equals_three_projections() -> None:
    """The fused weight's rows [q; k; v] (96, 48, 48 rows) give exactly what HF's q_proj, k_proj, v_proj would."""
    cfg = text_cfg()
    attn = _randomised(Attention(cfg))
    x, rope, cu = _inputs(cfg)
    w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
    sizes = list(text_qkv_sizes(cfg))
    q, k, v = (F.linear(x, wp, bp).view(10, -1, cfg.head_dim)
               for wp, bp in zip(w.split(sizes), b.split(sizes), strict=True))
    assert (q.shape[1], k.shape[1]) == (4, 2)
    cos, sin = (r.reshape(10, -1) for r in rope)
    out = packed_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, cu, causal=True)
    want = attn.o_proj(out.view(1, 10, -1))
    torch.testing.assert_close(attn(x, rope, cu), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tp_rank_holds_its_own_q_k_and_v_heads(tp: int) -> None:
    """``FusedColwise``'s rank order: rank r's contiguous rows are [its q heads; its k heads; its v heads], and
    the attention run on that shard alone (its o_proj columns) is rank r's partial sum of the whole output."""
    cfg = text_cfg()
    whole = _randomised(Attention(cfg))
    x, rope, cu = _inputs(cfg)
    sizes = text_qkv_sizes(cfg)
    ordered = rows_to_rank_order(whole.qkv_proj.weight.detach(), sizes, tp)
    ordered_bias = rows_to_rank_order(whole.qkv_proj.bias.detach(), sizes, tp)
    torch.testing.assert_close(rows_from_rank_order(ordered, sizes, tp), whole.qkv_proj.weight.detach(), rtol=0,
                               atol=0)
    q, k, v = whole.qkv_proj.weight.detach().split(list(sizes))
    rows, q_rows, kv_rows = ordered.shape[0] // tp, sizes[0] // tp, sizes[1] // tp
    total = torch.zeros(1, 10, cfg.hidden_size)
    for r in range(tp):
        mine = ordered[r * rows:(r + 1) * rows]
        want = torch.cat([q[r * q_rows:(r + 1) * q_rows], k[r * kv_rows:(r + 1) * kv_rows],
                          v[r * kv_rows:(r + 1) * kv_rows]])
        assert torch.equal(mine, want), r
        local = Attention(cfg)  # this rank's shapes: (H + 2 KV) / tp heads in, H / tp heads out
        local.qkv_proj = torch.nn.Linear(cfg.hidden_size, rows)
        local.o_proj = torch.nn.Linear(q_rows, cfg.hidden_size, bias=False)
        with torch.no_grad():
            local.qkv_proj.weight.copy_(mine)
            local.qkv_proj.bias.copy_(ordered_bias[r * rows:(r + 1) * rows])
            local.o_proj.weight.copy_(whole.o_proj.weight[:, r * q_rows:(r + 1) * q_rows])
        total += local(x, rope, cu)
    torch.testing.assert_close(total, whole(x, rope, cu), rtol=1e-5, atol=1e-6)


def test_tp_must_divide_the_kv_heads() -> None:
    """The rule stays: every rank holds whole key/value heads (tp 4 over 2 KV heads is refused, by name)."""
    cfg = text_cfg()
    check_tp(cfg.num_key_value_heads, 2)
    with pytest.raises(ValueError, match=r"4.*(KV|key/value) heads|(KV|key/value) heads.*4"):
        check_tp(cfg.num_key_value_heads, 4)
    with pytest.raises(ValueError, match=r"must divide every part of the fused .*\[96, 48, 48\]"):
        FusedColwise(text_qkv_sizes(cfg))._partition_linear_fn("qkv_proj", Attention(cfg).qkv_proj,
                                                               _FakeMesh(5))


class _FakeMesh:
    """Only the size (the divisibility check runs before any DTensor is made)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n
