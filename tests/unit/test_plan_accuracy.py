"""The step-time model's CPU accuracy terms (``docs/plan.md``, "The prediction beside measured runs"): GEMMs
priced by their operands' layout, collectives by the path the code called them by (``c10d`` or DTensor's
functional collectives), and the peer waits of collectives on an oversubscribed host, each in closed form; older
profiles load and price as before."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest
import torch

from dhp.plan.calibrate import contention_wait, gemm_operands, in_situ, stack_call_s, stack_op_s
from dhp.plan.costs import by_path, group_cost
from dhp.plan.measure import GroupJob, GroupResult, measure, media_of
from dhp.plan.ops import OpTally, fcoll_calls_key, fcoll_key, functional_comm, gemm_key, gemm_layout, merged
from dhp.plan.profile import C10D, FUNCTIONAL, CollectiveFit, GemmPoint, Profile
from dhp.plan.schedule import Lane, driver_script, replay
from tests.dist_utils import run_distributed


def _profile(**kw: Any) -> Profile:
    """nn rows at 1 GFLOP/s, nt rows at 1/3 of it; c10d all-reduce 1e-4 + B / 1e9, functional 3e-4 + B / 5e8."""
    gemm = [GemmPoint(m, n, k, "float32", rate, layout) for m in (64, 512) for n in (64, 512) for k in (64, 512)
            for layout, rate in (("nn", 1e9), ("nt", 1e9 / 3))]
    return Profile(name="synthetic", source="calibrated", device_type="cpu", peak_flops=1e9, hbm_bytes_per_s=1e10,
                   link_bytes_per_s=1e9, async_launch=False, gemm=gemm,
                   collectives=[CollectiveFit("all_reduce", 2, 1e-4, 1e9),
                                CollectiveFit("all_reduce", 2, 3e-4, 5e8, FUNCTIONAL)], **kw)


# ---- GEMM layouts ----------------------------------------------------------------------------------------------


def test_the_tally_keys_a_linears_matmuls_by_their_operands_layout() -> None:
    """``F.linear``'s forward is ``x @ w.t()`` (``nt``); its weight gradient ``grad.t() @ x`` (``tn``); its input
    gradient ``grad @ w`` (``nn``, no suffix)."""
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with OpTally() as t:
        (torch.nn.functional.linear(x, w) * torch.randn(32, 8)).sum().backward()  # a dense output gradient
    tally = merged(t.tally())
    assert tally[gemm_key(32, 8, 16, "float32", "nt")] == 1
    assert tally[gemm_key(8, 16, 32, "float32", "tn")] == 1
    assert tally[gemm_key(32, 16, 8, "float32")] == 1
    assert gemm_key(32, 16, 8, "float32") == gemm_key(32, 16, 8, "float32", "nn") == "gemm|32|16|8|float32"
    for layout in ("nn", "nt", "tn", "tt"):  # the calibration's operands are what the tally would key them as
        a, b = gemm_operands(64, 32, 16, layout, torch.float32, "cpu")
        assert gemm_layout(a, b) == layout and tuple(a.shape) == (64, 16) and tuple(b.shape) == (16, 32)


def test_a_gemm_is_priced_by_the_rows_of_its_layout_and_an_old_profile_by_its_nn_rows(tmp_path: Any) -> None:
    p = _profile()
    flops = 2 * 512 * 512 * 512
    assert p.gemm_s(512, 512, 512, "float32") == pytest.approx(flops / 1e9)
    assert p.gemm_s(512, 512, 512, "float32", "nt") == pytest.approx(3 * flops / 1e9)
    assert p.gemm_s(512, 512, 512, "float32", "tn") == pytest.approx(flops / 1e9)  # not measured: the nn rows
    # a region's matmuls by key: 2 nt calls and one nn call
    r = GroupResult(ops=[{gemm_key(512, 512, 512, "float32", "nt"): 2, gemm_key(512, 512, 512, "float32"): 1}])
    assert group_cost(GroupJob("text"), r, p, samples=1).device_mb == pytest.approx(7 * flops / 1e9)
    # a profile written before layouts and paths (no ``layout``, ``path``, contention fields) loads and prices
    # every layout by its rows, every path by its fits, as before
    old = asdict(_profile())
    old["gemm"] = [{k: v for k, v in g.items() if k != "layout"} for g in old["gemm"] if g["layout"] == "nn"]
    old["collectives"] = [{k: v for k, v in c.items() if k != "path"} for c in old["collectives"]
                          if c["path"] == C10D]
    for key in ("contention_wait_s", "contention_ratio"):
        old.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(old))
    q = Profile.load(tmp_path / "old.json")
    assert q.gemm_s(512, 512, 512, "float32", "nt") == pytest.approx(flops / 1e9)
    assert q.collective_s("all_reduce", 2, 1e6, 1, FUNCTIONAL) == pytest.approx(1e-4 + 1e6 / 1e9)
    assert q.contention_wait_coefficient() == 0.0


# ---- collectives by path ----------------------------------------------------------------------------------------


def test_collectives_are_priced_by_the_path_the_tally_saw_them_take() -> None:
    """3 all-reduces of 1 MB in all; the tally saw 2 of them, 0.8 MB, through the functional path: those at the
    functional fit, the rest (1 call, 0.2 MB) at the c10d fit."""
    p = _profile()
    regions = [{fcoll_key("all_reduce"): 8e5, fcoll_calls_key("all_reduce"): 1},
               {fcoll_key("all_reduce"): 0, fcoll_calls_key("all_reduce"): 1}]
    comm, calls = {"all_reduce": 10**6}, {"all_reduce": 3}
    parts = by_path(comm, calls, regions)
    assert parts[FUNCTIONAL] == ({"all_reduce": 8e5}, {"all_reduce": 2})
    assert parts[C10D] == ({"all_reduce": 2e5}, {"all_reduce": 1})
    r = GroupResult(ops=regions, comm=comm, comm_calls=calls, forward_regions=2, forward_comm=comm,
                    forward_comm_calls=calls)
    c = group_cost(GroupJob("text", inner=2, inner_kind="tp"), r, p, samples=1)
    assert c.comm_exposed_mb == pytest.approx((2 * 3e-4 + 8e5 / 5e8) + (1e-4 + 2e5 / 1e9))
    assert c.forward_waits_mb == 3 and c.backward_waits_mb == 0


def test_the_fake_run_tells_tps_functional_collectives_from_ulysses_c10d_ones() -> None:
    """Text TP 2: DTensor's all-reduces are functional; the rest of the collective counter's are the
    vocab-parallel loss's three ``dist.all_reduce`` (row max, sum of exponentials, target logit: one float32
    per row each), c10d: its rows are the supervised ones, the engine's ``PackedMeta.label_rows`` (the 64 text
    tokens but the last, rounded up to the packing's multiple, 64 under TP). Vision SP 2 (Ulysses'
    ``dist.all_to_all_single``): none is functional."""
    from dhp.models.qwen2_5_vl.config import tiny

    cfg = tiny(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
    base = dict(media=media_of({"vision": 256}), text_tokens=64, device="cpu")
    tp = measure(GroupJob("text", inner=2, inner_kind="tp", **base), cfg)
    parts = by_path(tp.comm, tp.comm_calls, tp.ops)
    rows = 64
    assert parts[C10D] == ({"all_reduce": 3 * 4 * rows}, {"all_reduce": 3})
    f_bytes, f_calls = parts[FUNCTIONAL]
    assert f_bytes["all_reduce"] == tp.comm["all_reduce"] - 3 * 4 * rows > 0
    assert f_calls["all_reduce"] == tp.comm_calls["all_reduce"] - 3 > 0
    sp = measure(GroupJob("vision", inner=2, inner_kind="sp", **base), cfg)
    assert sp.comm.get("all_to_all", 0) > 0 and functional_comm(sp.ops) == ({}, {})


# ---- collectives in situ, and what FSDP2's and TP's calls add --------------------------------------------------


def _in_situ_on_a_clock(rank: int, world: int) -> float:
    """``in_situ`` on a clock that only the loop's own calls move: a chunk of compute 1 s, the collective 0.25 s
    on rank 0 and 0.5 s on rank 1."""
    now = [0.0]

    def advance(seconds: float):
        return lambda: now.__setitem__(0, now[0] + seconds)

    return in_situ(advance(0.25 * (rank + 1)), advance(1.0), reps=7, clock=lambda: now[0])


def test_in_situ_is_the_slowest_ranks_mean_cost_per_call_beyond_its_compute() -> None:
    """(7 x (1 + c) - 7 x 1) / 7 = c on each rank; the slowest rank's, on every rank."""
    assert run_distributed(_in_situ_on_a_clock, 2) == [pytest.approx(0.5), pytest.approx(0.5)]


def test_a_stacks_call_cost_is_its_time_beyond_the_plain_stack_its_priced_collectives_and_dispatch() -> None:
    """An FSDP2 stack: 6 all-gathers of 1 MB in all and 3 reduce-scatters of 0.5 MB, c10d fits 1 ms + B / 1 GB/s
    and 2 ms + B / 0.5 GB/s; 30 ms sharded against 10 ms plain: (20 - 7 - 7) ms over 9 calls. A TP stack
    prices its all-reduces by the functional fit and its DTensor ops' dispatch; never below 0."""
    fits = [CollectiveFit("all_gather", 2, 1e-3, 1e9), CollectiveFit("reduce_scatter", 2, 2e-3, 5e8),
            CollectiveFit("all_reduce", 2, 9.0, 1.0), CollectiveFit("all_reduce", 2, 1e-3, 1e9, FUNCTIONAL)]
    fsdp = {"sharded_s": 0.030, "plain_s": 0.010, "bytes": {"all_gather": 1e6, "reduce_scatter": 5e5},
            "calls": {"all_gather": 6, "reduce_scatter": 3}, "dtensor_ops": 0, "path": C10D}
    assert stack_call_s(fsdp, 2, fits, 1e-5) == pytest.approx((0.020 - (6e-3 + 1e-3) - (6e-3 + 1e-3)) / 9)
    tp = {"sharded_s": 0.030, "plain_s": 0.010, "bytes": {"all_reduce": 2e6}, "calls": {"all_reduce": 4},
          "dtensor_ops": 100, "path": FUNCTIONAL}
    assert stack_call_s(tp, 2, fits, 1e-5) == pytest.approx((0.020 - (4e-3 + 2e-3) - 100 * 1e-5) / 4)
    assert stack_call_s({**tp, "sharded_s": 0.012}, 2, fits, 1e-5) == 0.0
    # DTensor's cost per op, from the stack on a one-rank mesh (no collective): 8 ms beyond 10 over 100 ops;
    # what the two-rank stack took beyond it and its fits is per call: (20 - 6 - 8) ms over 4 calls
    op_s = stack_op_s({"sharded_s": 0.018, "plain_s": 0.010, "dtensor_ops": 100})
    assert op_s == pytest.approx(8e-5)
    assert stack_call_s(tp, 2, fits, op_s) == pytest.approx(1.5e-3)
    assert stack_op_s({"sharded_s": 0.009, "plain_s": 0.010, "dtensor_ops": 100}) == 0.0  # never below 0
    assert stack_op_s(fsdp) == 0.0  # no DTensor op


def test_fsdp2_and_tp_calls_pay_their_in_situ_terms_where_they_run() -> None:
    """Each FSDP2 all-gather or reduce-scatter over dp > 1 pays ``fsdp_call_s``, each functional (DTensor)
    collective over tp > 1 ``tp_call_s``; a c10d collective of a TP group (the vocab-parallel loss's) neither."""
    regions = [{fcoll_key("all_reduce"): 8e5, fcoll_calls_key("all_reduce"): 2}]
    r = GroupResult(ops=regions, comm={"all_reduce": 10**6}, comm_calls={"all_reduce": 3}, forward_regions=1,
                    forward_comm={"all_reduce": 10**6}, forward_comm_calls={"all_reduce": 3})
    tp = GroupJob("text", inner=2, inner_kind="tp")
    base, more = _profile(), _profile(tp_call_s=2e-3, fsdp_call_s=5e-3)
    assert (group_cost(tp, r, more, samples=1).comm_exposed_mb - group_cost(tp, r, base, samples=1).comm_exposed_mb
            == pytest.approx(2 * 2e-3))
    one = GroupJob("text", inner=1, inner_kind="tp")
    assert group_cost(one, r, more, samples=1).micro_batch_s == group_cost(one, r, base, samples=1).micro_batch_s
    f = GroupResult(ops=[{}], comm={"all_gather": 10**6, "reduce_scatter": 10**6},
                    comm_calls={"all_gather": 4, "reduce_scatter": 2}, forward_regions=1,
                    forward_comm={"all_gather": 5 * 10**5}, forward_comm_calls={"all_gather": 2})
    z3 = GroupJob("vision", dp=2, zero=3)
    assert (group_cost(z3, f, more, samples=2).comm_exposed_mb - group_cost(z3, f, base, samples=2).comm_exposed_mb
            == pytest.approx(6 * 5e-3))
    z1 = GroupJob("vision", dp=2, zero=1)  # not FSDP2: no such calls
    assert group_cost(z1, f, more, samples=2).micro_batch_s == group_cost(z1, f, base, samples=2).micro_batch_s


# ---- contention on an oversubscribed host ------------------------------------------------------------------------


def test_contention_wait_is_what_collectives_take_beyond_processor_sharing() -> None:
    """Alone: GEMMs 1 s, loop 1.5 s (0.5 s of collectives). Beside busy processes the GEMMs take 2 s (half the
    cores), so processor sharing predicts 1 s of collectives; they took 3 s (loop 5 s): 2 s over 100 calls."""
    alone, beside = {"compute_s": 1.0, "loop_s": 1.5}, {"compute_s": 2.0, "loop_s": 5.0}
    assert contention_wait(alone, beside, 100) == pytest.approx(0.02)
    assert contention_wait(alone, {"compute_s": 2.0, "loop_s": 2.9}, 100) == 0.0  # less than predicted: none
    # measured at 2 processes per core (the peers off their cores half the time): 0.02 / (1 - 1/2) per unit share
    assert _profile(contention_wait_s=0.02, contention_ratio=2.0).contention_wait_coefficient() == pytest.approx(0.04)
    assert _profile(contention_wait_s=0.02, contention_ratio=1.0).contention_wait_coefficient() == 0.0


def test_the_replay_adds_peer_waits_only_on_an_oversubscribed_pool() -> None:
    """One round, ahead 0, both groups on one host pool. Capacity 1, demand 1 each: calls run one at a time at
    full rate (forward 1, forward_backward 3, backward 2: 6 s) and their waits cost nothing. Lanes of demand 2 on
    capacity 1 (4 workers on 2 cores): each runs at half rate, peers off their cores half the time, so each of a
    call's waits adds 0.5 x 0.04 s: 12 s + 0.02 x (2 + 4 + 3) waits."""
    work = {"forward": 1.0, "forward_backward": 3.0, "backward": 2.0}
    waits = {"forward": 2.0, "forward_backward": 4.0, "backward": 3.0}
    script = driver_script(1, ["vision"], "text")

    def run(demand: float, wait_s: float) -> float:
        lanes = {g: Lane("host", demand, wait_s) for g in ("vision", "text")}
        return replay(script, lanes, {"host": 1.0}, lambda c: work.get(c.kind, 0.0), 0.0,
                      lambda c: waits.get(c.kind, 0.0)).step_s

    assert run(1.0, 0.04) == pytest.approx(6.0)
    assert run(2.0, 0.0) == pytest.approx(12.0)
    assert run(2.0, 0.04) == pytest.approx(12.0 + 0.02 * 9)
    # without a ``waits`` callable (every caller before contention was priced) the replay is processor sharing
    lanes = {g: Lane("host", 2.0, 0.04) for g in ("vision", "text")}
    assert replay(script, lanes, {"host": 1.0}, lambda c: work.get(c.kind, 0.0)).step_s == pytest.approx(12.0)


def test_a_steps_end_prices_its_collectives_back_to_back() -> None:
    """``Profile.burst_s``: n ``c10d`` calls in a row cost one in-situ call (the ranks arrive apart) and n - 1 at
    the burst fit (aligned by the one before); the step's end (``costs.step_collectives_s``) prices its c10d
    calls so, its functional ones as any. A profile without burst fits prices every call in situ."""
    from dhp.plan.costs import step_collectives_s
    from dhp.plan.profile import BURST, CollectiveFit

    in_situ = CollectiveFit("broadcast", 2, 2e-3, 1e9)
    burst = CollectiveFit("broadcast", 2, 2e-4, 2e9, BURST)
    p = Profile("t", collectives=[in_situ, burst], link_bytes_per_s=1.0)
    n, nbytes = 46, 46 * 1000
    want = (2e-3 + 1000 / 1e9) + (45 * 2e-4 + 45 * 1000 / 2e9)
    assert p.burst_s("broadcast", 2, nbytes, n) == pytest.approx(want)
    assert p.burst_s("broadcast", 2, 1000, 1) == pytest.approx(2e-3 + 1000 / 1e9)
    assert step_collectives_s({"broadcast": nbytes}, {"broadcast": n}, [], 2, p) == pytest.approx(want)
    alone = Profile("t", collectives=[in_situ], link_bytes_per_s=1.0)
    assert alone.burst_s("broadcast", 2, nbytes, n) == pytest.approx(n * 2e-3 + nbytes / 1e9)
