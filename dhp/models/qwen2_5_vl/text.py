"""The Qwen2.5-VL language model (a Qwen2 decoder with M-RoPE), top to bottom.

input_ids [B, L]
  -> embed_tokens, image embeddings placed at <|image_pad|>   [B, L, D]
  -> layers x n: RMSNorm, GQA attention (qkv bias, M-RoPE), RMSNorm, SwiGLU
  -> norm, lm_head                                           [B, L, V]

M-RoPE: each token has 3 positions (temporal, height, width; equal for text).
The rotary frequencies of a head are split in ``mrope_section`` chunks that
take their angle from the t, h and w position respectively.

Packing: several samples may share one row; ``cu_seqlens`` (the boundaries of
the samples in the flattened [B*L] sequence) keeps attention inside a sample.
Without it each row is one causal sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from dhp.models.layers import RMSNorm, SwiGLU, apply_rotary, compute_dtype
from dhp.models.loss import chunked_linear_cross_entropy_sum
from dhp.models.qwen2_5_vl.config import TextConfig
from dhp.ops.attention import Segments, has_values, packed_attention
from dhp.parallel.tensor import vocab_parallel_cross_entropy_sum

if TYPE_CHECKING:
    from dhp.data.batch import PackedMeta

# image embeddings, or {placeholder id: embeddings, or (embeddings, their flat positions): a sequence slice's}
Media = torch.Tensor | dict[int, torch.Tensor | tuple[torch.Tensor | None, torch.Tensor] | None] | None


class MRotary(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.section = list(cfg.mrope_section)

    def _inv_freq(self) -> torch.Tensor:
        hd = self.head_dim
        return 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (after ``to_empty``): on the CPU, as at construction, then copied in."""
        with torch.device("cpu"):
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [3, B, L] -> cos, sin [B, L, head_dim]."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [3, B, L, hd/2]
        chunks = freqs.split(self.section, dim=-1)
        freqs = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)  # [B, L, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def text_qkv_sizes(cfg: TextConfig) -> tuple[int, int, int]:
    """Rows of q, k and v in a decoder layer's fused ``qkv_proj`` (GQA: k and v have fewer heads)."""
    hd = cfg.head_dim
    return cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd


class Attention(nn.Module):
    """GQA attention (qkv bias, M-RoPE) with one fused ``qkv_proj``: rows ``[q (H*hd); k (KV*hd); v (KV*hd)]``,
    one matmul for the three (HF keeps ``q_proj``, ``k_proj``, ``v_proj``: the weight adapter maps them). Under
    text TP the rows are rank-ordered (``FusedColwise``): each rank's local output is ``[its q; its k; its v]``
    heads, in the same proportion, so the head counts come from the local width. A subclass may drop the qkv
    bias (``qkv_bias``) and transform the q and k heads before the rotary (``norm_qk``: Qwen3's per-head norm)."""

    qkv_bias: bool = True

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(text_qkv_sizes(cfg)), bias=self.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: Segments | torch.Tensor
    ) -> torch.Tensor:
        b, seq, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, L, (Hq + 2 Hkv) * hd]; the local heads under tensor parallelism
        heads = qkv.shape[-1] // self.head_dim
        kv = heads // (self.num_heads // self.num_kv_heads + 2)  # Hq = group * Hkv on every rank
        q, k, v = qkv.view(b * seq, heads, self.head_dim).split([heads - 2 * kv, kv, kv], dim=1)
        cos, sin = (r.reshape(b * seq, -1) for r in rope)
        q, k = self.norm_qk(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = packed_attention(q, k, v, cu_seqlens, causal=True)  # [B*L, H, hd]
        return self.o_proj(out.view(b, seq, -1))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k heads ``[B*L, H, hd]`` before the rotary: as they are (a subclass may normalise them)."""
        return q, k


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention  # a subclass's family may bring its own attention

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: Segments | torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x), rope, cu_seqlens)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Decoder plus ``lm_head``: the whole language side, as one runtime group holds it.

    ``loss_chunk_tokens``: ``loss_sum`` takes the cross entropy through ``lm_head`` this many tokens at a time
    when a micro-batch has more (``dhp.models.loss``: the float32 logits are never whole); 0, the default of a
    bare model, always makes the whole logits. The trainer sets it from ``train.loss_chunk_tokens``.
    ``attention_kernel``: ``packed_attention``'s kernel (``train.attention``: auto, sdpa, varlen).
    """

    loss_chunk_tokens: int = 0
    attention_kernel: str = "auto"
    rotary_class: type[nn.Module] = MRotary  # a subclass (another family's decoder) may bring its own rotary
    layer_class: type[nn.Module] = DecoderLayer  # and decoder layer

    def __init__(self, cfg: TextConfig, image_token_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.image_token_id = image_token_id
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = self.rotary_class(cfg)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor, media: Media = None,
              placeholders: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Token embeddings [B, L, D] with each encoder's embeddings placed at its placeholder tokens, in order.

        ``media``: ``{placeholder token id: embeddings [n, D]}`` (one entry per encoder), or a plain tensor of
        image embeddings (placed at ``image_token_id``). Every placeholder must get exactly one embedding.
        ``placeholders``: ``{token id: flat positions [n]}`` on the host (``PackedMeta.placeholders``): the counts
        are checked and the embeddings copied there with no read of the device; without it they are found on the
        ids (a host read of the device's ids per placeholder id).

        Under Megatron sequence parallelism a rank may hold the embeddings of its own slice of the sequence only:
        a value of ``media`` is then ``(embeddings [m, D] or None, their flat positions [m] on the host)``, those
        positions a subset of the id's ``placeholders``. They are placed there, and the id's other slots are
        zeroed: the first layer keeps this rank's slice only, so their values are never read, and zero keeps the
        embedding table's gradient at every placeholder slot zero, as when all are placed."""
        x = self.embed_tokens(input_ids)
        x = x.to(compute_dtype(x))  # the residual stream carries the compute dtype from here (bf16 under autocast)
        if media is None or isinstance(media, torch.Tensor):
            media = {self.image_token_id: media}
        if self.image_token_id not in media:
            media = {self.image_token_id: None, **media}
        for token_id, embeds in media.items():
            if isinstance(embeds, tuple):
                x = _place_slice(x, embeds, (placeholders or {}).get(token_id), token_id)
                continue
            n_embeds = 0 if embeds is None else embeds.shape[0]
            if placeholders is not None and token_id in placeholders:
                rows = placeholders[token_id]
                _check_slots(int(rows.numel()), n_embeds, token_id)
                if n_embeds:
                    flat = x.reshape(-1, x.shape[-1]).index_copy(0, rows.to(x.device), embeds.to(x.dtype))
                    x = flat.view(x.shape)
                continue
            mask = input_ids == token_id
            if has_values(mask):  # (a planner's fake run has shapes only: nothing to count)
                _check_slots(int(mask.sum()), n_embeds, token_id)
            if n_embeds:
                x = x.masked_scatter(mask.unsqueeze(-1), embeds.to(x.dtype))
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        media: Media = None,
        cu_seqlens: Segments | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, L], position_ids [3, B, L], media (see ``embed``) -> logits [B, L, V]."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, media, cu_seqlens))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        media: Media = None,
        cu_seqlens: Segments | torch.Tensor | None = None,
        meta: PackedMeta | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, L, D] (the attention's segments: ``segments``)."""
        segments = self.segments(input_ids, cu_seqlens, meta)  # once per micro-batch: every layer shares it
        x = self.embed(input_ids, media) if meta is None else self.embed(input_ids, media, meta.placeholders)
        rope = self.rotary(position_ids)
        for layer in self.layers:
            x = layer(x, rope, segments)
        return self.norm(x)

    def segments(self, input_ids: torch.Tensor, cu_seqlens: Segments | torch.Tensor | None,
                 meta: PackedMeta | None) -> Segments:
        """The attention's segments: ``meta``'s (host metadata), else ``cu_seqlens`` (a host tensor or
        ``Segments``), else each row of ``input_ids`` its own sequence."""
        b, seq = input_ids.shape
        if meta is not None:
            bounds = meta.cu_seqlens
        else:
            bounds = cu_seqlens if cu_seqlens is not None else range(0, (b + 1) * seq, seq)
        return Segments.of(bounds, self.attention_kernel)

    def loss_sum(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        media: Media = None,
        cu_seqlens: Segments | torch.Tensor | None = None,
        meta: PackedMeta | None = None,
    ) -> torch.Tensor:
        """Summed next-token cross entropy; ``targets [B, L]`` are already shifted (-100: not supervised).

        Under tensor parallelism (``parallelize_text``) the logits are a DTensor sharded on the vocabulary and
        the loss is the vocab-parallel cross entropy: the same float32 sum, a plain scalar on every rank.
        Otherwise, past ``loss_chunk_tokens`` tokens, the head and the loss run chunk by chunk (the same sum).
        With ``meta`` (``PackedMeta``, host metadata) only the supervised rows go through ``lm_head``: the same
        sum (the other rows add exact zeros), without the head's FLOPs and logits for image and prompt tokens."""
        if meta is not None:
            return self._labelled_loss_sum(input_ids, position_ids, targets, media, meta)
        chunk = self.loss_chunk_tokens
        if chunk > 0 and input_ids.numel() > chunk and not isinstance(self.lm_head.weight, DTensor):
            hidden = self.hidden_states(input_ids, position_ids, media, cu_seqlens)  # [B, L, D]
            return chunked_linear_cross_entropy_sum(hidden, self.lm_head.weight, targets, chunk)
        logits = self.forward(input_ids, position_ids, media, cu_seqlens)
        if isinstance(logits, DTensor):  # tensor parallel: logits sharded on the vocabulary, never gathered
            return vocab_parallel_cross_entropy_sum(logits, targets)
        return F.cross_entropy(
            logits.view(-1, logits.shape[-1]).float(), targets.view(-1), ignore_index=-100, reduction="sum"
        )

    def _labelled_loss_sum(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
                           media: Media, meta: PackedMeta) -> torch.Tensor:
        """``loss_sum`` over ``meta.label_rows`` only, in every layout (whole logits, chunked, vocab-parallel,
        Megatron SP)."""
        hidden = self.hidden_states(input_ids, position_ids, media, None, meta)  # [B, L(+pad), D]
        rows = meta.label_rows.to(hidden.device)  # the one copy of the index to the device
        picked = targets.reshape(-1).index_select(0, rows.to(targets.device))  # [n]
        h = labelled_rows(hidden, rows)  # [n, D]
        if isinstance(self.lm_head.weight, DTensor):  # vocab-parallel head: logits [1, n, V/tp] on each rank
            return vocab_parallel_cross_entropy_sum(self.lm_head(h[None]), picked[None])
        chunk = self.loss_chunk_tokens
        if 0 < chunk < h.shape[0]:
            return chunked_linear_cross_entropy_sum(h, self.lm_head.weight, picked, chunk)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float(), picked, ignore_index=-100, reduction="sum")


def labelled_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (flat positions on ``hidden``'s device) of hidden states ``[B, L, D]`` -> ``[n, D]``.

    Under Megatron sequence parallelism the final norm's output is a DTensor sharded on the (padded) sequence:
    it is gathered first (what the vocab-parallel head's input does anyway), its rows taken on every rank, and
    handed on as a ``Replicate`` DTensor, so the head neither gathers again nor misreads them as a shard; its
    backward sums the rows' gradient over the TP ranks and keeps each rank's own sequence shard."""
    if not isinstance(hidden, DTensor):
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    full = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    local = full.to_local()
    picked = local.reshape(-1, local.shape[-1]).index_select(0, rows)
    return DTensor.from_local(picked, full.device_mesh, full.placements, run_check=False)


def _place_slice(x: torch.Tensor, part: tuple[torch.Tensor | None, torch.Tensor], slots: torch.Tensor | None,
                 token_id: int) -> torch.Tensor:
    """``x`` [B, L, D] with placeholder id ``token_id``'s slots ``slots`` (host flat positions) zeroed and
    ``part`` = (embeddings [m, D] or None, their flat positions [m], host) copied in: a rank's own slice."""
    embeds, positions = part
    if slots is None:
        raise ValueError(f"embeddings of a sequence slice for placeholder id {token_id} need the batch's placeholder "
                         "positions (PackedMeta.placeholders)")
    _check_slots(int(positions.numel()), 0 if embeds is None else embeds.shape[0], token_id)
    if not slots.numel():
        return x
    flat = x.reshape(-1, x.shape[-1]).index_fill(0, slots.to(x.device), 0)
    if positions.numel():
        flat = flat.index_copy(0, positions.to(x.device), embeds.to(x.dtype))
    return flat.view(x.shape)


def _check_slots(n_slots: int, n_embeds: int, token_id: int) -> None:
    if n_slots != n_embeds:
        raise ValueError(f"{n_slots} placeholder tokens (id {token_id}) in the input but {n_embeds} embeddings for "
                         "them")
