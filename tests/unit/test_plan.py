"""``dhp plan``: the fake run of one rank against the same tracker on real gloo ranks, closed forms of the
static bytes and of the vision all-to-all, and the ``--json`` schema (see ``docs/plan.md``)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch

from dhp.models.qwen2_5_vl.config import preset, tiny
from dhp.models.qwen2_5_vl.synthetic import image_grid
from dhp.plan.measure import GroupJob, measure, media_of
from tests.spawn import run_distributed

TINY = dict(media=media_of({"vision": 1024}), text_tokens=256, device="cpu")


def tiny_cfg() -> Any:
    """The tiny preset with its placeholder ids inside its vocabulary (a real run looks them up)."""
    return tiny(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)


LAYOUTS = {  # two ranks each: the group's layout as the planner writes it
    "vision-sp2": GroupJob("vision", inner=2, inner_kind="sp", **TINY),
    "text-tp2": GroupJob("text", inner=2, inner_kind="tp", **TINY),
    "vision-tp2": GroupJob("vision", inner=2, inner_kind="tp", **TINY),
    "text-fsdp2": GroupJob("text", dp=2, zero=3, **TINY),
}


def _real_worker(rank: int, world_size: int, jobs: dict[str, GroupJob]) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    return {k: measure(j, tiny_cfg(), fake=False).to_dict() for k, j in jobs.items()}


@pytest.fixture(scope="module")
def real() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_real_worker, 2, LAYOUTS, timeout_s=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fake_prediction_matches_real_gloo_run(real: list[dict[str, dict[str, Any]]], layout: str) -> None:
    """The fake run's per-rank peak is within 10 % of the same tracker on real tensors and real gloo ranks."""
    pred = measure(LAYOUTS[layout], tiny_cfg())
    for r in real:
        got = r[layout]
        assert pred.peak == pytest.approx(got["peak"], rel=0.10), (layout, pred.peak, got["peak"])
        assert pred.weights == got["weights"] and pred.optimizer == got["optimizer"]
    assert pred.grads == real[0][layout]["grads"]


def test_first_run_in_a_process_equals_later_ones() -> None:
    """DTensor's sharding propagation (cached per op schema) runs ops on global-shape fake tensors; those
    are not the rank's memory, so a run does not depend on what ran before it."""
    cfg = tiny_cfg()
    cfg = replace(cfg, text=replace(cfg.text, vocab_size=4096))  # a fresh op schema: the cache is cold
    job = GroupJob("text", inner=2, inner_kind="tp", **TINY)
    a, b = measure(job, cfg), measure(job, cfg)
    assert a.peak == b.peak and a.breakdown == b.breakdown


def test_a_run_after_its_layouts_other_runs_equals_its_first() -> None:
    """``measure_all`` runs a layout's jobs (every media size, checkpointing on and off) in one process, one
    after another (``planner.bundles``), where the fake tensors' and DTensor's caches hold the layout's shapes:
    a run there gives every figure the same run gives first in a process."""
    from dhp.plan.measure import family_of
    from dhp.plan.planner import bundles

    cfg = tiny_cfg()
    cfg = replace(cfg, text=replace(cfg.text, vocab_size=4104))  # a fresh op schema: the caches are cold
    job = GroupJob("text", inner=2, inner_kind="tp", **TINY)
    others = [replace(job, media=media_of({"vision": 256})), replace(job, activation_checkpointing=True)]
    vision = GroupJob("vision", **TINY)
    assert bundles([vision, job, *others], family_of()) == [[job, *others], [vision]]
    first = measure(job, cfg).to_dict()
    for j in others:
        measure(j, cfg)
    assert measure(job, cfg).to_dict() == first


# ---- closed forms of weights, gradients and optimizer state (docs/memory.md, "Bytes per parameter") ----------


def _text_params(c: Any) -> tuple[int, int]:
    """(parameters a TP plan shards, replicated ones) of the 32B language model."""
    h, kvd, i = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads), c.intermediate_size
    layer = (h * h + h) + 2 * (h * kvd + kvd) + h * h + 3 * h * i
    sharded = c.num_hidden_layers * layer + 2 * c.vocab_size * h
    return sharded, c.num_hidden_layers * 2 * h + h


def test_static_bytes_equal_closed_form_tp8_and_fsdp8_32b() -> None:
    cfg = preset("32b")  # the whole model: 64 layers, built and stepped (no forward) in a few seconds
    sharded, repl = _text_params(cfg.text)
    tp = measure(GroupJob("text", inner=8, inner_kind="tp", static=True), cfg)
    rotary = 4 * (cfg.text.hidden_size // cfg.text.num_attention_heads // 2)  # the inv_freq buffer
    assert tp.grads == 4 * (sharded // 8 + repl)  # 4 / t (fp32 gradients of fp32 parameters)
    assert tp.weights == tp.grads + rotary  # 4 / t, and the buffers
    assert tp.optimizer == 2 * tp.grads  # AdamW exp_avg + exp_avg_sq, zero 0: 8 / t
    fs = measure(GroupJob("text", dp=8, zero=3, static=True), cfg)
    total = sharded + repl
    for got, per_param in ((fs.weights - rotary, 4), (fs.grads, 4), (fs.optimizer, 8)):
        assert got == pytest.approx(per_param * total / 8, rel=1e-4)  # 16 / d in all (dim-0 padding aside)


# ---- the vision all-to-all ----------------------------------------------------------------------------------


def test_sp_alltoall_equals_closed_form_and_moves_less_than_tp() -> None:
    from dhp.models.qwen2_5_vl.sequence_parallel import shard_vision
    from dhp.models.qwen2_5_vl.vision import vision_layout
    from dhp.parallel.ulysses import expected_alltoall_bytes

    cfg = preset("32b")  # real width (1280, 16 heads), one period of the window pattern
    v = replace(cfg.vision, depth=8, fullatt_block_indexes=(7,))
    cfg = replace(cfg, vision=v)
    tokens, n = 4096, 4
    sp = measure(GroupJob("vision", inner=n, inner_kind="sp", media=media_of({"vision": tokens}), device="cpu"), cfg)
    grid = torch.tensor([image_grid(tokens)])
    sizes = shard_vision(vision_layout(grid, v), n)[0].split_sizes
    elem = 2  # q, k, v and the output in bfloat16 under autocast
    want = expected_alltoall_bytes(sizes, 0, v.num_heads, v.head_dim, elem, len(v.fullatt_block_indexes),
                                   backward=True)
    assert sp.comm_sent == {"all_to_all": want}
    tp = measure(GroupJob("vision", inner=n, inner_kind="tp", media=media_of({"vision": tokens}), device="cpu"), cfg)
    tp_sent = tp.comm.get("all_reduce", 0) * 2 * (n - 1) / n  # ring all-reduce: what a rank sends
    assert sp.comm_sent["all_to_all"] < tp_sent / 4


# ---- the --json schema --------------------------------------------------------------------------------------


def test_json_schema(tmp_path: Any, capsys: Any) -> None:
    from dhp.cli import main

    out = tmp_path / "plan.json"
    main(["plan", "tiny", "--gpus", "2", "--vision-tokens", "1024", "--text-tokens", "256",
          "--strategies", "dhp-collocated,uniform-tp", "--json", str(out), "--plot", str(tmp_path / "plan.png")])
    assert "fastest that fits" in capsys.readouterr().out
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # memory and the time breakdown
    assert (tmp_path / "plan.png").stat().st_size > 20000
    doc = json.loads(out.read_text())
    assert set(doc) == {"model", "family", "gpus", "gpu_memory_gb", "pricing", "rows", "recommended"}
    assert doc["pricing"].startswith("roofline")  # no --profile: the device table's roofline, said so
    assert doc["model"] == "tiny" and doc["family"] == "qwen2_5_vl" and doc["gpus"] == 2
    assert isinstance(doc["gpu_memory_gb"], float)
    assert {r["strategy"] for r in doc["rows"]} == {"dhp-collocated", "uniform-tp"}
    for row in [*doc["rows"], doc["recommended"]]:
        assert set(row) == {"strategy", "overrides", "media_tokens", "fits", "step_time_s", "tokens_per_s",
                            "critical_path", "pricing", "groups"}
        assert all(isinstance(o, str) and "=" in o for o in row["overrides"])
        assert row["media_tokens"] == {"vision": 1024} and isinstance(row["fits"], bool)
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
        assert set(row["groups"]) == {"vision", "text"}
        for g in row["groups"].values():
            assert set(g) == {"ranks", "peak_gb", "weights_gb", "grads_gb", "optimizer_gb", "activations_gb",
                              "limit_gb", "compute_s", "device_s", "host_s", "comm_exposed_s", "comm_hidden_s",
                              "router_s", "optimizer_s", "busy_s", "idle_s", "data_wait_s", "loader_s"}
            assert g["data_wait_s"] == g["loader_s"] == 0.0  # no data set: loading not priced
            assert isinstance(g["ranks"], int) and g["peak_gb"] >= g["weights_gb"] > 0
            assert 0 < g["compute_s"] <= g["busy_s"] <= row["step_time_s"] + 1e-12
            assert g["busy_s"] + g["idle_s"] == pytest.approx(row["step_time_s"])


def test_a_progress_line_per_distinct_fake_run(capsys: Any) -> None:
    """`dhp plan` says on stderr, as each distinct fake run finishes, which it was and how long it took: one
    line per ``canonical`` stand-in, numbered 1..n; the table stays on stdout."""
    import re

    from dhp.cli import main
    from dhp.plan.command import job_label, model_config
    from dhp.plan.planner import candidate_rows, canonical

    strategies = ("dhp-collocated", "uniform-tp")
    main(["plan", "tiny", "--gpus", "2", "--vision-tokens", "1024", "--text-tokens", "256",
          "--strategies", ",".join(strategies)])
    out, err = capsys.readouterr()
    lines = [m.groups() for m in re.finditer(r"^dhp: plan: \[(\d+)/(\d+)\] (.+): \d+ s$", err, re.M)]
    family, cfg = model_config("tiny")
    rows = candidate_rows(cfg, 2, [{"vision": 1024}], 256, 1, strategies, family=family)
    runs = {canonical(j, family) for r in rows for j in r.jobs.values()}
    assert [(int(i), int(n)) for i, n, _ in lines] == [(i, len(runs)) for i in range(1, len(runs) + 1)]
    assert sorted(label for *_, label in lines) == sorted(job_label(j) for j in runs)
    assert "fastest that fits" in out and "dhp: plan: [" not in out


def test_tp_text_gradients_are_sharded_like_the_weights() -> None:
    """Under TP every gradient is as large as its parameter's shard, embed_tokens' included: its lookup runs on
    the local vocabulary shard (``VocabParallelEmbedding``), not through DTensor, whose embedding backward has
    no ``Shard(0)`` strategy and kept the whole [V, D] gradient on every rank."""
    cfg = tiny_cfg()
    r = measure(GroupJob("text", inner=2, inner_kind="tp", **TINY), cfg)
    rotary = 4 * (cfg.text.hidden_size // cfg.text.num_attention_heads // 2)
    assert r.grads == r.weights - rotary


def test_flops_are_the_ranks_own() -> None:
    """A TP rank computes 1/t of the text model's FLOPs and an SP rank 1/sp of the encoder's: counted on the
    local ops, not at a DTensor's global shapes nor in DTensor's sharding propagation."""
    cfg = tiny_cfg()
    whole = {m: measure(GroupJob(m, **TINY), cfg).flops for m in ("text", "vision")}
    assert measure(GroupJob("text", inner=2, inner_kind="tp", **TINY), cfg).flops == whole["text"] / 2
    assert measure(GroupJob("vision", inner=2, inner_kind="sp", **TINY), cfg).flops == whole["vision"] / 2


def test_text_tp_rows_use_megatron_sequence_parallelism() -> None:
    """Every text TP job of every strategy runs with Megatron SP (dhp's and the uniform-TP baseline's alike),
    and its overrides say so; under it a TP 2 rank holds less at its peak than without, and all-gathers and
    reduce-scatters where it all-reduced, for the same FLOPs."""
    from dhp.plan.planner import candidate_rows

    rows = candidate_rows(tiny_cfg(), 4, [1024], 256, 1, device="cpu")
    texts = [r for r in rows if r.jobs["text"].inner_kind == "tp"]
    assert {r.strategy for r in texts} >= {"uniform-tp", "dhp-collocated"}
    for r in texts:
        assert r.jobs["text"].sequence_parallel and "text.parallel.sequence_parallel=true" in r.overrides()
    job = GroupJob("text", inner=2, inner_kind="tp", **TINY)
    plain, sp = measure(job, tiny_cfg()), measure(replace(job, sequence_parallel=True), tiny_cfg())
    assert sp.peak < plain.peak, (sp.peak, plain.peak)
    assert sp.comm.get("all_gather", 0) > 0 and sp.comm.get("reduce_scatter", 0) > 0
    assert sp.comm.get("all_reduce", 0) < plain.comm["all_reduce"]
    assert sp.flops == pytest.approx(plain.flops, rel=0.02)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # float32 weights under autocast; FSDP2's bf16 copies
def test_chunked_loss_lowers_the_text_peak_and_recomputes_the_head_once(device: str) -> None:
    """``train.loss_chunk_tokens``: the planner measures the trainer's chunked cross entropy. Its peak is lower
    by at least a float32 [N, V] tensor (the float32 logits), and it counts the head's forward once more
    (recomputed in the backward): 2 N D V FLOPs, N the micro-batch's supervised rows (the engine's head runs on
    those only: ``PackedMeta.label_rows``; here every text token, the placeholders not)."""
    cfg = tiny_cfg()
    d, v = cfg.text.hidden_size, cfg.text.vocab_size
    job = GroupJob("text", dp=2, zero=3, media=media_of({"vision": 256}), text_tokens=1024, device=device)
    whole = measure(replace(job, loss_chunk_tokens=0), cfg)
    chunked = measure(replace(job, loss_chunk_tokens=64), cfg)
    extra = chunked.flops - whole.flops
    assert extra > 0 and extra % (2 * d * v) == 0
    n = 1024  # the supervised rows: the text tokens (the 256 // 4 merged image placeholders are not)
    assert extra == 2 * n * d * v
    assert whole.peak - chunked.peak >= n * v * 4, (whole.peak, chunked.peak)  # a float32 [N, V] at least
    assert chunked.weights == whole.weights and chunked.grads == whole.grads


@pytest.mark.parametrize("argv, message", [
    (["tiny", "--gpus", "0"], "--gpus 0: give 1 or more"),
    (["tiny", "--gpus", "2", "--micro-batch-size", "0"], "--micro-batch-size 0: give 1 or more"),
    (["tiny", "--gpus", "2", "--text-tokens", "-5"], "--text-tokens -5: give 0 or more"),
    (["tiny", "--gpus", "2", "--gpu-memory-gb", "0"], "--gpu-memory-gb 0: give a number above 0"),
    (["tiny", "--gpus", "2", "--vision-tokens", "1k"], "--vision-tokens: give positive sizes"),
    (["tiny", "--gpus", "2", "--strategies", "zero3,tp8"], "tp8: choose among dhp-collocated"),
    (["calibrate", "--on", "cpu", "--threads", "0"], "--threads 0: give 1 or more"),
    (["calibrate", "--on", "cpu", "--out", "/"], "--out /: a directory; give the profile's file name"),
    (["calibrate", "--on", "cpu", "--out", "/proc/no/p.json"], "--out /proc/no/p.json: cannot write the profile"),
    (["tiny", "--gpus", "2", "--json", "/proc/no/p.json"], "--json /proc/no/p.json: cannot write the JSON there"),
    (["tiny", "--gpus", "2", "--plot", "/"], "--plot /: a directory; give the PNG's file name"),
])
def test_bad_numbers_and_names_are_usage_errors_naming_the_flag(argv: list[str], message: str, capsys: Any) -> None:
    """Exit 2 and a line naming the flag, before any fake run (they used to fail inside one as "unexpected
    error", or, for an unknown strategy, plan nothing and print "no layout fits" with exit 0)."""
    from dhp.cli import main

    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_tables_times_are_fixed_notation_in_one_unit() -> None:
    """A tiny model's plan printed its times as 0.00 s and 1.05e-05: now milliseconds where every step is under a
    second, three significant digits, never scientific notation."""
    from types import SimpleNamespace

    from dhp.plan.command import figure, time_unit

    assert [figure(x) for x in (0, 1.05e-05, 0.00341, 0.31, 3.41, 12.345, 5255.8)] == [
        "0", "0.0000", "0.0034", "0.310", "3.41", "12.3", "5256"]
    assert time_unit([SimpleNamespace(step_time_s=0.004), SimpleNamespace(step_time_s=0.9)]) == ("ms", 1e3)
    assert time_unit([SimpleNamespace(step_time_s=0.004), SimpleNamespace(step_time_s=12.0)]) == ("s", 1.0)
