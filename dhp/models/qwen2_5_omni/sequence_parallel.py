"""Sequence parallelism for the audio encoder: each rank encodes whole attention chunks.

Qwen2.5-Omni's audio encoder cuts every clip into chunks of ``2 * n_window`` mel frames (2 s) and
attends only inside a chunk: the conv stem, the sinusoid positions and every layer's attention
restart at each chunk. So a long clip splits across ranks at chunk boundaries with no communication
in the forward at all (unlike the vision encoder's Ulysses all-to-all): each rank runs its chunks
through the stem and the layers, pools its rows in pairs, and projects them. Two rules keep the
result equal to the whole clip's:

* the stride-2 pooling pairs rows (2k, 2k+1) of a clip's rows after the stem, so a rank's part of a
  clip must start at an even row (with an even ``n_window`` every chunk does; with an odd one, chunks
  go in pairs);
* a rank's part that ends inside a clip ends at an even row too, so no pair is cut.

The ranks' gradients are partial sums over the same (replicated) weights, summed across the SP
group like data-parallel replicas (``ModuleEngine.reduce_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def after_stem(frames: int) -> int:
    """Rows after the conv stem (one stride-2 convolution) of ``frames`` mel frames."""
    return (frames - 1) // 2 + 1 if frames > 0 else 0


def chunk_frames(frames: int, n_window: int) -> list[int]:
    """A clip of ``frames`` mel frames cut into the encoder's attention chunks (``2 * n_window``, the last shorter)."""
    size = 2 * n_window
    return [size] * (frames // size) + ([frames % size] if frames % size else [])


@dataclass(frozen=True)
class Unit:
    """Consecutive chunks of one clip that start at an even row of the clip: what one rank takes whole."""

    clip: int
    frames: tuple[int, ...]  # mel frames of each chunk
    frame_start: int  # first mel frame of the unit within its clip
    row_start: int  # first row (after the stem) within its clip; even
    rows: int  # rows after the stem


@dataclass(frozen=True)
class AudioShard:
    """One rank's share of a batch's audio: ``units`` in order, and where their output tokens go."""

    units: tuple[Unit, ...]
    token_index: torch.Tensor  # [n_tokens] position of each output token among the batch's audio tokens

    @property
    def chunk_frames(self) -> list[int]:
        return [f for u in self.units for f in u.frames]

    def segments(self) -> list[int]:
        """Rows per pooling segment: consecutive units of the same clip form one segment."""
        out: list[int] = []
        last = None
        for u in self.units:
            if u.clip == last:
                out[-1] += u.rows
            else:
                out.append(u.rows)
            last = u.clip
        return out


def clip_units(feature_lens: list[int], n_window: int) -> list[Unit]:
    """Every clip cut into units: single chunks when a chunk has an even number of rows, else pairs."""
    per_unit = 1 if after_stem(2 * n_window) % 2 == 0 else 2
    units = []
    for clip, frames in enumerate(feature_lens):
        chunks = chunk_frames(frames, n_window)
        frame_start = row_start = 0
        for k in range(0, len(chunks), per_unit):
            group = tuple(chunks[k:k + per_unit])
            rows = sum(after_stem(f) for f in group)
            units.append(Unit(clip, group, frame_start, row_start, rows))
            frame_start += sum(group)
            row_start += rows
    return units


def _cost(u: Unit) -> int:
    """What a unit costs a rank: rows (linear layers) plus squared chunk rows (attention)."""
    return u.rows + sum(after_stem(f) ** 2 for f in u.frames) // 64


def split_units(units: list[Unit], parts: int) -> list[list[Unit]]:
    """``units`` cut into ``parts`` contiguous runs of about equal cost (some empty when there are fewer units)."""
    total = sum(_cost(u) for u in units)
    out: list[list[Unit]] = [[] for _ in range(parts)]
    acc, rank = 0, 0
    for k, u in enumerate(units):
        left = len(units) - k
        # move on once this rank has its share, keeping at least one unit for each remaining rank when possible
        while rank < parts - 1 and out[rank] and (acc >= total * (rank + 1) / parts or left <= parts - 1 - rank):
            rank += 1
        out[rank].append(u)
        acc += _cost(u)
    return out


def shard_audio(feature_lens: list[int], n_window: int, sp: int) -> list[AudioShard]:
    """Per SP rank, its units and the batch positions of the audio tokens it computes.

    A clip of ``R`` rows after the stem gives ``R // 2`` tokens (pairs), in clip order; a unit starting at
    row ``r`` gives the clip's tokens ``r/2 ..`` (its last odd row, at a clip's end, is dropped)."""
    units = clip_units(feature_lens, n_window)
    tokens_before, acc = [], 0
    for frames in feature_lens:
        tokens_before.append(acc)
        acc += after_stem(frames) // 2
    shards = []
    for part in split_units(units, sp):
        index = [torch.arange(u.rows // 2) + tokens_before[u.clip] + u.row_start // 2 for u in part]
        shards.append(AudioShard(tuple(part), torch.cat(index) if index else torch.zeros(0, dtype=torch.long)))
    return shards


def shard_features(features: torch.Tensor, feature_lens: list[int], shard: AudioShard) -> torch.Tensor:
    """The mel frames [M, F_shard] of ``shard``'s units, cut from the batch's frames [M, F_total]."""
    starts, acc = [], 0
    for frames in feature_lens:
        starts.append(acc)
        acc += frames
    cols = [features[:, starts[u.clip] + u.frame_start: starts[u.clip] + u.frame_start + sum(u.frames)]
            for u in shard.units]
    return torch.cat(cols, dim=1) if cols else features[:, :0]
