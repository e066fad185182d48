"""The planner's step-time model (``docs/plan.md``, "The step-time model"): device profiles, per-op pricing,
the alpha-beta fit, the roofline in closed form, calibration on CPU, a device per group."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from dhp.observe.devices import get_device
from dhp.plan.costs import group_cost
from dhp.plan.measure import GroupJob, GroupResult, measure, media_of
from dhp.plan.ops import attn_key, gemm_key, merged
from dhp.plan.profile import (
    BURST,
    C10D,
    FUNCTIONAL,
    AttentionPoint,
    CollectiveFit,
    GemmPoint,
    Profile,
    fit_alpha_beta,
    ring_factor,
    roofline,
)


def test_alpha_beta_fit_recovers_a_known_latency_and_bandwidth() -> None:
    alpha, beta = 25e-6, 12e9
    pts = [(float(n), alpha + n / beta) for n in (2**12, 2**16, 2**20, 2**24)]
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    # noise: +-3 % on each point, alternating; the fit stays within a few percent of the truth
    noisy = [(n, t * (1.03 if i % 2 else 0.97)) for i, (n, t) in enumerate(pts)]
    a, b = fit_alpha_beta(noisy)
    assert b == pytest.approx(beta, rel=0.05)
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_alpha_beta([(1.0, 1.0), (1.0, 2.0)])


def _result() -> GroupResult:
    """A rank's tally in closed form: one region of 10 matmuls 4096 x 5120 x 5120 (bf16), attention work, 1 GB
    of memory-bound traffic and 3000 ops; a host sync, then a second region; TP all-reduces; a step."""
    r1 = {gemm_key(4096, 5120, 5120, "bfloat16"): 10, attn_key("sdpa_flash", 4096, 128, "bfloat16"): 1e12,
          "mem_bytes": 1e9, "ops": 3000}
    r2 = {"mem_bytes": 2e9, "ops": 1000}
    return GroupResult(ops=[r1, r2], step_ops=[{"mem_bytes": 5e9, "ops": 200}],
                       comm={"all_reduce": 8 * 2**20}, comm_calls={"all_reduce": 4},
                       step_comm={"all_reduce": 64 * 2**20}, step_comm_calls={"all_reduce": 2}, router=2**20)


def test_roofline_prices_each_op_in_closed_form() -> None:
    dev = get_device("h100")
    p = roofline(dev)
    job = GroupJob("text", dp=2, inner=4, inner_kind="tp")
    c = group_cost(job, _result(), p, samples=8)
    peak, hbm, link = dev.peak_flops * dev.efficiency, dev.memory_bw_gbs * 1e9, dev.link_gbs * 1e9
    region1 = 10 * 2 * 4096 * 5120 * 5120 / peak + 1e12 / peak + 1e9 / hbm  # compute-bound GEMMs at peak x eff
    region2 = 2e9 / hbm
    assert c.compute_mb == pytest.approx(region1 + region2, rel=1e-12)  # no host cost in the roofline
    assert c.comm_exposed_mb == pytest.approx(8 * 2**20 * 2 * 3 / 4 / link, rel=1e-12)  # ring, no latency
    assert c.router_mb == pytest.approx(2**20 / link, rel=1e-12)
    assert c.micro_batches == 4  # 8 samples over dp 2, one per micro-batch
    assert c.reduce_s == pytest.approx(64 * 2**20 * ring_factor("all_reduce", 2) / link, rel=1e-12)
    assert c.optimizer_s == pytest.approx(5e9 / hbm, rel=1e-12)
    assert c.step_s == pytest.approx(4 * (c.compute_mb + c.comm_exposed_mb + c.router_mb) + c.reduce_s
                                     + c.optimizer_s, rel=1e-12)
    # a small matmul is bound by its bytes, not its FLOPs
    assert p.gemm_s(8, 8192, 8192, "bfloat16") == pytest.approx(2 * (8 * 8192 * 2 + 8192 * 8192) / hbm, rel=1e-12)


def _profile(**kw: Any) -> Profile:
    return Profile(name="synthetic", source="calibrated", device_type="cpu", machine="a test", created="now",
                   peak_flops=1e11, hbm_bytes_per_s=1e10, link_bytes_per_s=1e9, cpu_op_s=1e-5, sync_s=1e-4,
                   async_launch=False,
                   gemm=[GemmPoint(m, n, k, "bfloat16", 1e9 * m / 64) for m in (64, 512) for n in (128, 1024)
                         for k in (128, 1024)],
                   attention=[AttentionPoint("sdpa_flash", s, 64, "bfloat16", 1e9 * s / 64) for s in (64, 4096)],
                   collectives=[CollectiveFit("all_reduce", 2, 1e-4, 1e9)],
                   router=CollectiveFit("send", 2, 2e-4, 2e9), **kw)


def test_profile_json_round_trip_and_a_clear_error(tmp_path: Any) -> None:
    p = _profile()
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "gemm_table": []}))
    with pytest.raises(ValueError, match=r"bad.json: not a dhp device profile.*dhp plan calibrate"):
        Profile.load(tmp_path / "bad.json")


def test_calibrated_costs_interpolate_and_scale_by_group_size() -> None:
    p = _profile()
    # a measured shape: its own rate, exactly; between shapes: between their rates
    assert p.gemm_s(512, 128, 128, "bfloat16") == pytest.approx(2 * 512 * 128 * 128 / 8e9)
    mid = 2 * 200 * 128 * 128 / p.gemm_s(200, 128, 128, "bfloat16")
    assert 1e9 < mid < 8e9
    # alpha-beta per call; 4 ranks from the 2-rank fit: latency x (n-1), bandwidth by the ring's factors
    assert p.collective_s("all_reduce", 2, 1e6, 3) == pytest.approx(3e-4 + 1e6 / 1e9)
    assert p.collective_s("all_reduce", 4, 1e6, 1) == pytest.approx(3 * 1e-4 + 1e6 * (1.5 / 1.0) / 1e9)
    assert p.router_s(1e6, 2) == pytest.approx(4e-4 + 1e6 / 2e9)
    # the ray data plane's transfers take the object store's fit where there is one
    store = replace(p, object_store=CollectiveFit("object_store", 2, 3e-3, 1e8))
    assert store.router_s(1e6, 2, "ray") == pytest.approx(6e-3 + 1e6 / 1e8)
    assert store.router_s(1e6, 2, "p2p") == p.router_s(1e6, 2) == p.router_s(1e6, 2, "ray")
    # DTensor's dispatch is host work on top of the local ops'
    dt = replace(p, dtensor_op_s=5e-5)
    one = GroupResult(ops=[{"ops": 10, "dtensor_ops": 4}])
    assert group_cost(GroupJob("text"), one, dt, samples=1).host_mb == pytest.approx(10 * 1e-5 + 4 * 5e-5)
    # host and device add up on a CPU (no async launch); a region's device time is max'ed with its host's on GPU
    job = GroupJob("text", inner=2, inner_kind="tp")
    r = GroupResult(ops=[{"mem_bytes": 1e8, "ops": 1000}, {"mem_bytes": 1e6, "ops": 1000}])
    cpu = group_cost(job, r, p, samples=1)
    assert cpu.compute_mb == pytest.approx(1e8 / 1e10 + 1e6 / 1e10 + 2000 * 1e-5 + 1e-4)
    gpu = group_cost(job, r, _profile_async(), samples=1)
    assert gpu.compute_mb == pytest.approx(max(1e8 / 1e10, 1000 * 1e-5 + 1e-4) + max(1e6 / 1e10, 1000 * 1e-5))


def _profile_async() -> Profile:
    p = _profile()
    p.async_launch = True
    return p


def test_the_tally_counts_the_ranks_flops_exactly() -> None:
    """Every FLOP the FLOP counter sees is in the tally, as a matmul shape or attention work, and ops/bytes; the
    run's FLOPs (the tally's, ``tally_flops``) equal the counter's, on a vision SP 2 and a text TP 2 rank."""
    from dhp.models.qwen2_5_vl.config import tiny

    r = measure(GroupJob("vision", inner=2, inner_kind="sp", media=media_of({"vision": 256}), text_tokens=0,
                         device="cpu"), tiny(), flop_counter=True)
    tally = merged(r.ops)
    gemm = sum(2 * math.prod(int(x) for x in k.split("|")[1:4]) * v for k, v in tally.items() if k.startswith("gemm"))
    attn = sum(v for k, v in tally.items() if k.startswith("attn|sdpa_flash"))
    assert attn > 0 and gemm + attn == r.counted_flops == r.flops
    t = measure(GroupJob("text", inner=2, inner_kind="tp", media=media_of({"vision": 64}), text_tokens=96,
                         device="cpu"), tiny(), flop_counter=True)
    assert t.flops == t.counted_flops > 0
    assert tally["ops"] > 100 and tally["mem_bytes"] > 0
    assert merged(r.step_ops)["mem_bytes"] >= 2 * r.optimizer  # AdamW reads and writes its state


def test_a_device_per_group_prices_each_group_on_its_own() -> None:
    """``--device vision=l40s,text=h100``: the vision group on L40S, the text group on H100, the router over the
    link between the pools; only disaggregated layouts."""
    from dhp.models.registry import get_family
    from dhp.plan.command import pricing_of
    from dhp.plan.planner import Row, evaluate

    family = get_family("qwen2_5_vl")
    args = SimpleNamespace(device="vision=l40s,text=h100", profile=None, peak_tflops=None, pool_link_gbs=25.0)
    dev, pricing, devices = pricing_of(args, family)
    assert dev.name.startswith("H100") and set(devices) == {"vision", "text"}
    assert pricing.of("vision").name.startswith("L40S") and pricing.of("text").name.startswith("H100")
    res = _result()
    jobs = {"vision": GroupJob("vision", dp=2), "text": GroupJob("text", dp=1, inner=2, inner_kind="tp")}
    row = evaluate(Row("dhp-disaggregated", {"vision": 1}, False, jobs, placement="disaggregated",
                       tokens_per_sample=100), {j: res for j in jobs.values()}, dev, 4, 80.0, 0, family,
                   pricing=pricing)
    l40s, h100 = roofline(get_device("l40s")), roofline(get_device("h100"))
    assert row.groups["vision"]["compute_s"] == pytest.approx(2 * group_cost(jobs["vision"], res, l40s, 4).compute_mb)
    assert row.groups["text"]["compute_s"] == pytest.approx(4 * group_cost(jobs["text"], res, h100, 4).compute_mb)
    assert row.groups["vision"]["router_s"] == pytest.approx(2 * 2**20 / 25e9)  # 2 micro-batches, 2 MiB each way
    assert row.groups["vision"]["limit_gb"] == 48.0 and row.groups["text"]["limit_gb"] == 80.0
    assert "L40S" in row.pricing and "link between pools 25 GB/s" in row.pricing


def test_calibrate_on_cpu_writes_a_profile_that_plan_reads(tmp_path: Any, capsys: Any, monkeypatch: Any) -> None:
    """``dhp plan calibrate --quick`` on this machine, then ``dhp plan --profile`` prices a tiny plan with it (Ray's
    costs left out here: the bench test, which has a Ray running, calibrates them). It also keeps the profile as
    this machine's (``$DHP_CACHE/profiles/cpu.json``), which ``dhp bench`` predicts with when given no
    ``--profile`` (``--no-profile``: none)."""
    import argparse

    from dhp.cli import bench_profile, main
    from dhp.plan.profile import machine_profile

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    args = argparse.Namespace(profile=None, no_profile=False)
    assert machine_profile("cpu") is None and bench_profile(args, None, ["train.device=cpu"]) is None
    out = tmp_path / "profiles" / "cpu.json"  # a folder made for it
    assert main(["plan", "calibrate", "--on", "cpu", "--quick", "--no-runtime", "--out", str(out)]) == 0
    assert "as this machine's cpu profile" in capsys.readouterr().out
    mine = tmp_path / "cache" / "profiles" / "cpu.json"
    assert machine_profile("cpu") == mine and mine.read_text() == out.read_text()
    assert bench_profile(args, None, ["train.device=cpu"]) == str(mine)
    assert bench_profile(argparse.Namespace(profile=None, no_profile=True), None, []) is None
    assert bench_profile(argparse.Namespace(profile="x.json", no_profile=False), None, []) == "x.json"
    assert bench_profile(args, None, ["train.device=cuda"]) is None  # no cuda profile kept
    p = Profile.load(out)
    assert p.source == "calibrated" and p.device_type == "cpu" and not p.async_launch
    assert p.gemm and p.attention and all(g.flops_per_s > 0 for g in p.gemm)
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    assert {(f.kind, f.path) for f in p.collectives} == {
        *((k, path) for k in kinds for path in (C10D, FUNCTIONAL)), ("broadcast", C10D), ("all_reduce", BURST),
        ("broadcast", BURST)}
    assert all(f.alpha_s >= 0 and f.beta_bytes_per_s > 0 for f in p.collectives) and p.router is not None
    assert p.cpu_op_s > 0 and p.hbm_bytes_per_s > 0 and p.dtensor_op_s > 0 and p.busy_slowdown >= 1.0
    assert p.fsdp_call_s >= 0 and p.tp_call_s >= 0  # (in-situ residuals: tests/unit/test_plan_accuracy.py)
    assert p.actor_call_s == 0 and p.busy_call_s == 0 and p.object_store is None
    capsys.readouterr()
    assert main(["plan", "tiny", "--gpus", "2", "--vision-tokens", "1024", "--text-tokens", "256", "--strategies",
                 "zero3", "--profile", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "priced by calibrated cpu" in printed and "fastest that fits: zero3" in printed
    assert "[CPU PROFILE: the times are this CPU's, the memory limit the GPU's" in printed  # a GPU plan, CPU times
    assert "ROOFLINE" not in printed


def test_published_setting_is_the_published_experiment() -> None:
    """``--published``: 8 GPUs, 512 text tokens, 1k-65k vision tokens, pure bf16, uniform TP against vision SP 8
    + text TP 8 only (the candidates kept), collocated."""
    from dhp.plan.command import PUBLISHED_VISION, model_config, published
    from dhp.plan.planner import candidate_rows

    family, cfg = model_config("32b")
    args = SimpleNamespace(gpus=2, text_tokens=4096, vision_tokens="16384")
    points, strategies, precision, keep = published(args, family)
    assert args.gpus == 8 and args.text_tokens == 512 and precision == "bf16"
    assert [p["vision"] for p in points] == [int(x) for x in PUBLISHED_VISION.split(",")]
    rows = [r for r in candidate_rows(cfg, 8, points[:1], 512, 1, strategies, precision=precision, family=family)
            if keep(r)]
    dhp = [r for r in rows if r.strategy == "dhp-collocated"]
    assert dhp and all(r.jobs["vision"].inner_kind == "sp" and r.jobs["vision"].inner == 8
                       and r.jobs["text"].inner == 8 and r.placement == "collocated" for r in dhp)
    assert {r.strategy for r in rows} == {"dhp-collocated", "uniform-tp"}
    assert all(j.precision == "bf16" for r in rows for j in r.jobs.values())
