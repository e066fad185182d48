"""DeepSpeed-Ulysses sequence parallelism: full attention over a sequence sharded across ranks.

Generic: any encoder whose attention takes ``(q, k, v, segments)`` can use it.
Every rank of an SP group holds all weights and a contiguous slice of the
sequence; where a model cuts its sequence is the model family's business (the
Qwen2.5-VL vision encoder cuts its window-ordered patches at window boundaries,
so that only its full-attention blocks communicate: see
``dhp/models/qwen2_5_vl/sequence_parallel.py``).

Why: an encoder whose memory is activations (the vision encoder: up to ~65k
patches per image, hidden 1280), not weights, is split along the sequence, not
the weights.

Full attention needs the whole sequence. Ulysses swaps the sharded dimension
with two all-to-alls:

    q, k, v [S_local, H, hd]  --all-to-all-->  [S_total, H/sp, hd]   (all tokens, some heads)
    packed_attention per segment on the GLOBAL cu_seqlens
    out [S_total, H/sp, hd]   --all-to-all-->  [S_local, H, hd]      (back to own tokens, all heads)

so ``sp`` must divide the number of heads. Slices may be uneven or empty (fewer
pieces than ranks): the all-to-alls use explicit split sizes and every rank
always takes part. The bytes they move are counted like every other
collective's, by ``dhp.parallel.comm.CommCounter`` (``sent``: bytes to other
ranks); ``expected_alltoall_bytes`` is their closed form.

Gradients: each SP rank produces partial gradients of the replicated weights
(its own tokens' share); summing them over the SP group (the DP/SP all-reduce
of the sharding layer) gives the unsharded gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhp.ops.attention import packed_attention

# ---------------------------------------------------------------------------------------------
# communication: closed form


def expected_alltoall_bytes(
    split_sizes: list[int],
    rank: int,
    num_heads: int,
    head_dim: int,
    elem_size: int,
    n_full_blocks: int,
    backward: bool,
) -> int:
    """Closed form of the bytes ``rank`` sends to other ranks (``CommCounter.sent["all_to_all"]``) over the
    full-attention blocks: the forward pass, plus the backward when asked.

    Per full-attention block, with sp = len(split_sizes), S_r = split_sizes[rank], S = sum(split_sizes) and
    one token-row of one tensor on a rank after the swap being (H/sp) * hd elements:

        seq->heads of a [S_r, H, hd] tensor:   rank r keeps its own head chunk, sends (sp-1) * S_r rows
        heads->seq of a [S, H/sp, hd] tensor:  rank r keeps its own tokens,     sends (S - S_r) rows

    forward  = 3 tensors (q, k, v) seq->heads + 1 (out) heads->seq = 3 (sp-1) S_r + (S - S_r)   rows
    backward = the adjoints run the other way:  3 (S - S_r) + (sp-1) S_r                          rows
    """
    sp = len(split_sizes)
    s_r, s = split_sizes[rank], sum(split_sizes)
    row = num_heads // sp * head_dim * elem_size
    seq_to_heads, heads_to_seq = (sp - 1) * s_r, s - s_r
    rows = 3 * seq_to_heads + heads_to_seq
    if backward:
        rows += 3 * heads_to_seq + seq_to_heads
    return rows * row * n_full_blocks


# ---------------------------------------------------------------------------------------------
# the SP size


def check_sp(num_heads: int, sp: int) -> None:
    """Ulysses gives each rank H/sp whole heads: sp must be positive and divide the head count."""
    from dhp.parallel.tensor import heads_problem

    problem = heads_problem("parallel.sp", sp, num_heads, "attention heads (Ulysses: whole heads per rank)")
    if problem:
        raise ValueError(problem)


# ---------------------------------------------------------------------------------------------
# the all-to-alls (autograd-aware)


def _all_to_all(
    x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """all_to_all_single along dim 0 with explicit splits."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv_rows, input_split_sizes=send_rows, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
    """[S_local, G, H, hd] -> [S_total, G, H/sp, hd]: all tokens of the replica, this rank's heads."""
    sp = len(split_sizes)
    s, g, h, hd = x.shape
    send = x.view(s, g, sp, h // sp, hd).permute(2, 0, 1, 3, 4).reshape(sp * s, g, h // sp, hd)  # head chunk j first
    return _all_to_all(send, [s] * sp, split_sizes, group)  # rows arrive in rank = sequence order


def _heads_to_seq(y: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
    """[S_total, G, H/sp, hd] -> [S_local, G, H, hd]: this rank's tokens, all heads."""
    sp, rank = len(split_sizes), dist.get_rank(group)
    s = split_sizes[rank]
    _, g, hs, hd = y.shape
    recv = _all_to_all(y, split_sizes, [s] * sp, group)  # [sp * S_local, G, H/sp, hd], by head chunk
    return recv.view(sp, s, g, hs, hd).permute(1, 2, 0, 3, 4).reshape(s, g, sp * hs, hd)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
        ctx.split_sizes, ctx.group = split_sizes, group
        return _seq_to_heads(x, split_sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # the adjoint of a permutation is its inverse
        return _heads_to_seq(grad, ctx.split_sizes, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
        ctx.split_sizes, ctx.group = split_sizes, group
        return _heads_to_seq(y, split_sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.split_sizes, ctx.group), None, None


def ulysses_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_full: torch.Tensor,
    split_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Full (per segment, e.g. image) attention over a sequence sharded across ``group``: q/k/v/out [S_local, H, hd].

    q, k, v travel in ONE all-to-all (stacked), so the order of collectives is the same on every rank in
    both passes; the bytes are those of three separate tensors.
    """
    if len(split_sizes) != dist.get_world_size(group):
        raise ValueError(f"{len(split_sizes)} split sizes for an SP group of {dist.get_world_size(group)} ranks")
    qkv = torch.stack([q, k, v], dim=1)  # [S_local, 3, H, hd]
    qkv = _SeqToHeads.apply(qkv, split_sizes, group)  # [S_total, 3, H/sp, hd]
    out = packed_attention(*qkv.unbind(1), cu_full, causal=False)  # [S_total, H/sp, hd]
    return _HeadsToSeq.apply(out[:, None], split_sizes, group)[:, 0]  # [S_local, H, hd]


@dataclass(frozen=True)
class UlyssesSegments:
    """The full-attention segments of a batch and every rank's share of it, passed down as the blocks' argument
    (not stored on the modules), so recomputation under activation checkpointing and pipelined micro-batches
    (forward mb0, forward mb1, backward mb0) each see their own batch's split."""

    cu_seqlens: torch.Tensor  # [n_segments + 1] GLOBAL segment (e.g. image/frame) boundaries
    split_sizes: list[int]  # [sp] tokens of every rank


class UlyssesAttention:
    """Replaces the ``attend(q, k, v, segments)`` of a full-attention block (e.g. ``VisionAttention.attend``)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: UlyssesSegments) -> torch.Tensor:
        if not isinstance(segments, UlyssesSegments):
            raise RuntimeError(
                "UlyssesAttention called without UlyssesSegments (outside the model's SP forward, e.g. sp_forward): "
                "no split sizes for this batch"
            )
        return ulysses_attend(q, k, v, segments.cu_seqlens, segments.split_sizes, self.group)
