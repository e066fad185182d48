"""The batch plan: which samples each replica of each module group processes, per step.

Deterministic from (seed, epoch, step) alone, so a resumed run sees exactly the
batches it would have seen. A global batch is cut into ``n_micro`` rounds; in
each round every text replica takes one micro-batch, and the round's samples
are spread over the vision replicas. Both cuts balance token counts greedily
(longest first to the least loaded), which keeps replicas busy equally long.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhp.config import ConfigError


@dataclass(frozen=True)
class Round:
    """One micro-batch round: sample ids per text replica and per vision replica."""

    text: tuple[tuple[int, ...], ...]
    vision: tuple[tuple[int, ...], ...]

    @property
    def sample_ids(self) -> list[int]:
        return [i for part in self.text for i in part]


@dataclass(frozen=True)
class StepPlan:
    step: int
    epoch: int
    rounds: tuple[Round, ...]

    @property
    def sample_ids(self) -> list[int]:
        return [i for r in self.rounds for i in r.sample_ids]


def _balanced_split(ids: list[int], lengths: list[int], parts: int, per_part: int | None) -> list[list[int]]:
    """Longest-first greedy assignment to the least-loaded part (ties: lowest part index).

    With ``per_part`` every part gets exactly that many samples.
    """
    order = sorted(ids, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in order:
        open_parts = [p for p in range(parts) if per_part is None or len(out[p]) < per_part]
        p = min(open_parts, key=lambda q: (load[q], q))
        out[p].append(i)
        load[p] += lengths[i]
    return [sorted(part) for part in out]


class BatchPlanner:
    def __init__(
        self,
        lengths: list[int],
        global_batch_size: int,
        micro_batch_size: int,
        text_dp: int = 1,
        vision_dp: int = 1,
        seed: int = 0,
    ) -> None:
        per_round = micro_batch_size * text_dp
        if global_batch_size % per_round:
            raise ConfigError(
                f"train.global_batch_size ({global_batch_size}) must be a multiple of train.micro_batch_size "
                f"x text.parallel.dp ({micro_batch_size} x {text_dp} = {per_round})"
            )
        if len(lengths) < global_batch_size:
            raise ConfigError(
                f"the dataset has {len(lengths)} usable samples, fewer than train.global_batch_size "
                f"({global_batch_size}); lower the batch size or add data"
            )
        self.lengths = list(lengths)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.text_dp = text_dp
        self.vision_dp = vision_dp
        self.seed = seed
        self.n_micro = global_batch_size // per_round
        self.steps_per_epoch = len(lengths) // global_batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.lengths), generator=g).tolist()

    def plan(self, step: int) -> StepPlan:
        epoch, j = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        ids = order[j * self.global_batch_size:(j + 1) * self.global_batch_size]
        per_replica = _balanced_split(ids, self.lengths, self.text_dp, self.global_batch_size // self.text_dp)
        micro = [
            _balanced_split(part, self.lengths, self.n_micro, self.micro_batch_size) for part in per_replica
        ]  # [replica][round]
        rounds = []
        for k in range(self.n_micro):
            text = tuple(tuple(micro[r][k]) for r in range(self.text_dp))
            round_ids = [i for part in text for i in part]
            vision = tuple(tuple(p) for p in _balanced_split(round_ids, self.lengths, self.vision_dp, None))
            rounds.append(Round(text=text, vision=vision))
        return StepPlan(step=step, epoch=epoch, rounds=tuple(rounds))
