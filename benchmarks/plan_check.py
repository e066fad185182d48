"""The planner's step time against measured runs on this machine: calibrate, predict, measure (``docs/plan.md``).

1. ``dhp plan calibrate`` on CPU (``--quick`` for the small grid) writes a device profile;
2. ``dhp bench --profile`` on the demo config: every layout's ``predicted_step_s`` (the planner's fake runs of
   the layout on the demo data's mean sample, priced on the profile), then each layout trained for real by Ray;
3. a table of predicted / measured step time per layout, and whether the ranking agrees.

Layouts (4 workers): bench's three (dhp: vision SP 2 + text TP 2, disaggregated; uniform_tp: TP 2 + TP 2; fsdp:
ZeRO-3 over 2 + 2), and two of this benchmark's: ``colloc``, vision SP 2 + text TP 2 on the same 2 workers
(collocated), ``tp_text_dp``, vision DP 2 (ZeRO-1) + text TP 2, disaggregated, and ``ahead0``: dhp's layout with
``runtime.encoders_ahead=0`` (bench's layouts run one round ahead). Per layout and group it also prints the busy
share of the step, measured (the workers' own phase times) against the replay's (``dhp.plan.schedule``), and
the profile's accuracy terms it priced them with: a 256 KB all-reduce by each path (``c10d``, DTensor's
functional collectives) and a collective's peer wait on the oversubscribed host (``contention_wait_s``).

    .venv/bin/python benchmarks/plan_check.py [--quick] [--steps 3] [--out /tmp/plan_check] [--measured bench.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

EXTRA = {
    "colloc": "runtime.placement=collocated;vision.parallel.sp=2;vision.parallel.dp=1;text.parallel.tp=2;"
              "text.parallel.dp=1",
    "tp_text_dp": "runtime.placement=disaggregated;runtime.encoders_ahead=1;vision.parallel.dp=2;"
                  "vision.parallel.zero=1;text.parallel.tp=2;text.parallel.dp=1",
    "ahead0": "runtime.placement=disaggregated;runtime.encoders_ahead=0;vision.parallel.sp=2;vision.parallel.dp=1;"
              "text.parallel.tp=2;text.parallel.dp=1",
}


def main() -> None:
    from dhp.bench import parse_layouts, run_bench
    from dhp.cli import default_config_path
    from dhp.plan.calibrate import calibrate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the calibration's small grid")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out first: a TP layout's DTensor caches fill "
                    "over the first steps (one entry per new packed length: docs/plan.md)")
    ap.add_argument("--out", default="/tmp/plan_check")
    ap.add_argument("--layouts", default="dhp,uniform_tp,fsdp," + ",".join(f"{k}={v}" for k, v in EXTRA.items()))
    ap.add_argument("--measured", default=None, help="a bench.json of an earlier run of these layouts: predict only, "
                    "against its measured step times")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof = calibrate("cpu", quick=args.quick, log=print, threads=1)  # a CPU Ray worker runs one thread
    prof.save(out / "cpu_profile.json")
    terms = profile_terms(prof)
    print("profile terms: " + ", ".join(f"{k} {v * 1e3:.3f} ms" if k.endswith("_s") else f"{k} {v:.2f}"
                                        for k, v in terms.items()))
    overrides = [f"output.dir={out / 'bench'}", "runtime.cpus_per_worker=0.5"]
    layouts = parse_layouts(args.layouts, 4)
    if args.measured:
        res = json.loads(Path(args.measured).read_text())
        for name, pred in predict_layouts(layouts, overrides, out, args.steps, args.warmup, prof).items():
            res["layouts"][name].update(pred)
    else:
        res = run_bench(default_config_path(), overrides, layouts, args.steps, args.warmup,
                        profile=out / "cpu_profile.json")
    rows = {n: (r["predicted_step_s"], r["step_time_s"]) for n, r in res["layouts"].items()}
    medians = {n: r.get("step_time_median_s", r["step_time_s"]) for n, r in res["layouts"].items()}
    busy = {n: {g: (r["prediction"]["groups"][g]["busy_s"] / r["predicted_step_s"], r["groups"][g]["busy"])
                for g in r["groups"]} for n, r in res["layouts"].items() if "prediction" in r}
    wait = {n: {g: (r["prediction"]["groups"][g].get("data_wait_s", 0.0), r["groups"][g].get("data_wait_s", 0.0))
                for g in r["groups"]} for n, r in res["layouts"].items() if "prediction" in r}
    print(f"\n{'layout':<12} {'predicted s':>12} {'measured s':>11} {'pred/meas':>10} {'median s':>9} "
          f"{'pred/med':>9}   busy share predicted / measured; data wait ms predicted / measured")
    for n, (p, m) in rows.items():
        shares = "  ".join(f"{g} {a:.0%} / {b:.0%}" for g, (a, b) in busy.get(n, {}).items())
        waits = "  ".join(f"{g} {a * 1e3:.1f} / {b * 1e3:.1f}" for g, (a, b) in wait.get(n, {}).items())
        print(f"{n:<12} {p:>12.3f} {m:>11.3f} {p / m:>10.2f} {medians[n]:>9.3f} {p / medians[n]:>9.2f}   "
              f"{shares};  {waits}")
    by_pred = sorted(rows, key=lambda n: rows[n][0])
    by_meas = sorted(rows, key=lambda n: rows[n][1])
    print(f"ranking, fastest first: predicted {by_pred}; measured {by_meas}; "
          f"{'agree' if by_pred == by_meas else 'differ'}")
    (out / "plan_check.json").write_text(json.dumps({
        "profile": prof.label, "terms": terms, "rows": rows, "median_step_s": medians, "busy_share": busy,
        "data_wait_s": wait, "predicted_order": by_pred, "measured_order": by_meas}, indent=1))


def profile_terms(prof: Any, nbytes: int = 2**18) -> dict[str, float]:
    """The profile's CPU accuracy terms: an all-reduce of ``nbytes`` over 2 ranks by each path, a collective's
    peer wait on an oversubscribed host at the calibration's processes per core, compute's slowdown with every
    core busy, DTensor's cost per op, FSDP2's and TP's per call beyond their fits, and the runtime's hop."""
    from dhp.plan.profile import C10D, FUNCTIONAL

    return {"all_reduce_256KB_c10d_s": prof.collective_s("all_reduce", 2, nbytes, 1, C10D),
            "all_reduce_256KB_functional_s": prof.collective_s("all_reduce", 2, nbytes, 1, FUNCTIONAL),
            "contention_wait_s": prof.contention_wait_s, "contention_ratio": prof.contention_ratio,
            "busy_slowdown": prof.busy_slowdown, "dtensor_op_s": prof.dtensor_op_s, "tp_call_s": prof.tp_call_s,
            "fsdp_call_s": prof.fsdp_call_s, "runtime_hop_s": prof.actor_call_s}


def predict_layouts(layouts: dict, overrides: list[str], out: Path, steps: int, warmup: int, prof: Any) -> dict:
    from dhp.bench import layout_config
    from dhp.cli import default_config_path
    from dhp.plan.predict import predict_config

    cfgs = {n: layout_config(default_config_path(), overrides, lay, n, out, steps, warmup)
            for n, lay in layouts.items()}
    out = {}
    for n, c in cfgs.items():
        p = predict_config(c, prof, step=warmup)
        out[n] = {"predicted_step_s": p["predicted_step_s"], "prediction": p}
    return out


if __name__ == "__main__":
    main()
