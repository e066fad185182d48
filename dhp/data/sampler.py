"""The batch plan: which samples each replica of each module group processes, per step.

Deterministic from (seed, epoch, step) alone, so a resumed run sees exactly the
batches it would have seen. (Under ``data.validate=lazy`` a step's bad samples are
replaced before it is balanced, by substitutes drawn from the seed, the step and
the data's content: ``dhp.data.lazy``; ``plan(step, ids)`` balances those ids.)
The plan is keyed by module (``"text"``, ``"vision"``, ``"audio"``, ...), and
every module balances its own cost:

* The language model (``language``, ``"text"`` by default) cuts the global batch
  into ``n_micro`` rounds; in each round each of its replicas takes exactly
  ``micro_batch_size`` samples. The cut is longest-first greedy on
  ``costs[language]``, first over replicas (``global_batch_size / dp`` each),
  then over rounds within a replica.
* Every other module is an encoder. In each round it takes the round's samples
  that carry its modality (cost > 0) and spreads them over its own replicas
  with the same greedy on its own costs, with no per-replica count: a replica
  may get several samples, one, or none. Samples without the modality are not
  given to that encoder at all.
* With an encoder window of W rounds (``encoder_window``), an encoder spreads the
  samples of W consecutive rounds over its replicas at once: with text TP 4 x DP 1
  and micro-batch 1 each round holds one sample, and a window of 4 gives each of
  four vision replicas one (each still encodes it in its own round). The runtime
  encodes a window's rounds together (``schedule_turns``), so all replicas work at
  once where a window of 1 would use one of them at a time.

The step's order of work is data too: ``schedule_turns`` lists the turns (encode
round j, text round k) that the Ray backend submits, in order.

See docs/balancing.md for the cost models and the imbalance metric.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from dhp.config import ConfigError

Parts = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Round:
    """One micro-batch round: per module, the sample ids of each of its replicas.

    ``parts[module][r]`` are the ids replica ``r`` of ``module`` processes in this round,
    sorted. Every module has one entry per replica (an encoder replica may have none).
    """

    parts: dict[str, Parts]
    language: str = "text"  # the language-model module

    def replicas(self, module: str) -> Parts:
        """The per-replica ids of ``module``."""
        try:
            return self.parts[module]
        except KeyError:
            raise KeyError(
                f"the round has no module {module!r}; known modules: {sorted(self.parts)}"
            ) from None

    @property
    def modules(self) -> list[str]:
        return list(self.parts)

    @property
    def sample_ids(self) -> list[int]:
        """All ids of the round, in the language model's replica order."""
        return [i for part in self.replicas(self.language) for i in part]


@dataclass(frozen=True)
class StepPlan:
    step: int
    epoch: int
    rounds: tuple[Round, ...]
    window: int = 1  # rounds whose samples each encoder spread over its replicas at once (``encoder_window``)

    @property
    def sample_ids(self) -> list[int]:
        return [i for r in self.rounds for i in r.sample_ids]

    def imbalance(self, costs: Mapping[str, Sequence[float]]) -> dict[str, float]:
        """Per module of ``costs``: how much longer its busiest replica works than the average one.

        For module ``m`` with replicas ``r`` and windows ``w`` of ``self.window`` rounds (one round each
        without a window), with ``load[w][r] = sum(costs[m][i] for i in window w's rounds of replica r)``::

            imbalance[m] = sum_w max_r load[w][r] / sum_w mean_r load[w][r]

        Replicas wait for each other at every window, so the numerator is the module's
        busy time for the step and the denominator the time with a perfect split:
        1.0 is perfect, 2.0 means the step takes twice as long as it would balanced.
        A module with no cost at all in the step (no sample carries it) reads 1.0.
        """
        return plan_imbalance(self, costs)


def plan_imbalance(plan: StepPlan, costs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``plan.imbalance(costs)``: see :meth:`StepPlan.imbalance` for the definition."""
    out: dict[str, float] = {}
    w = max(1, plan.window)
    windows = [plan.rounds[j:j + w] for j in range(0, len(plan.rounds), w)]
    for module, cost in costs.items():
        busiest = ideal = 0.0
        for rounds in windows:
            per_round = [[sum(float(cost[i]) for i in part) for part in rnd.replicas(module)] for rnd in rounds]
            loads = [sum(col) for col in zip(*per_round, strict=True)]
            if loads:
                busiest += max(loads)
                ideal += sum(loads) / len(loads)
        out[module] = busiest / ideal if ideal > 0 else 1.0
    return out


def _balanced_split(
    ids: Sequence[int], costs: Sequence[float], parts: int, per_part: int | None
) -> list[list[int]]:
    """Longest-first greedy assignment to the least-loaded part, each part's ids sorted.

    Ids are taken by decreasing cost (ties: lower id first) and each goes to the open part
    with the least load (ties: lowest part index), so the result depends on the inputs alone.
    With ``per_part`` every part gets exactly that many ids (``len(ids) == parts * per_part``);
    without, a part may end up empty.
    """
    order = sorted(ids, key=lambda i: (-costs[i], i))
    out: list[list[int]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for i in order:
        open_parts = [p for p in range(parts) if per_part is None or len(out[p]) < per_part]
        p = min(open_parts, key=lambda q: (load[q], q))
        out[p].append(i)
        load[p] += costs[i]
    return [sorted(part) for part in out]


class BatchPlanner:
    """Plans every step: the global batch, its rounds, and each module's replica split.

    ``costs[module][i]`` is what sample ``i`` costs that module (any unit: only ratios
    within a module matter). ``costs[language]`` must be positive for every sample; for
    an encoder, 0 means the sample does not carry that modality. ``dp[module]`` is the
    number of replicas of each module of ``costs``.
    """

    def __init__(
        self,
        costs: Mapping[str, Sequence[float]],
        dp: Mapping[str, int],
        global_batch_size: int,
        micro_batch_size: int,
        seed: int = 0,
        language: str = "text",
        encoder_window: int = 1,
    ) -> None:
        if language not in costs:
            raise ConfigError(
                f"the batch planner needs the costs of the language model {language!r}; "
                f"got costs for {sorted(costs)}"
            )
        for module in costs:
            if module not in dp:
                raise ConfigError(
                    f"{module}.parallel.dp is not set: the batch planner needs the replica count of every module"
                )
            if int(dp[module]) < 1:
                raise ConfigError(f"{module}.parallel.dp must be at least 1, got {dp[module]}")
        n = len(costs[language])
        for module, cost in costs.items():
            if len(cost) != n:
                raise ConfigError(
                    f"the costs of {module!r} cover {len(cost)} samples but those of {language!r} cover {n}"
                )
        arrays = {m: np.asarray(cost, dtype=np.float64) for m, cost in costs.items()}  # (checked at C speed)
        bad = np.flatnonzero(~(arrays[language] > 0))[:5].tolist()
        if bad:
            raise ConfigError(
                f"every sample must cost the language model {language!r} something; samples {bad} cost "
                f"{[costs[language][i] for i in bad]}"
            )
        for module, cost in arrays.items():
            neg = np.flatnonzero(cost < 0)[:5].tolist()
            if neg:
                raise ConfigError(f"the costs of {module!r} must not be negative; samples {neg} are")
        text_dp = int(dp[language])
        per_round = micro_batch_size * text_dp
        if global_batch_size % per_round:
            raise ConfigError(
                f"train.global_batch_size ({global_batch_size}) must be a multiple of train.micro_batch_size "
                f"x {language}.parallel.dp ({micro_batch_size} x {text_dp} = {per_round})"
            )
        if n < global_batch_size:
            raise ConfigError(
                f"the dataset has {n} usable samples, fewer than train.global_batch_size "
                f"({global_batch_size}); lower the batch size or add data"
            )
        if encoder_window < 1:
            raise ConfigError(f"the encoder window must be at least one round, got {encoder_window}")
        self.language = language
        self.costs = {m: cost.tolist() for m, cost in arrays.items()}  # (Python floats: read one at a time)
        self.dp = {m: int(dp[m]) for m in costs}
        self.encoders = [m for m in costs if m != language]
        self.n_samples = n
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.n_micro = global_batch_size // per_round
        self.window = min(encoder_window, self.n_micro)
        self.steps_per_epoch = n // global_batch_size
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> its order, for the last epochs asked for

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:  # (kept: consecutive steps share their epoch's order)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # this epoch and the one before
            self._orders[epoch] = torch.randperm(self.n_samples, generator=g)
        return self._orders[epoch]

    def step_ids(self, step: int) -> tuple[int, list[int]]:
        """(epoch, the sample ids of ``step`` in the epoch's order): what ``plan(step)`` balances."""
        epoch, j = divmod(step, self.steps_per_epoch)
        return epoch, self._epoch_order(epoch)[j * self.global_batch_size:(j + 1) * self.global_batch_size].tolist()

    def plan(self, step: int, ids: Sequence[int] | None = None) -> StepPlan:
        """Step ``step``'s plan. ``ids``: the step's samples in place of ``step_ids(step)``'s, as many and none
        twice (a lazily validated run's, with its bad samples replaced: ``dhp.data.lazy``)."""
        epoch, own = self.step_ids(step)
        if ids is None:
            ids = own
        elif len(ids) != len(own) or len(set(ids)) != len(ids):
            raise ValueError(f"plan(step {step}): {len(ids)} ids given ({len(set(ids))} distinct) for a step of "
                             f"{len(own)} samples")
        ids = list(ids)
        lm, lm_cost, lm_dp = self.language, self.costs[self.language], self.dp[self.language]
        per_replica = _balanced_split(ids, lm_cost, lm_dp, self.global_batch_size // lm_dp)
        micro = [
            _balanced_split(part, lm_cost, self.n_micro, self.micro_batch_size) for part in per_replica
        ]  # [replica][round]
        texts = [tuple(tuple(micro[r][k]) for r in range(lm_dp)) for k in range(self.n_micro)]
        rounds = []
        for w in range(0, self.n_micro, self.window):  # each encoder splits a window's samples at once
            window = texts[w:w + self.window]
            replica_of = {m: self._encoder_split(m, [i for text in window for part in text for i in part])
                          for m in self.encoders}
            for text in window:
                parts: dict[str, Parts] = {lm: text}
                round_ids = sorted(i for part in text for i in part)
                for module in self.encoders:
                    mine = [[i for i in round_ids if replica_of[module].get(i) == q] for q in range(self.dp[module])]
                    parts[module] = tuple(tuple(p) for p in mine)
                rounds.append(Round(parts=parts, language=lm))
        return StepPlan(step=step, epoch=epoch, rounds=tuple(rounds), window=self.window)

    def _encoder_split(self, module: str, ids: list[int]) -> dict[int, int]:
        """Sample id -> the replica of ``module`` that encodes it, for the samples of ``ids`` that carry its
        modality (balanced on its own costs)."""
        cost = self.costs[module]
        carried = [i for i in ids if cost[i] > 0]
        split = _balanced_split(carried, cost, self.dp[module], None)
        return {i: q for q, part in enumerate(split) for i in part}


def encoder_window(setting: int, placement: str, encoder_dp: Sequence[int], samples_per_round: int,
                   n_rounds: int) -> int:
    """How many rounds' samples the encoders spread over their replicas at once (``runtime.encoder_window``).

    A number >= 1 is used as given. 0 (auto): under collocated placement, enough rounds that every replica of
    the widest encoder can get a sample (``ceil(dp / samples per round)``, at most the step's rounds), so no
    encoder replica waits while another encodes the only sample of a round; under disaggregated placement 1
    (the encoder groups already run ``runtime.encoders_ahead`` rounds ahead on their own devices)."""
    if setting >= 1:
        return min(setting, n_rounds)
    if placement != "collocated" or not encoder_dp:
        return 1
    return max(1, min(n_rounds, math.ceil(max(encoder_dp) / samples_per_round)))


class Turn(NamedTuple):
    """One call of the step's schedule: ``encode`` round j on every encoder group, or ``text`` round k."""

    kind: Literal["encode", "text"]
    round: int


def schedule_turns(n_rounds: int, window: int = 1, ahead: int = 0) -> tuple[Turn, ...]:
    """The step's schedule as data: the turns the Ray backend submits, in order (an actor runs its calls in
    submission order, so this order is what runs).

    Before text round k every round j of k's encoder window is encoded, and every j <= k + ``ahead``: with a
    window the encoder replicas encode the window's rounds at once (each its own samples), with ``ahead`` the
    encoders run that many rounds ahead of the text group (disaggregated placement)."""
    if window < 1 or ahead < 0:
        raise ValueError(f"schedule_turns: window must be >= 1 and ahead >= 0, got {window} and {ahead}")
    turns: list[Turn] = []
    encoded = 0
    for k in range(n_rounds):
        window_end = min(n_rounds, (k // window + 1) * window)
        upto = min(n_rounds, max(k + ahead + 1, window_end))
        turns.extend(Turn("encode", j) for j in range(encoded, upto))
        encoded = max(encoded, upto)
        turns.append(Turn("text", k))
    return tuple(turns)
