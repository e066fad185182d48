"""The runtime's step replayed (``dhp.plan.schedule``): closed forms of the driver's order, processor sharing
and the round trips (the script against the Ray backend's own trace: ``tests/distributed/test_bench.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dhp.plan.schedule import Action, Call, Lane, driver_script, loader_lane, pool_fill, replay, steady_replay

WORK = {"forward": 1.0, "backward": 2.0, "forward_backward": 3.0}


def work(c: Call) -> float:
    return WORK.get(c.kind, 0.0)


def own_pools() -> tuple[dict[str, Lane], dict[str, float]]:
    return {"vision": Lane("vision"), "text": Lane("text")}, {"vision": 1.0, "text": 1.0}


def spans_of(rep, group: str) -> list[tuple[str, int, float, float]]:
    return [(c.kind, c.round, s, e) for c, s, e in rep.spans if c.group == group and c.kind in WORK]


def test_disaggregated_encoders_one_round_ahead() -> None:
    """F0 [0,1], F1 [1,2] under T0 [1,4]; B0 [4,6]; T1 [4,7]; B1 [7,9]: 9 s, each group busy 6."""
    rep = replay(driver_script(2, ["vision"], "text", ahead=1), *own_pools(), work)
    assert rep.step_s == pytest.approx(9.0)
    assert spans_of(rep, "vision") == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 4, 6),
                                       ("backward", 1, 7, 9)]
    assert spans_of(rep, "text") == [("forward_backward", 0, 1, 4), ("forward_backward", 1, 4, 7)]
    assert rep.busy_s == pytest.approx({"vision": 6.0, "text": 6.0})
    assert rep.idle_s == pytest.approx({"vision": 3.0, "text": 3.0})
    assert rep.critical_path == "vision -> text -> vision"


def test_disaggregated_without_running_ahead_serializes_the_groups() -> None:
    """ahead 0: the next forward is submitted after the backward, so it queues behind it: 12 s."""
    rep = replay(driver_script(2, ["vision"], "text", ahead=0), *own_pools(), work)
    assert rep.step_s == pytest.approx(12.0)
    assert spans_of(rep, "vision") == [("forward", 0, 0, 1), ("backward", 0, 4, 6), ("forward", 1, 6, 7),
                                       ("backward", 1, 10, 12)]


def test_a_shared_pool_splits_its_capacity_between_running_calls() -> None:
    """Both lanes on one pool of capacity 1: F1 and T0 share [1,3] at half rate, T0 ends at 5; B0 and T1 share
    [5,9], T1 ends at 10; B1 [10,12]."""
    lanes, pools = {"vision": Lane("host"), "text": Lane("host")}, {"host": 1.0}
    rep = replay(driver_script(2, ["vision"], "text", ahead=1), lanes, pools, work)
    assert rep.step_s == pytest.approx(12.0)
    assert spans_of(rep, "text") == [("forward_backward", 0, 1, 5), ("forward_backward", 1, 5, 10)]
    assert spans_of(rep, "vision")[1] == ("forward", 1, 1, 3)
    assert spans_of(rep, "vision")[2] == ("backward", 0, 5, 9)
    # a pool of two: no slowdown, the disaggregated figures
    lanes = {"vision": Lane("host"), "text": Lane("host")}
    assert replay(driver_script(2, ["vision"], "text", ahead=1), lanes, {"host": 2.0}, work).step_s == \
        pytest.approx(9.0)


def test_every_call_pays_the_round_trip() -> None:
    """One round, ahead 0, round trip c. The object-store router: forward, forward_backward, backward,
    finish_gradients and step each wait for the one before through the driver: 6 + 5c. The p2p plane: the
    backward is submitted with the text step and receives its gradients inside the call, so it starts as the text
    step ends, without a hop through the driver: 6 + 4c."""
    c = 0.25
    rep = replay(driver_script(1, ["vision"], "text", data_plane="ray"), *own_pools(), work, call_s=c)
    assert rep.step_s == pytest.approx(6.0 + 5 * c)
    rep = replay(driver_script(1, ["vision"], "text"), *own_pools(), work, call_s=c)
    assert rep.step_s == pytest.approx(6.0 + 4 * c)
    assert spans_of(rep, "vision")[1] == ("backward", 0, 4 + 1.5 * c, 6 + 1.5 * c)


def test_on_the_p2p_plane_the_next_text_step_queues_behind_the_last() -> None:
    """ahead 1, round trip c = 0.25. p2p: F0 [c/2, 1+c/2], F1 behind it; T0 from 1+1.5c to 4+1.5c; T1, submitted
    once F1's metadata is back (2+c), queues behind T0 and starts as it ends; B0 and B1 start as T0 and T1 end;
    the step ends two hops after B1 (finish_gradients, step) plus the waits for it: 9 + 4c. The object-store router
    takes T0's losses and gradients before it submits T1 and B0: each text step waits a hop for the driver."""
    c = 0.25
    rep = replay(driver_script(2, ["vision"], "text", ahead=1), *own_pools(), work, call_s=c)
    (_, _, _, t0_end), (_, _, t1_start, _) = spans_of(rep, "text")
    assert t1_start == pytest.approx(t0_end) == pytest.approx(4 + 1.5 * c)
    assert spans_of(rep, "vision")[2:] == [("backward", 0, pytest.approx(4 + 1.5 * c), pytest.approx(6 + 1.5 * c)),
                                           ("backward", 1, pytest.approx(7 + 1.5 * c), pytest.approx(9 + 1.5 * c))]
    assert rep.step_s == pytest.approx(9 + 4 * c)
    ray = replay(driver_script(2, ["vision"], "text", ahead=1, data_plane="ray"), *own_pools(), work, call_s=c)
    (_, _, _, t0_end), (_, _, t1_start, _) = spans_of(ray, "text")
    assert t1_start == pytest.approx(t0_end + c)


def test_the_ray_data_plane_adds_the_router_calls_in_the_backends_order() -> None:
    script = driver_script(1, ["vision", "audio"], "text", data_plane="ray")
    flat = [(a.op, c.group, c.kind, c.source) for a in script for c in a.calls]
    assert flat[:8] == [("submit", "vision", "forward", ""), ("submit", "audio", "forward", ""),
                        ("submit", "vision", "emit", ""), ("submit", "audio", "emit", ""),
                        ("wait", "vision", "forward", ""), ("wait", "audio", "forward", ""),
                        ("wait", "vision", "emit", ""), ("wait", "audio", "emit", "")]
    assert ("submit", "text", "emit_grads", "vision") in flat and ("submit", "text", "emit_grads", "audio") in flat
    assert flat[-3:] == [("wait", g, "step", "") for g in ("vision", "audio", "text")]
    frozen = driver_script(1, ["vision"], "text", trains={"vision": False})
    assert not any(c.kind == "backward" for a in frozen for c in a.calls)


def test_collocated_window_encodes_every_round_of_the_window_first() -> None:
    script = driver_script(4, ["vision"], "text", window=2)
    order = [(c.kind, c.round) for a in script if a.op == "submit" for c in a.calls if c.kind in WORK]
    assert order[:3] == [("forward", 0), ("forward", 1), ("forward_backward", 0)]
    assert order.index(("forward", 2)) > order.index(("forward_backward", 1))


def test_a_long_critical_path_is_written_compactly() -> None:
    """Collocated-like serial rounds (ahead 0): the path alternates; repeats are written once with a count."""
    rep = replay(driver_script(6, ["vision"], "text"), *own_pools(), work)
    assert rep.critical_path.startswith("(vision -> text) x ") and rep.critical_path.endswith("vision")
    assert rep.step_s == pytest.approx(6 * 6.0)


def _with_loaders(vision_load: float) -> tuple[dict[str, Lane], dict[str, float], Callable[[Call], float]]:
    """Own pools for the groups and for their loaders; a vision round loads in ``vision_load`` s, text's at once;
    the optimizer step takes 2 s."""
    lanes = {"vision": Lane("vision"), "text": Lane("text"), loader_lane("vision"): Lane("vision loads"),
             loader_lane("text"): Lane("text loads")}
    pools = {"vision": 1.0, "text": 1.0, "vision loads": 1.0, "text loads": 1.0}
    return lanes, pools, lambda c: (vision_load if c.kind == "load" and c.group == "vision"
                                    else 2.0 if c.kind == "step" else work(c))


def test_the_loaders_run_a_round_ahead_and_a_forward_waits_for_its_samples() -> None:
    """Four rounds, vision loads of 4 s, in the background; the prefetch is a call on the group's actors, so a
    load starts once the calls submitted before it have run. Round k + 1's prefetch goes in at round k's encode
    turn: L2 behind F0, L3 behind B0. The next step's first two rounds go in behind the last forward (F3): of
    them 1 s of L1 is left at the step's end, which this step carried too. L1 [0,1]; F0 [0,1], F1 [1,2]; L2 [1,5];
    T0 [1,4], B0 [4,6]; L3 [6,10]; F2 [6,7]; T1 [4,7], B1 [7,9], T2 [7,10]; F3 [10,11], waiting 1 s for L3; L0'
    [11,15], L1' from 15; T3 [11,14], B2 [11,13], B3 [14,16]; step [16,18]: 18 s."""
    lanes, pools, w = _with_loaders(4.0)
    script = driver_script(4, ["vision"], "text", ahead=1, loads=True)
    first = [(c.group, c.kind, c.round, c.source) for a in script[:1] for c in a.calls]
    assert first == [("vision", "load", 0, "carried"), ("text", "load", 0, "carried"),
                     ("vision", "load", 1, "carried"), ("text", "load", 1, "carried")]
    rep = steady_replay(script, lanes, pools, w)
    assert rep.step_s == pytest.approx(18.0)
    assert spans_of(rep, "vision") == [
        ("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 4, 6), ("forward", 2, 6, 7),
        ("backward", 1, 7, 9), ("forward", 3, 10, 11), ("backward", 2, 11, 13), ("backward", 3, 14, 16)]
    assert spans_of(rep, "text") == [("forward_backward", 0, 1, 4), ("forward_backward", 1, 4, 7),
                                     ("forward_backward", 2, 7, 10), ("forward_backward", 3, 11, 14)]
    loads = {(c.round, c.source): (s, e) for c, s, e in rep.spans if c.kind == "load" and c.group == "vision"}
    assert loads[(2, "")] == pytest.approx((1, 5)) and loads[(3, "")] == pytest.approx((6, 10))
    assert loads[(0, "next")] == pytest.approx((11, 15))
    assert rep.data_wait_s == pytest.approx({"vision": 1.0, "text": 0.0})
    assert rep.loader_s["vision"] == pytest.approx(1 + 4 + 4 + 4 + 3)  # carried 1, L2, L3, L0', 3 s of L1'
    assert {(c.round, c.source): v for c, v in rep.left.items() if c.group == "vision"} == \
        pytest.approx({(1, "next"): 1.0})
    # quick loads: no wait, the step of a run without loaders
    fast = steady_replay(script, *_with_loaders(0.1)[:2], _with_loaders(0.1)[2])
    assert fast.step_s == pytest.approx(17.0) and fast.data_wait_s["vision"] == 0.0  # F3 at 9, B3 ends at 15
    # without ``loads`` the script has no load at all, and the loaders' lanes are not groups
    plain = driver_script(4, ["vision"], "text", ahead=1)
    assert not any(c.kind == "load" for a in plain for c in a.calls)
    assert set(replay(plain, lanes, pools, w).busy_s) == {"vision", "text"}


def test_compute_slows_as_a_host_pool_fills() -> None:
    """Two lanes on a host of 2 cores, one call at a time (ahead 0: F, T, B in turn, 6 s alone). A lane of 1 rank
    leaves a core free: no slowdown. Lanes of 2 ranks fill the host: each call's compute takes busy_slowdown 1.5x
    longer, 9 s; with half of each call compute, 1.25x, 7.5 s."""
    script = driver_script(1, ["vision"], "text")
    pools = {"host": 2.0}

    def lanes(ranks: int) -> dict[str, Lane]:
        return {g: Lane("host", ranks, busy_slowdown=1.5) for g in ("vision", "text")}

    assert replay(script, lanes(1), pools, work, compute=work).step_s == pytest.approx(6.0)
    assert replay(script, lanes(2), pools, work, compute=work).step_s == pytest.approx(9.0)
    assert replay(script, lanes(2), pools, work, compute=lambda c: work(c) / 2).step_s == pytest.approx(7.5)
    assert replay(script, lanes(2), pools, work).step_s == pytest.approx(6.0)  # no compute given: none slowed
    assert [pool_fill(2.0, d) for d in (0.5, 1.0, 1.5, 2.0, 4.0)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert pool_fill(1.0, 3.0) == 0.0


def test_the_drivers_hop_grows_as_the_host_it_shares_fills() -> None:
    """A (10 s) on a host lane of 2 ranks filling the driver's 2-core host; B then C (1 s each) on a pool of their
    own, one after the other through the driver. Hop 0.2 s alone, 1.0 s on the full host: A and B start at 0.1,
    B ends at 1.1 while A runs, so the driver sees it at 1.6 and C starts at 2.1 (1.3 with the idle hop); the
    driver sees A's end at 10.2, the host idle again. Without a driver pool (a GPU run) every hop is 0.2 s."""
    a, b, c = Call("x", "forward", 0), Call("y", "forward", 0), Call("y", "forward", 1)
    script = [Action("submit", (a,)), Action("submit", (b,)), Action("wait", (b,)), Action("submit", (c,)),
              Action("wait", (c,)), Action("wait", (a,))]
    lanes, pools = {"x": Lane("host", 2.0), "y": Lane("gpu")}, {"host": 2.0, "gpu": 1.0}
    secs = {a: 10.0, b: 1.0, c: 1.0}
    rep = replay(script, lanes, pools, secs.__getitem__, call_s=0.2, busy_call_s=1.0, driver_pool="host")
    starts = {call: (s, e) for call, s, e in rep.spans}
    assert starts[a] == pytest.approx((0.1, 10.1))
    assert starts[b] == pytest.approx((0.1, 1.1))
    assert starts[c] == pytest.approx((2.1, 3.1))
    assert rep.step_s == pytest.approx(10.2)
    plain = replay(script, lanes, pools, secs.__getitem__, call_s=0.2, busy_call_s=1.0)
    assert {call: s for call, s, _ in plain.spans}[c] == pytest.approx(1.3)
    # half full (a lane of 1.5 ranks on 2 cores: pool_fill 0.5): the hop is 0.6 s while A runs
    half = replay(script, {**lanes, "x": Lane("host", 1.5)}, pools, secs.__getitem__, call_s=0.2, busy_call_s=1.0,
                  driver_pool="host")
    assert {call: s for call, s, _ in half.spans}[c] == pytest.approx(1.1 + 0.6)
