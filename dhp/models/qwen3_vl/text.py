"""The Qwen3-VL language model (a Qwen3 decoder with interleaved M-RoPE and DeepStack), top to bottom.

input_ids [B, L]
  -> embed_tokens, vision embeddings placed at <|image_pad|> / <|video_pad|>     [B, L, D]
  -> layers x n: RMSNorm, GQA attention (no qkv bias, RMSNorm on each q and k head, M-RoPE), RMSNorm, SwiGLU
       after layer i < K: DeepStack feature i added at the vision positions
  -> norm, lm_head                                                               [B, L, V]

Interleaved M-RoPE: rotary frequency j takes its angle from the height position when ``j % 3 == 1`` (and
``j < 3 * mrope_section[1]``), from the width when ``j % 3 == 2`` (``j < 3 * mrope_section[2]``), else from
the temporal one; Qwen2.5-VL's M-RoPE gives each axis one contiguous chunk instead.

DeepStack arrives with the embeddings: each value of ``media`` is ``[n, (1 + K) * D]`` (the vision encoder's
``pack``: the main embeddings, then the K features), so the module takes both from the ``media`` dict the engine
already passes. Everything else (packing, placeholder slots from ``PackedMeta``, the chunked and labelled-rows
loss) is Qwen2.5-VL's ``TextModel``, which this subclasses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dhp.models.layers import RMSNorm, SwiGLU, apply_rotary
from dhp.models.qwen2_5_vl.text import Media, MRotary
from dhp.models.qwen2_5_vl.text import TextModel as Qwen25TextModel
from dhp.models.qwen3_vl.config import TextConfig
from dhp.models.qwen3_vl.vision import split_deepstack
from dhp.ops.attention import Segments, has_values, host_metadata, packed_attention

if TYPE_CHECKING:
    from dhp.data.batch import PackedMeta


class InterleavedMRotary(MRotary):
    """M-RoPE with the t, h and w frequencies interleaved (``t h w t h w ... t t``)."""

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [3, B, L] -> cos, sin [B, L, head_dim]."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [3, B, L, hd/2]
        mixed = freqs[0].clone()
        for axis in (1, 2):
            idx = slice(axis, 3 * self.section[axis], 3)
            mixed[..., idx] = freqs[axis, ..., idx]
        emb = torch.cat([mixed, mixed], dim=-1)
        return emb.cos(), emb.sin()


def text_qkv_sizes(cfg: TextConfig) -> tuple[int, int, int]:
    """Rows of q, k and v in a decoder layer's fused ``qkv_proj`` (GQA; ``head_dim`` explicit)."""
    hd = cfg.head_dim
    return cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd


class Attention(nn.Module):
    """GQA attention without bias, one fused ``qkv_proj`` (rows ``[q; k; v]``), RMSNorm over each q and k head
    (``q_norm``/``k_norm``, weights of ``head_dim``) before the rotary."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(text_qkv_sizes(cfg)), bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cu_seqlens: Segments | torch.Tensor) -> torch.Tensor:
        b, seq, _ = x.shape
        qkv = self.qkv_proj(x)
        heads = qkv.shape[-1] // self.head_dim
        kv = heads // (self.num_heads // self.num_kv_heads + 2)
        q, k, v = qkv.view(b * seq, heads, self.head_dim).split([heads - 2 * kv, kv, kv], dim=1)
        cos, sin = (r.reshape(b * seq, -1) for r in rope)
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        out = packed_attention(q, k, v, cu_seqlens, causal=True)  # [B*L, H, hd]
        return self.o_proj(out.view(b, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: Segments | torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x), rope, cu_seqlens)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(Qwen25TextModel):
    """Decoder plus ``lm_head``, DeepStack features added after the first ``deepstack_levels`` layers."""

    def __init__(self, cfg: TextConfig, image_token_id: int, deepstack_levels: int = 0) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.image_token_id = image_token_id
        self.deepstack_levels = deepstack_levels
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = InterleavedMRotary(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def split_media(self, media: Media) -> tuple[Media, list[dict[int, torch.Tensor]]]:
        """Packed ``media`` -> (the main embeddings, as ``embed`` takes them; per DeepStack level
        ``{placeholder id: feature [n, D]}``)."""
        if media is None:
            return None, []
        if isinstance(media, torch.Tensor):
            media = {self.image_token_id: media}
        main: dict = {}
        levels: list[dict[int, torch.Tensor]] = [{} for _ in range(self.deepstack_levels)]
        for token_id, embeds in media.items():
            if isinstance(embeds, tuple):
                raise ValueError(f"placeholder id {token_id}: a sequence slice's embeddings (Megatron sequence "
                                 "parallelism) do not carry DeepStack features; run the Qwen3-VL text module "
                                 "without text.parallel.tp")
            if embeds is None:
                main[token_id] = None
                continue
            if embeds.shape[-1] != (1 + self.deepstack_levels) * self.cfg.hidden_size:
                raise ValueError(f"placeholder id {token_id}: embeddings of width {embeds.shape[-1]}, expected "
                                 f"(1 + {self.deepstack_levels} DeepStack levels) x {self.cfg.hidden_size}")
            main[token_id], features = split_deepstack(embeds, self.cfg.hidden_size)
            for level, feature in zip(levels, features, strict=True):
                level[token_id] = feature
        return main, levels

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        media: Media = None,
        cu_seqlens: Segments | torch.Tensor | None = None,
        meta: PackedMeta | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, L, D]; ``media`` values packed as the vision encoder emits them."""
        b, seq = input_ids.shape
        if meta is not None:
            bounds = meta.cu_seqlens
        else:
            bounds = cu_seqlens if cu_seqlens is not None else range(0, (b + 1) * seq, seq)
        segments = Segments.of(bounds, self.attention_kernel)
        main, levels = self.split_media(media)
        placeholders = None if meta is None else meta.placeholders
        x = self.embed(input_ids, main) if meta is None else self.embed(input_ids, main, placeholders)
        rows = {tid: self._rows(input_ids, tid, placeholders) for tid in (levels[0] if levels else {})}
        rope = self.rotary(position_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, segments)
            if i < len(levels):
                x = add_at_rows(x, levels[i], rows)
        return self.norm(x)

    @staticmethod
    def _rows(input_ids: torch.Tensor, token_id: int, placeholders: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """Flat positions of ``token_id`` in the batch: from ``PackedMeta.placeholders`` (host), else the ids."""
        if placeholders is not None and token_id in placeholders:
            return placeholders[token_id]
        if not has_values(input_ids):
            return torch.zeros(0, dtype=torch.long)
        with host_metadata():  # real ids stay real under the planner's FakeTensorMode
            return (input_ids.reshape(-1) == token_id).nonzero().squeeze(-1)


def add_at_rows(x: torch.Tensor, features: dict[int, torch.Tensor], rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """``x`` [B, L, D] with each ``features[id]`` [n, D] added at the flat positions ``rows[id]`` (DeepStack)."""
    flat = x.reshape(-1, x.shape[-1])
    for token_id, feature in features.items():
        index = rows[token_id]
        if index.numel() != feature.shape[0]:
            raise ValueError(f"{index.numel()} placeholder tokens (id {token_id}) but {feature.shape[0]} DeepStack "
                             "features for them")
        if index.numel():
            flat = flat.index_add(0, index.to(x.device), feature.to(x.dtype))
    return flat.view(x.shape)
