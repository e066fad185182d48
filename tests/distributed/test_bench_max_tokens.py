"""`dhp bench --max-vision-tokens` on CPU, tiny model, a 64 MiB per-worker budget: the largest image each layout
trains, checked against fresh real-gloo measurements of the same step; Ulysses SP trains a longer vision sequence
than data parallelism under the same budget; the flags' errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dhp.bench import default_layouts, layout_config, layout_jobs, media_per_token
from dhp.cli import main
from dhp.inputs import resolve_inputs
from dhp.plan.measure import GiB, GroupJob, measure, media_of
from tests.spawn import run_distributed

# One pytest-xdist worker runs the module: its tests share the `searched` bench (minutes of CPU), built once.
pytestmark = pytest.mark.xdist_group("bench_max_tokens")

BUDGET_GB = 0.0625  # 64 MiB: the tiny encoder's step crosses it at a few hundred vision tokens
FLAGS = ["--max-vision-tokens", "--memory-budget-gb", str(BUDGET_GB), "--vision-tokens-start", "256",
         "--vision-tokens-max", "2048"]


def _remeasure(rank: int, world: int, job: GroupJob, model_cfg: Any, sizes: list[int], unit: int) -> list[int]:
    """The group's per-rank tracked peak at each size (vision tokens, ``unit`` patches each), measured afresh on
    real gloo ranks."""
    return [measure(replace(job, media=media_of({"vision": n * unit})), model_cfg, fake=False).peak for n in sizes]


@pytest.fixture(scope="module")
def searched(demo_data, tmp_path_factory) -> tuple[dict, list[str], Path]:
    out = tmp_path_factory.mktemp("maxtok") / "run"
    overrides = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", f"output.dir={out}"]
    rc = main(["bench", *overrides, "--layouts", "dhp,fsdp", "--workers", "4", *FLAGS])
    assert rc == 0
    return json.loads((out / "bench.json").read_text())["max_vision_tokens"], overrides, out


def test_largest_fits_and_next_does_not(searched) -> None:
    doc, overrides, out = searched
    budget = BUDGET_GB * GiB
    assert doc["budget_gb"] == BUDGET_GB and list(doc["layouts"]) == ["dhp", "fsdp"]
    for r in doc["layouts"].values():
        n, failed, step = r["vision_tokens"], r["first_failed"], r["resolution"]
        assert step == 16 and n is not None and failed == n + step  # bisected down to one attention window
        assert r["patches"] == 4 * n and r["budget_gb"] == BUDGET_GB
        assert set(r["groups"]) == {"vision", "text"}
        assert all(0 < g["peak_gb"] <= BUDGET_GB and g["ranks"] == 2 for g in r["groups"].values())
        # the recorded probes: every group fits at the answer, some group does not one step above it
        at = {g: {p["vision_tokens"]: p["peak_gb"] for p in ps} for g, ps in r["probes"].items()}
        assert all(at[g][n] <= BUDGET_GB for g in at)
        assert any(at[g].get(failed, 0) > BUDGET_GB for g in at)
        # the planner's fake run of the same step agrees to within a step; its verdict (one more micro-batch
        # held by the disaggregated encoder) is smaller
        assert abs(r["one_micro_batch"]["vision_tokens"] - n) <= step
        assert 0 < r["planner"]["vision_tokens"] < n
    assert (out / "bench_max_vision_tokens.png").stat().st_size > 1000

    # fresh measurements of the binding (vision) group of the SP layout at the answer and one step above
    cfg = layout_config(None, overrides, default_layouts(4)["dhp"], "dhp", out, 1, 0)
    inputs = resolve_inputs(cfg)
    model_cfg, unit = inputs.model_cfg, media_per_token(inputs.family, inputs.model_cfg)
    assert unit == 4  # Qwen2.5-VL: 2x2 patches per merged token, read off the family's synthetic sample
    r = doc["layouts"]["dhp"]
    peaks = run_distributed(_remeasure, 2, layout_jobs(cfg)["vision"], model_cfg,
                            [r["vision_tokens"], r["first_failed"]], unit, timeout_s=240)
    # a group's peak is its largest rank's (as the bench takes it): the SP ranks' peaks need not be equal
    fits, fails = (max(rank[i] for rank in peaks) for i in range(2))
    assert fits <= budget < fails
    assert fits / GiB == pytest.approx(r["groups"]["vision"]["peak_gb"], rel=0.01)


def test_sp_trains_longer_vision_sequence_than_data_parallel(searched) -> None:
    """Ulysses SP 2 holds half the sequence's activations per rank; FSDP 2 holds the whole image on a rank."""
    layouts = searched[0]["layouts"]
    assert layouts["dhp"]["vision_tokens"] > 1.2 * layouts["fsdp"]["vision_tokens"]


@pytest.mark.parametrize("flags, message", [
    (["--max-vision-tokens", "--memory-budget-gb", "0"], "--memory-budget-gb must be > 0"),
    (["--max-vision-tokens", "--memory-budget-gb", "-1"], "--memory-budget-gb must be > 0"),
    (["--max-vision-tokens"], "--max-vision-tokens needs --memory-budget-gb"),
    (["--max-vision-tokens", "--memory-budget-gb", "1", "--vision-tokens-start", "512", "--vision-tokens-max",
      "256"], "--vision-tokens-start (512) must be <= --vision-tokens-max (256)"),
    (["--max-vision-tokens", "--memory-budget-gb", "1", "--vision-tokens-start", "100"],
     "--vision-tokens-start must be a multiple of 16"),
    (["--memory-budget-gb", "1"], "--memory-budget-gb: only with --max-vision-tokens"),
    (["--max-vision-tokens", "--memory-budget-gb", "100000"], "--memory-budget-gb 100000:"),
])
def test_bad_flags_name_the_flag(demo_data, tmp_path, capsys, flags: list[str], message: str) -> None:
    overrides = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}",
                 f"output.dir={tmp_path / 'run'}"]
    assert main(["bench", *overrides, "--layouts", "dhp", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "bench.json").exists()


@pytest.mark.parametrize("budget", [5, 40, 99, 100, 101, 1000])
def test_cap_first_search_gives_grow_answer(budget: int) -> None:
    """A later group's search probes its cap first: the same largest and first failure as ``grow`` from the start
    (memory growing with the size), one probe when the cap fits, and no size probed twice."""
    from dhp.bench import _grow_from_cap
    from dhp.plan.search import grow

    seen: list[int] = []

    def probe(n: int) -> int:
        seen.append(n)
        return n // 4  # peak bytes grow with the size

    want = grow(lambda n: n // 4, budget, 16, 400, 16)
    got = _grow_from_cap(probe, budget, 16, 400, 16)
    assert (got.largest, got.first_failed) == (want.largest, want.first_failed)
    assert sorted(seen) == sorted({n for n, _ in got.probes}) and len(seen) == len(set(seen))
    assert seen[0] == 400 and all(peak == n // 4 for n, peak in got.probes)
    if budget >= 100:
        assert got.probes == [(400, 100)] and got.first_failed is None
