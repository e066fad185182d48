"""Layouts side by side: which fit, how fast, from the fake runs of ``dhp.plan.measure``.

Strategies, on the same GPUs and the same global batch (``micro_batch_size`` samples per GPU per step):

* ``zero3``: FSDP2 (ZeRO-3) over all GPUs for both modules, collocated;
* ``uniform-tp``: one TP degree for both modules (the SPMD baseline), ZeRO-1 over dp, collocated;
* ``dhp-collocated``: vision Ulysses SP x DP and text TP x DP on the same GPUs, taking turns;
* ``dhp-disaggregated``: m GPUs for vision, n = N - m for text, the splits searched;

each with and without activation checkpointing (both modules). A group's figures come from one fake run of
one of its ranks (``measure_model``); a run is keyed by what changes it, so layouts share runs.

Step time (stated, not tuned): a micro-batch of a rank takes FLOPs / (peak x efficiency) plus its
collectives at the device's link bandwidth (ring all-reduce 2(n-1)/n of the payload, all-gather (n-1) x, reduce-
scatter (n-1)/n x, all-to-all the bytes it sends); FSDP2's all-gathers and reduce-scatters overlap the
compute (the larger of the two counts). Per step a group runs its replica's micro-batches, its gradient
reduction, and its optimizer step at memory bandwidth (weights, gradients and state read and written once).
Router bytes (image embeddings and their gradients) cross the link once per micro-batch. Collocated groups
take turns (the sum); disaggregated groups overlap (the larger, plus one micro-batch of the other to fill the
pipeline). A collocated GPU holds, while one group runs, the other group's weights, gradients, optimizer
state and (vision) the activations it keeps for its backward.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dhp.plan.devices import Device
from dhp.plan.measure import GiB, GroupJob, GroupResult, image_grid

STRATEGIES = ("dhp-collocated", "dhp-disaggregated", "uniform-tp", "zero3")


@dataclass
class Row:
    strategy: str
    vision_tokens: int
    ac: bool
    jobs: dict[str, GroupJob]
    placement: str = "collocated"
    fits: bool = False
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    groups: dict[str, dict[str, float]] = field(default_factory=dict)

    def overrides(self) -> list[str]:
        v, t = self.jobs["vision"], self.jobs["text"]
        return [
            f"vision.parallel.dp={v.dp}",
            f"vision.parallel.sp={v.inner if v.inner_kind == 'sp' else 1}",
            f"vision.parallel.tp={v.inner if v.inner_kind == 'tp' else 1}",
            f"vision.parallel.zero={v.zero}",
            f"text.parallel.dp={t.dp}",
            f"text.parallel.tp={t.inner if t.inner_kind == 'tp' else 1}",
            f"text.parallel.zero={t.zero}",
            f"text.parallel.sequence_parallel={str(t.sequence_parallel).lower()}",
            f"vision.activation_checkpointing={str(v.activation_checkpointing).lower()}",
            f"text.activation_checkpointing={str(t.activation_checkpointing).lower()}",
            f"runtime.placement={self.placement}",
        ] + ([f"train.precision={t.precision}"] if t.precision != "fp32_master" else [])

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "overrides": self.overrides(), "vision_tokens": self.vision_tokens,
                "fits": self.fits, "step_time_s": float(self.step_time_s), "tokens_per_s": float(self.tokens_per_s),
                "groups": self.groups}


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_rows(model_cfg: Any, gpus: int, vision_tokens: list[int], text_tokens: int, mbs: int,
                   strategies: tuple[str, ...] = STRATEGIES, device: str = "cuda",
                   precision: str = "fp32_master") -> list[Row]:
    heads, kv = model_cfg.vision.num_heads, model_cfg.text.num_key_value_heads
    # uniform TP: one degree for both modules, dividing the vision heads and MLP width (72B's 3420 is not a
    # multiple of 8: its encoder's column shards would be uneven) and the text key/value heads
    tps = [t for t in _divisors(gpus, 8)
           if heads % t == 0 and kv % t == 0 and model_cfg.vision.intermediate_size % t == 0]
    tp = max(tps)  # uniform TP
    text_tp = max(t for t in _divisors(gpus, 8) if kv % t == 0)  # dhp: the text side's own degree
    base = dict(text_tokens=text_tokens, micro_batch_size=mbs, device=device, precision=precision)
    rows = []
    for T in vision_tokens:
        for ac in (False, True):
            b = dict(base, vision_tokens=T, activation_checkpointing=ac)

            def text(n: int, t: int, b: dict = b) -> GroupJob:
                # TP with Megatron sequence parallelism, as a skilled user runs it: the residual stream, norms
                # and the blocks' saved inputs are split over the tp ranks (all-gather + reduce-scatter in place
                # of each all-reduce, the same bytes)
                dp = n // t
                return GroupJob("text", dp=dp, inner=t, inner_kind="tp" if t > 1 else "none",
                                zero=1 if dp > 1 else 0, sequence_parallel=t > 1, **b)

            def vision(m: int, s: int, kind: str = "sp", b: dict = b) -> GroupJob:
                dp = m // s
                return GroupJob("vision", dp=dp, inner=s, inner_kind=kind if s > 1 else "none",
                                zero=1 if dp * (s if kind == "sp" else 1) > 1 else 0, **b)

            if "zero3" in strategies and gpus > 1:
                rows.append(Row("zero3", T, ac, {"vision": GroupJob("vision", dp=gpus, zero=3, **b),
                                                 "text": GroupJob("text", dp=gpus, zero=3, **b)}))
            if "uniform-tp" in strategies:
                rows.append(Row("uniform-tp", T, ac, {"vision": vision(gpus, tp, "tp"), "text": text(gpus, tp)}))
            sps = [s for s in _divisors(gpus, 16) if heads % s == 0 and s in (1, 2, 4, 8, 16)]
            if "dhp-collocated" in strategies:
                for s in sps:
                    rows.append(Row("dhp-collocated", T, ac, {"vision": vision(gpus, s), "text": text(gpus, text_tp)}))
            if "dhp-disaggregated" in strategies and gpus > 1:
                for m in sorted({max(1, gpus // 8), max(1, gpus // 4), max(1, gpus // 2)}):
                    n = gpus - m
                    t = max([t for t in _divisors(n, 8) if kv % t == 0])
                    for s in [s for s in sps if m % s == 0]:
                        rows.append(Row("dhp-disaggregated", T, ac, {"vision": vision(m, s), "text": text(n, t)},
                                        placement="disaggregated"))
    return rows


def _run(args: tuple[GroupJob, Any]) -> GroupResult:
    from dhp.plan.measure import measure_model

    job, model_cfg = args
    return measure_model(job, model_cfg)


def _reduce_size(job: GroupJob) -> int:
    return job.dp * (job.inner if job.inner_kind == "sp" else 1)


def canonical(job: GroupJob) -> GroupJob:
    """The job whose fake run stands for ``job``. Under ZeRO 0/1 a rank's activations, FLOPs, collective
    payloads and gradients do not depend on the number of data-parallel replicas; only ZeRO-1's share of the
    optimizer state does (``8/d`` bytes per parameter, ``docs/memory.md``). So every dp >= 2 is run as dp 2
    (dp 1 under SP, whose reduce group is already dp x sp) and the state rescaled (``for_reduce_size``);
    ZeRO-3 (FSDP2) is run at its own size."""
    if job.zero == 3 or _reduce_size(job) <= 1:
        return job
    return replace(job, dp=1 if job.inner_kind == "sp" else 2)


def for_reduce_size(r: GroupResult, measured: int, d: int) -> GroupResult:
    """``r``, measured with ZeRO-1 over ``measured`` ranks, with its optimizer state over ``d`` instead (a
    balanced share: ZeroRedundancyOptimizer partitions whole parameters, so within one parameter of it)."""
    if measured == d:
        return r
    new = r.optimizer * measured // d
    delta = new - r.optimizer
    out = replace(r, optimizer=new, peak_fb=r.peak_fb + delta, peak_step=r.peak_step + delta,
                  breakdown=dict(r.breakdown))
    out.peak = max(out.peak_fb, out.peak_step)
    for k in ("Optstate", "Total"):
        if k in out.breakdown:
            out.breakdown[k] += delta
    return out


def measure_all(jobs: list[GroupJob], model_cfg: Any, workers: int | None = None) -> dict[GroupJob, GroupResult]:
    """Every distinct job's ``canonical`` stand-in once. ``workers`` <= 1: in this process, one after
    another (a run's figures do not depend on what ran before it: ``measure._untracked_sharding_propagation``);
    more: a pool of that many processes, each running many jobs (default: the CPU count, at most 4, for
    more than a handful of runs)."""
    want = list(dict.fromkeys(jobs))
    uniq = list(dict.fromkeys(canonical(j) for j in want))
    if workers is None:
        workers = max(1, min(4, os.cpu_count() or 1)) if len(uniq) > 6 else 1
    if workers <= 1:
        got = {j: _run((j, model_cfg)) for j in uniq}
    else:
        import multiprocessing as mp

        # the deepest (text) runs first, so that the pool's last jobs are short
        order = sorted(uniq, key=lambda j: (j.module != "text", -j.vision_tokens))
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            got = dict(zip(order, pool.map(_run, [(j, model_cfg) for j in order]), strict=True))
    return {j: for_reduce_size(got[canonical(j)], _reduce_size(canonical(j)), _reduce_size(j)) for j in want}


# ---- time -----------------------------------------------------------------------------------------------------


def _comm_seconds(comm: dict[str, int], n: int, link: float) -> float:
    """Ring algorithms over ``n`` ranks at ``link`` bytes/s per direction."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1.0, "reduce_scatter": (n - 1) / n,
              "broadcast": 1.0}
    return sum(b * factor.get(k, 1.0) for k, b in comm.items()) / link


def group_time(job: GroupJob, r: GroupResult, dev: Device, samples: int) -> tuple[float, float]:
    """(seconds of this group per step, seconds of one micro-batch)."""
    link = dev.link_gbs * 1e9
    compute = r.flops / (dev.peak_flops * dev.efficiency)
    per_replica = math.ceil(samples / job.dp / job.micro_batch_size)
    comm = dict(r.comm)
    inner_n = job.inner
    if job.zero == 3:
        fsdp = {k: comm.pop(k) for k in ("all_gather", "reduce_scatter") if k in comm}
        compute = max(compute, _comm_seconds(fsdp, job.dp, link))
    sent = r.comm_sent.get("all_to_all", 0)
    comm.pop("all_to_all", None)
    mb = compute + _comm_seconds(comm, inner_n, link) + sent / link + r.router / link
    reduce_n = job.dp * (job.inner if job.inner_kind == "sp" else 1)
    reduce = _comm_seconds(r.step_comm, reduce_n, link)
    opt = 2 * (r.weights + r.grads + r.optimizer) / (dev.memory_bw_gbs * 1e9)
    return per_replica * mb + reduce + opt, mb


def evaluate(row: Row, results: dict[GroupJob, GroupResult], dev: Device, gpus: int, limit_gb: float,
             text_tokens: int) -> Row:
    samples = gpus * row.jobs["text"].micro_batch_size
    res = {k: results[j] for k, j in row.jobs.items()}
    times = {k: group_time(row.jobs[k], res[k], dev, samples) for k in row.jobs}
    if row.placement == "collocated":
        step = sum(t for t, _ in times.values())
    else:
        step = max(t for t, _ in times.values()) + min(mb for _, mb in times.values())
    resident = {k: r.weights + r.grads + r.optimizer + (r.retained if k == "vision" else 0) for k, r in res.items()}
    groups = {}
    for k, r in res.items():
        peak = r.peak
        if row.placement == "collocated":
            peak += sum(v for o, v in resident.items() if o != k)
        elif k == "vision":
            peak += r.retained  # runtime.encoders_ahead=1: one more micro-batch's activations held
        groups[k] = {"ranks": row.jobs[k].ranks, "peak_gb": peak / GiB, "weights_gb": r.weights / GiB,
                     "grads_gb": r.grads / GiB, "optimizer_gb": r.optimizer / GiB,
                     "activations_gb": r.activations / GiB}
    grid = image_grid(row.vision_tokens)
    tokens = samples * (text_tokens + grid[1] * grid[2] // 4)
    return replace(row, groups=groups, fits=all(g["peak_gb"] <= limit_gb for g in groups.values()),
                   step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0)


def best(rows: list[Row]) -> list[Row]:
    """One row per (strategy, vision tokens, checkpointing): the fastest that fits, else the smallest peak."""
    out: dict[tuple, Row] = {}
    for r in rows:
        key = (r.strategy, r.vision_tokens, r.ac)
        cur = out.get(key)
        score = (r.fits, r.tokens_per_s if r.fits else -max(g["peak_gb"] for g in r.groups.values()))
        if cur is None or score > (cur.fits, cur.tokens_per_s if cur.fits else
                                   -max(g["peak_gb"] for g in cur.groups.values())):
            out[key] = r
    return list(out.values())


def plan(model_cfg: Any, gpus: int, dev: Device, limit_gb: float, vision_tokens: list[int], text_tokens: int,
         mbs: int, strategies: tuple[str, ...] = STRATEGIES, workers: int | None = None,
         precision: str = "fp32_master") -> list[Row]:
    """Every candidate row measured and priced; ``precision`` (``train.precision``) is what every group's
    weights, gradients and optimizer state are held in."""
    rows = candidate_rows(model_cfg, gpus, vision_tokens, text_tokens, mbs, strategies, precision=precision)
    results = measure_all([j for r in rows for j in r.jobs.values()], model_cfg, workers)
    return best([evaluate(r, results, dev, gpus, limit_gb, text_tokens) for r in rows])
