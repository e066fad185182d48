"""One processed sample, and the packing of several samples into one row.

Why packing: vision-language samples vary wildly in length; padding wastes
compute. Packing puts the samples one after the other in a single row; the
attention never crosses a boundary (``cu_seqlens``), positions restart per
sample, and targets are shifted per sample, so a packed batch computes exactly
the sum of its samples' losses.

Why a packed row may end in padding (``pack(samples, multiple)``): under
tensor parallelism every op of the language model runs through DTensor, whose
sharding decisions are cached by the operands' shapes. A new packed length
misses that cache on every op (about 15x the op's dispatch on a CPU host:
``docs/performance.md``), and real data brings a new length nearly every
micro-batch. Rounding the length up to a multiple (``padded_length``) makes
lengths repeat. The padding is one segment of its own with no supervised
target, so no real token attends to it and the loss and its gradients are
those of the samples alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


_CORE = ("index", "input_ids", "labels", "position_ids", "media")


@dataclass(init=False)
class Sample:
    """One sample: its token ids, labels and position ids, and its media fields (what the family's processor
    gives: ``Processor.collate``, e.g. ``pixel_values`` and ``image_grid_thw``), read as attributes
    (``sample.pixel_values``) or from ``media``. A sample loaded without media has its fields shaped from the
    headers, with empty data tensors."""

    index: int  # the sample id in its dataset
    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long, -100 where not supervised (not shifted)
    position_ids: torch.Tensor  # [axes, L] long (the family processor's rotary layout: 3 axes, or 1)
    media: dict[str, torch.Tensor]  # the processor's fields, by name

    def __init__(self, index: int, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                 media: dict[str, torch.Tensor] | None = None, **fields: torch.Tensor) -> None:
        """``media`` and the keyword ``fields`` together: the sample's media fields."""
        object.__setattr__(self, "media", {**(media or {}), **fields})
        self.index, self.input_ids, self.labels, self.position_ids = index, input_ids, labels, position_ids

    def __getattr__(self, name: str) -> torch.Tensor:
        media = self.__dict__.get("media")  # (not self.media: unpickling reads attributes before __init__ ran)
        if media is not None and name in media:
            return media[name]
        names = ", ".join(media or ()) or "none"
        raise AttributeError(f"this sample has no field {name!r} (its media fields: {names})")

    def __setattr__(self, name: str, value: object) -> None:
        if name not in _CORE and name in self.__dict__.get("media", {}):
            self.media[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def token_counts(self) -> dict[int, int]:
        """{token id: occurrences} in the sequence (as ``SampleInfo.token_counts`` gives for special tokens): an
        encoder counts its placeholders here (``Encoder.placeholder_counts``). Host work on host ids."""
        ids, counts = torch.unique(self.input_ids, return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist(), strict=True))


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
    # [n] long: positions whose (shifted) target is supervised, ascending; then, where ``Batch.meta`` was asked to
    # round n up, the row's last position (never a target) repeated: rows whose loss and gradient are exact zeros
    label_rows: torch.Tensor
    placeholders: dict[int, torch.Tensor]  # placeholder token id -> its positions [n] long, ascending
    repeats: int = 0  # the repeated last positions at the end of ``label_rows``

    @property
    def num_supervised(self) -> int:
        return int(self.label_rows.numel()) - self.repeats


@dataclass
class Batch:
    """The text side of a packed micro-batch (the encoders read their samples' media themselves)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [axes, 1, T]
    targets: torch.Tensor  # [1, T], already shifted per sample
    cu_seqlens: torch.Tensor  # [n + 1] int32, sample boundaries in the row (and the padding's, if any)
    sample_ids: list[int] = field(default_factory=list)

    @property
    def num_supervised(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def meta(self, placeholder_ids: tuple[int, ...] | list[int] = (), rows_multiple: int = 1) -> PackedMeta:
        """This batch's host metadata (``PackedMeta``), read from its host tensors: call it before ``to(device)``.
        ``rows_multiple``: the supervised rows' count rounded up to a multiple of it by repeating the row's last
        position (its target is never supervised): the loss's head then sees row counts that repeat (the reason
        ``pack`` pads, for the head's DTensor ops under TP)."""
        if self.input_ids.device.type != "cpu" or self.targets.device.type != "cpu":
            raise ValueError("Batch.meta reads the batch's host tensors: call it before Batch.to(device)")
        flat_ids, flat_targets = self.input_ids.reshape(-1), self.targets.reshape(-1)
        rows = (flat_targets != IGNORE_INDEX).nonzero().flatten()
        extra = padded_length(rows.numel(), rows_multiple) - rows.numel()
        if extra and flat_targets[-1] != IGNORE_INDEX:
            raise ValueError("Batch.meta: the row's last position has a target; a packed row's never does")
        return PackedMeta(
            cu_seqlens=tuple(self.cu_seqlens.tolist()),
            label_rows=torch.cat([rows, torch.full((extra,), flat_targets.numel() - 1, dtype=torch.long)]),
            placeholders={int(t): (flat_ids == t).nonzero().flatten() for t in placeholder_ids},
            repeats=extra,
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
            sample_ids=list(self.sample_ids),
        )


PAD_ID = 0  # the padding segment's token id: any id the vocabulary has; nothing reads its output


def padded_length(n_tokens: int, multiple: int = 1) -> int:
    """``n_tokens`` rounded up to a multiple of ``multiple``: the length ``pack`` gives a row of ``n_tokens``."""
    if multiple < 1:
        raise ValueError(f"padded_length: multiple must be >= 1, got {multiple}")
    return n_tokens + (-n_tokens % multiple)


def pack(samples: list[Sample], multiple: int = 1) -> Batch:
    """Samples -> one packed row: ids, positions and targets concatenated in sample order, then (``multiple``
    > 1) a padding segment up to ``padded_length``: ids ``PAD_ID``, positions from 0, no supervised target."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    lengths = [s.num_tokens for s in samples]
    ids = [s.input_ids.long() for s in samples]
    positions = [s.position_ids.long() for s in samples]
    targets = [shifted_targets(s.labels.long()) for s in samples]
    pad = padded_length(sum(lengths), multiple) - sum(lengths)
    if pad:  # a segment of its own: nothing attends across it, and it is never a target
        lengths.append(pad)
        ids.append(torch.full((pad,), PAD_ID, dtype=torch.long))
        positions.append(torch.arange(pad).expand(positions[0].shape[0], pad))
        targets.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return Batch(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(positions, dim=1)[:, None],
        targets=torch.cat(targets)[None],
        cu_seqlens=cu,
        sample_ids=[s.index for s in samples],
    )
