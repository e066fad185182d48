"""The Qwen3-VL language model (a Qwen3 decoder with interleaved M-RoPE and DeepStack), top to bottom.

input_ids [B, L]
  -> embed_tokens, vision embeddings placed at <|image_pad|> / <|video_pad|>     [B, L, D]
  -> layers x n: RMSNorm, GQA attention (no qkv bias, RMSNorm on each q and k head, M-RoPE), RMSNorm, SwiGLU
       after layer i < K: DeepStack feature i added at the vision positions
  -> norm, lm_head                                                               [B, L, V]

Interleaved M-RoPE: rotary frequency j takes its angle from the height position when ``j % 3 == 1`` (and
``j < 3 * mrope_section[1]``), from the width when ``j % 3 == 2`` (``j < 3 * mrope_section[2]``), else from
the temporal one; Qwen2.5-VL's M-RoPE gives each axis one contiguous chunk instead.

DeepStack arrives with the embeddings, by name: each value of ``media`` is the vision encoder's named outputs
``{"embeds": [n, D], "deepstack_0": [n, D], ...}``, which the family declares as this module's ``inputs``
(``text_inputs``: the main embeddings at the placeholders, feature i after layer i), so the router moves each part
as its own tensor and returns the gradient of each. Everything else (packing, placeholder slots from
``PackedMeta``, the chunked and labelled-rows loss) is Qwen2.5-VL's ``TextModel``, which this subclasses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dhp.models.layers import RMSNorm
from dhp.models.qwen2_5_vl.text import Attention as Qwen25Attention
from dhp.models.qwen2_5_vl.text import DecoderLayer as Qwen25DecoderLayer
from dhp.models.qwen2_5_vl.text import Media, MRotary
from dhp.models.qwen2_5_vl.text import TextModel as Qwen25TextModel
from dhp.models.qwen3_vl.config import TextConfig
from dhp.models.qwen3_vl.vision import deepstack_names
from dhp.models.spec import EMBEDS, Input
from dhp.ops.attention import Segments, has_values, host_metadata

if TYPE_CHECKING:
    from dhp.data.batch import PackedMeta


def text_inputs(levels: int) -> tuple[Input, ...]:
    """What the language model consumes: the main embeddings at the placeholder tokens, then DeepStack feature
    i added at the same positions after decoder layer i (``TextModel.hidden_states``)."""
    return (Input(EMBEDS), *(Input(name, after_layer=i) for i, name in enumerate(deepstack_names(levels))))


def input_names(levels: int) -> tuple[str, ...]:
    return tuple(i.name for i in text_inputs(levels))


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


class Attention(Qwen25Attention):
    """Qwen2.5-VL's GQA attention without the qkv bias, with RMSNorm over each q and k head (``q_norm`` /
    ``k_norm``, weights of ``head_dim``) before the rotary."""

    qkv_bias = False

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class DecoderLayer(Qwen25DecoderLayer):
    attention_class = Attention


class TextModel(Qwen25TextModel):
    """Decoder plus ``lm_head``, DeepStack features added after the first ``deepstack_levels`` layers.

    ``sequence_mesh``: the TP mesh under Megatron sequence parallelism (``parallelize.parallelize_text`` sets
    it): between layers ``x`` is then this rank's sequence shard, where the DeepStack rows are added."""

    sequence_mesh: Any = None
    rotary_class = InterleavedMRotary
    layer_class = DecoderLayer

    def __init__(self, cfg: TextConfig, image_token_id: int, deepstack_levels: int = 0) -> None:
        super().__init__(cfg, image_token_id)  # type: ignore[arg-type]  (Qwen3's TextConfig: the same fields)
        self.deepstack_levels = deepstack_levels

    def route_media(self, media: Media) -> tuple[Media, list[dict[int, Any]]]:
        """``media`` as the engine hands it over (``{placeholder id: {output name: [n, D]}}``, the vision
        encoder's named outputs) -> (the main embeddings, as ``embed`` takes them; per DeepStack level
        ``{placeholder id: feature [n, D]}``), each part looked up by its name (``input_names``).

        A sequence slice's value (Megatron SP: ``({name: [m, D]} or None, flat positions [m])``) is routed the
        same way, each part keeping the positions: ``(main [m, D], positions)`` for ``embed``,
        ``(feature [m, D], positions)`` per level for ``add_deepstack``. A plain tensor is the main embeddings
        alone, which only a model without DeepStack levels takes."""
        if media is None:
            return None, []
        if isinstance(media, torch.Tensor):
            media = {self.image_token_id: media}
        names = input_names(self.deepstack_levels)
        main: dict = {}
        levels: list[dict[int, Any]] = [{} for _ in range(self.deepstack_levels)]
        for token_id, value in media.items():
            named, positions = value if isinstance(value, tuple) else (value, None)
            if named is None:
                main[token_id] = None if positions is None else (None, positions)
                continue
            if isinstance(named, torch.Tensor):
                named = {names[0]: named}
            missing = [n for n in names if n not in named]
            if missing:
                raise ValueError(f"placeholder id {token_id}: the vision outputs {sorted(named)} lack {missing} "
                                 f"(this language model takes {list(names)})")
            main[token_id] = named[names[0]] if positions is None else (named[names[0]], positions)
            for level, name in zip(levels, names[1:], strict=True):
                level[token_id] = named[name] if positions is None else (named[name], positions)
        return main, levels

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        media: Media = None,
        cu_seqlens: Segments | torch.Tensor | None = None,
        meta: PackedMeta | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, L, D]; ``media`` values the vision encoder's named outputs."""
        segments = self.segments(input_ids, cu_seqlens, meta)
        main, levels = self.route_media(media)
        placeholders = None if meta is None else meta.placeholders
        x = self.embed(input_ids, main) if meta is None else self.embed(input_ids, main, placeholders)
        rows = {tid: self._rows(input_ids, tid, placeholders)
                for tid, feature in (levels[0].items() if levels else ()) if not isinstance(feature, tuple)}
        rope = self.rotary(position_ids)
        after = {inp.after_layer: k for k, inp in enumerate(text_inputs(len(levels))[1:])}  # layer -> level
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, segments)
            if i in after:
                x = self.add_deepstack(x, levels[after[i]], rows)
        return self.norm(x)

    def add_deepstack(self, x: torch.Tensor, features: dict[int, Any], rows: dict[int, torch.Tensor]) -> torch.Tensor:
        """``x`` after a decoder layer with one DeepStack level added at its placeholder positions: on the whole
        sequence, or under Megatron SP (``sequence_mesh`` set by ``parallelize_text``) on this rank's shard of
        it, each rank adding only the rows in its slice (``add_to_sequence_shard``)."""
        if self.sequence_mesh is None:
            return add_at_rows(x, features, rows)
        return add_to_sequence_shard(x, features, rows, self.sequence_mesh)

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


def add_to_sequence_shard(x: torch.Tensor, features: dict[int, Any], rows: dict[int, torch.Tensor],
                          mesh: DeviceMesh) -> torch.Tensor:
    """``x`` [1, S, D], this rank's shard ``[start, start + S)`` of the padded sequence (``start = rank * S``),
    with the DeepStack rows of the shard added: a value of ``features`` is ``(feature [m, D] or None, flat
    positions [m], host)`` of this rank's slice, or a whole feature ``[n, D]`` at ``rows[id]``."""
    seq = x.shape[1]
    start = mesh.get_local_rank() * seq
    whole = {t: f for t, f in features.items() if not isinstance(f, tuple)}
    if whole:  # every rank holds every row: place them at full length, keep the shard (backward all-gathers)
        full = add_at_rows(x.new_zeros(1, seq * mesh.size(), x.shape[-1]), whole, rows)
        x = x + DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(
            placements=[Shard(1)]).to_local()
    flat = x.reshape(-1, x.shape[-1])
    for token_id, value in features.items():
        if not isinstance(value, tuple) or value[0] is None:
            continue
        feature, positions = value
        local = positions - start
        if local.numel() != feature.shape[0] or (local.numel() and (local.min() < 0 or local.max() >= seq)):
            raise ValueError(f"DeepStack rows of placeholder id {token_id}: {feature.shape[0]} features at "
                             f"{local.numel()} positions, which must fall in this rank's slice [{start}, "
                             f"{start + seq})")
        flat = flat.index_add(0, local.to(x.device), feature.to(x.dtype))
    return flat.view(x.shape)
