"""DeepSpeed-Ulysses sequence parallelism for the Qwen2.5-VL vision encoder.

Why: the vision encoder's memory is activations (up to ~65k patches per image,
hidden 1280), not weights, so it is split along the sequence, not the weights.
Every rank of an SP group holds all weights and a contiguous slice of the
window-ordered patch sequence of the replica's packed images.

Why cut at window boundaries: most blocks attend only inside windows of 4x4
merged tokens (64 patches). A slice that never splits a window runs those
blocks, the MLPs, the norms and the merger locally with no communication at
all; so does the merger, since a window holds whole 2x2 merge units.

Only the few full-attention blocks (per image/frame) need the whole sequence.
There Ulysses swaps the sharded dimension with two all-to-alls:

    q, k, v [S_local, H, hd]  --all-to-all-->  [S_total, H/sp, hd]   (all tokens, some heads)
    packed_attention per image on the GLOBAL cu_full
    out [S_total, H/sp, hd]   --all-to-all-->  [S_local, H, hd]      (back to own tokens, all heads)

so ``sp`` must divide the number of heads. Slices may be uneven (windows have
different sizes) or empty (fewer windows than ranks): the all-to-alls use
explicit split sizes and every rank always takes part.

Gradients: each SP rank produces partial gradients of the replicated weights
(its own tokens' share); summing them over the SP group (the DP/SP all-reduce
of the sharding layer) gives the unsharded gradient.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhp.models.layers import packed_attention
from dhp.models.qwen2_5_vl.vision import VisionLayout, VisionTransformer

# ---------------------------------------------------------------------------------------------
# communication accounting


class CommCounter:
    """Bytes this rank sent to OTHER ranks, by kind (e.g. ``alltoall.fwd``, ``alltoall.bwd``)."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self._bytes[kind] += int(nbytes)

    def snapshot(self) -> dict[str, int]:
        return dict(self._bytes)

    def total(self) -> int:
        return sum(self._bytes.values())

    def reset(self) -> None:
        self._bytes.clear()


COMM = CommCounter()  # the default counter every all-to-all of this module adds to


def expected_alltoall_bytes(
    split_sizes: list[int],
    rank: int,
    num_heads: int,
    head_dim: int,
    elem_size: int,
    n_full_blocks: int,
    backward: bool,
) -> int:
    """Closed form of the bytes ``rank`` sends to other ranks: the forward pass, plus the backward when asked.

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
# sharding the window-ordered sequence


@dataclass(frozen=True)
class VisionShard:
    """One SP rank's contiguous slice of a replica's window-ordered patch sequence."""

    rank: int
    offset: int  # first patch of the slice in the replica's window order
    num_patches: int  # S_local, a multiple of merge_unit (may be 0)
    patch_rows: torch.Tensor  # [S_local] row of each local patch (window order) in the packed pixel_values
    rotary_pos: torch.Tensor  # [S_local, 2] (h, w) of each local patch
    cu_window: torch.Tensor  # [n_local_windows + 1] local window boundaries, from 0 to S_local
    merged_index: torch.Tensor  # [S_local/4] image-order merged-token index of each local merged token
    cu_full: torch.Tensor  # [n_frames + 1] GLOBAL image/frame boundaries (for full attention)
    split_sizes: list[int]  # [sp] patches of every rank (for the all-to-alls)


def check_sp(num_heads: int, sp: int) -> None:
    """Ulysses gives each rank H/sp whole heads: sp must be positive and divide the head count."""
    if sp < 1:
        raise ValueError(f"sequence-parallel size must be >= 1, got {sp}")
    if num_heads % sp:
        raise ValueError(
            f"sequence-parallel size {sp} does not divide the vision encoder's {num_heads} attention heads "
            f"(Ulysses gives every rank num_heads/sp whole heads)"
        )


def _cut_points(bounds: list[int], sp: int) -> list[int]:
    """Greedy balance: each cut at the window boundary nearest to k * S / sp (never splitting a window).

    Targets grow with k and the nearest boundary grows with the target, so the cuts are monotone and
    every chunk is within one window of S / sp.
    """
    total = bounds[-1]
    cuts = [0]
    for k in range(1, sp):
        target = k * total / sp
        i = bisect.bisect_left(bounds, target)
        lo, hi = bounds[max(i - 1, 0)], bounds[min(i, len(bounds) - 1)]
        cut = lo if target - lo <= hi - target else hi
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    return cuts


def shard_vision(layout: VisionLayout, sp_size: int, merge_unit: int = 4) -> list[VisionShard]:
    """Cut the window-ordered sequence into ``sp_size`` contiguous slices at window boundaries."""
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    bounds = layout.cu_window_seqlens.tolist()
    cuts = _cut_points(bounds, sp_size)
    split_sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return [
        _shard(layout, rank, cuts[rank], cuts[rank + 1], bounds, split_sizes, merge_unit) for rank in range(sp_size)
    ]


def _shard(
    layout: VisionLayout, rank: int, start: int, end: int, bounds: list[int], split_sizes: list[int], unit: int
) -> VisionShard:
    merged = layout.window_index[start // unit : end // unit]  # [S_local/4] image-order merged units
    patch_rows = (merged[:, None] * unit + torch.arange(unit)).reshape(-1)  # [S_local] 4 patches per unit
    local_bounds = [b - start for b in bounds if start <= b <= end]
    return VisionShard(
        rank=rank,
        offset=start,
        num_patches=end - start,
        patch_rows=patch_rows,
        rotary_pos=layout.rotary_pos[start:end],
        cu_window=torch.tensor(local_bounds, dtype=torch.long),
        merged_index=merged.clone(),
        cu_full=layout.cu_seqlens,
        split_sizes=list(split_sizes),
    )


def to_image_order(pieces: list[torch.Tensor], shards: list[VisionShard]) -> torch.Tensor:
    """Reassemble every rank's merged tokens ``[S_r/4, D]`` into the replica's image order ``[N/4, D]``."""
    index = torch.cat([s.merged_index for s in shards]).to(pieces[0].device)
    out = pieces[0].new_empty(len(index), pieces[0].shape[-1])
    out[index] = torch.cat(pieces)
    return out


# ---------------------------------------------------------------------------------------------
# the all-to-alls (autograd-aware)


def _all_to_all(
    x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: dist.ProcessGroup | None, kind: str
) -> torch.Tensor:
    """all_to_all_single along dim 0 with explicit splits; counts the bytes sent to other ranks."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv_rows, input_split_sizes=send_rows, group=group)
    rank = dist.get_rank(group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    COMM.add(kind, (sum(send_rows) - send_rows[rank]) * row_bytes)
    return out


def _seq_to_heads(x: torch.Tensor, split_sizes: list[int], group, kind: str) -> torch.Tensor:
    """[S_local, G, H, hd] -> [S_total, G, H/sp, hd]: all tokens of the replica, this rank's heads."""
    sp = len(split_sizes)
    s, g, h, hd = x.shape
    send = x.view(s, g, sp, h // sp, hd).permute(2, 0, 1, 3, 4).reshape(sp * s, g, h // sp, hd)  # head chunk j first
    return _all_to_all(send, [s] * sp, split_sizes, group, kind)  # rows arrive in rank = sequence order


def _heads_to_seq(y: torch.Tensor, split_sizes: list[int], group, kind: str) -> torch.Tensor:
    """[S_total, G, H/sp, hd] -> [S_local, G, H, hd]: this rank's tokens, all heads."""
    sp, rank = len(split_sizes), dist.get_rank(group)
    s = split_sizes[rank]
    _, g, hs, hd = y.shape
    recv = _all_to_all(y, split_sizes, [s] * sp, group, kind)  # [sp * S_local, G, H/sp, hd], by head chunk
    return recv.view(sp, s, g, hs, hd).permute(1, 2, 0, 3, 4).reshape(s, g, sp * hs, hd)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
        ctx.split_sizes, ctx.group = split_sizes, group
        return _seq_to_heads(x, split_sizes, group, "alltoall.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # the adjoint of a permutation is its inverse
        return _heads_to_seq(grad, ctx.split_sizes, ctx.group, "alltoall.bwd"), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
        ctx.split_sizes, ctx.group = split_sizes, group
        return _heads_to_seq(y, split_sizes, group, "alltoall.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.split_sizes, ctx.group, "alltoall.bwd"), None, None


def ulysses_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_full: torch.Tensor,
    split_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Full (per image) attention over a sequence sharded across ``group``: q/k/v/out [S_local, H, hd].

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

    cu_seqlens: torch.Tensor  # [n_frames + 1] GLOBAL image/frame boundaries
    split_sizes: list[int]  # [sp] patches of every rank


class UlyssesAttention:
    """Replaces ``VisionAttention.attend`` of a full-attention block."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: UlyssesSegments) -> torch.Tensor:
        if not isinstance(segments, UlyssesSegments):
            raise RuntimeError("UlyssesAttention called outside sp_forward: no split sizes for this batch")
        return ulysses_attend(q, k, v, segments.cu_seqlens, segments.split_sizes, self.group)


# ---------------------------------------------------------------------------------------------
# applying the plan


def parallelize_vision_sp(model: VisionTransformer, group: dist.ProcessGroup | None) -> None:
    """Install Ulysses attention on the full-attention blocks; window blocks keep local attention."""
    check_sp(model.cfg.num_heads, dist.get_world_size(group))
    for block in model.blocks:
        if block.full_attention:
            block.attn.attend = UlyssesAttention(group)  # instance attribute shadows the method


def sp_forward(
    model: VisionTransformer, pixel_values: torch.Tensor, shard: VisionShard, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's slice through the encoder: -> [S_local/4, D] merged tokens, window order.

    Row i belongs to image-order merged token ``shard.merged_index[i]``. ``pixel_values`` are the replica's
    packed patches [N, patch_dim] (image order); only this rank's rows are embedded.
    """
    full = [b for b in model.blocks if b.full_attention]
    if full and not all(isinstance(b.attn.__dict__.get("attend"), UlyssesAttention) for b in full):
        raise RuntimeError("sp_forward needs parallelize_vision_sp(model, group) first")
    if len(shard.split_sizes) != dist.get_world_size(group):
        raise ValueError(f"shard cut for {len(shard.split_sizes)} ranks, SP group has {dist.get_world_size(group)}")
    segments = UlyssesSegments(shard.cu_full, shard.split_sizes)
    # [S_local/4, D], window order
    return model.encode_rows(pixel_values, shard.patch_rows, shard.rotary_pos, shard.cu_window, segments)
