"""One processed sample, and the packing of several samples into one row.

Why packing: vision-language samples vary wildly in length; padding wastes
compute. Packing puts the samples one after the other in a single row; the
attention never crosses a boundary (``cu_seqlens``), positions restart per
sample, and targets are shifted per sample, so a packed batch computes exactly
the sum of its samples' losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dhp.data.audio import audio_tokens
from dhp.data.processor import MERGE_SIZE, PATCH_DIM

IGNORE_INDEX = -100


@dataclass
class Sample:
    index: int  # the sample id in its dataset
    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long, -100 where not supervised (not shifted)
    position_ids: torch.Tensor  # [3, L] long (M-RoPE)
    pixel_values: torch.Tensor  # [N, 1176] float; N = 0 for text-only, or when loaded with pixels=False
    image_grid_thw: torch.Tensor  # [I, 3] long, I may be 0
    pixel_values_videos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, PATCH_DIM))  # [Nv, 1176]
    video_grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))  # [V, 3]
    second_per_grid_ts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [V] float32 seconds
    # audio clips: log-mel frames [128, F_total] (clips concatenated in time; [128, 0] when loaded without media)
    audio_features: torch.Tensor = field(default_factory=lambda: torch.zeros(128, 0))
    audio_feature_lens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [A] frames

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_patches(self) -> int:
        """Patches of all images (from the grids, so it holds for a sample loaded without pixels too)."""
        return int(self.image_grid_thw.prod(-1).sum()) if self.image_grid_thw.shape[0] else 0

    @property
    def num_image_tokens(self) -> int:
        """Merged vision tokens (``<|image_pad|>`` slots) = patches / 4."""
        return self.num_patches // (MERGE_SIZE * MERGE_SIZE)

    @property
    def num_video_patches(self) -> int:
        """Patches of all video clips (from the grids)."""
        return int(self.video_grid_thw.prod(-1).sum()) if self.video_grid_thw.shape[0] else 0

    @property
    def num_video_tokens(self) -> int:
        """Merged video tokens (``<|video_pad|>`` slots)."""
        return self.num_video_patches // (MERGE_SIZE * MERGE_SIZE)

    @property
    def audio_token_counts(self) -> list[int]:
        """Audio placeholder tokens per clip (``<|AUDIO|>`` slots): two stride-2 stages over the mel frames."""
        return [audio_tokens(int(n)) for n in self.audio_feature_lens]

    @property
    def num_audio_tokens(self) -> int:
        return sum(self.audio_token_counts)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets of one sample: ``targets[t] = labels[t + 1]``, the last one -100."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


@dataclass(frozen=True, eq=False)
class PackedMeta:
    """Host metadata of a packed batch, computed on the CPU from the plan's samples, never read back from a device.

    Why: a micro-batch that asks the device for its own segment boundaries, its placeholder count or its
    supervised rows waits for the device each time (a sync). These come with the batch instead; the model moves
    each index to the device once (``TextModel.loss_sum(..., meta=)``). Flat positions index the batch's
    ``[B * L]`` tokens."""

    cu_seqlens: tuple[int, ...]  # sample boundaries in the row (the attention's segments)
    label_rows: torch.Tensor  # [n_supervised] long: positions whose (shifted) target is supervised, ascending
    placeholders: dict[int, torch.Tensor]  # placeholder token id -> its positions [n] long, ascending

    @property
    def num_supervised(self) -> int:
        return int(self.label_rows.numel())


@dataclass
class Batch:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [3, 1, T]
    targets: torch.Tensor  # [1, T], already shifted per sample
    cu_seqlens: torch.Tensor  # [n + 1] int32, sample boundaries in the row
    pixel_values: torch.Tensor  # [N_total, 1176]
    image_grid_thw: torch.Tensor  # [I_total, 3]
    sample_ids: list[int] = field(default_factory=list)
    pixel_values_videos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, PATCH_DIM))
    video_grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))
    second_per_grid_ts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    @property
    def num_supervised(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def meta(self, placeholder_ids: tuple[int, ...] | list[int] = ()) -> PackedMeta:
        """This batch's host metadata (``PackedMeta``), read from its host tensors: call it before ``to(device)``."""
        if self.input_ids.device.type != "cpu" or self.targets.device.type != "cpu":
            raise ValueError("Batch.meta reads the batch's host tensors: call it before Batch.to(device)")
        flat_ids, flat_targets = self.input_ids.reshape(-1), self.targets.reshape(-1)
        return PackedMeta(
            cu_seqlens=tuple(self.cu_seqlens.tolist()),
            label_rows=(flat_targets != IGNORE_INDEX).nonzero().flatten(),
            placeholders={int(t): (flat_ids == t).nonzero().flatten() for t in placeholder_ids},
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: str | torch.device) -> Batch:
        return Batch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            targets=self.targets.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            pixel_values=self.pixel_values.to(device),
            image_grid_thw=self.image_grid_thw.to(device),
            sample_ids=list(self.sample_ids),
            pixel_values_videos=self.pixel_values_videos.to(device),
            video_grid_thw=self.video_grid_thw.to(device),
            second_per_grid_ts=self.second_per_grid_ts.to(device),
        )


def pack(samples: list[Sample]) -> Batch:
    """Samples -> one packed row; images concatenated in sample order (matching the ``<|image_pad|>`` order)."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.int32)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    pixels = [s.pixel_values.reshape(-1, PATCH_DIM) for s in samples]
    grids = [s.image_grid_thw.reshape(-1, 3).long() for s in samples]
    return Batch(
        input_ids=torch.cat([s.input_ids.long() for s in samples])[None],
        position_ids=torch.cat([s.position_ids.long() for s in samples], dim=1)[:, None],
        targets=torch.cat([shifted_targets(s.labels.long()) for s in samples])[None],
        cu_seqlens=cu,
        pixel_values=torch.cat(pixels).float(),
        image_grid_thw=torch.cat(grids),
        sample_ids=[s.index for s in samples],
        pixel_values_videos=torch.cat([s.pixel_values_videos.reshape(-1, PATCH_DIM) for s in samples]).float(),
        video_grid_thw=torch.cat([s.video_grid_thw.reshape(-1, 3).long() for s in samples]),
        second_per_grid_ts=torch.cat([s.second_per_grid_ts.reshape(-1).float() for s in samples]),
    )
