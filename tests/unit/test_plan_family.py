"""``dhp plan`` plans any family through its interface (``docs/plan.md``): Qwen2.5-Omni's three groups, the
toy third family of the tests (registered from the tests alone, no change to generic code), the families'
synthetic samples, the router bytes from the real payload and the encoder's output width, and the audio
encoder's depth extrapolation."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from dhp.cli import main
from dhp.models.registry import get_family
from dhp.plan.measure import GroupJob, measure, measure_model, media_of, synthetic_samples

FAST = ["--text-tokens", "64", "--micro-batch-size", "1"]


def omni() -> tuple[Any, Any]:
    family = get_family("qwen2_5_omni")
    return family, family.preset_config("omni-tiny")


def _groups(doc: dict) -> set[str]:
    return {g for r in doc["rows"] for g in r["groups"]}


# ---- the families' synthetic samples ------------------------------------------------------------------------


def test_synthetic_samples_have_the_placeholders_their_media_give() -> None:
    """An image of N patches fills N/4 merged placeholders; an audio clip of F mel frames the tokens of the
    stride-2 conv and pool; media tensors come out fake (no memory), host metadata real."""
    from torch._subclasses.fake_tensor import is_fake

    from dhp.models.qwen2_5_omni.processor import audio_tokens

    family, cfg = omni()
    job = GroupJob("text", media=media_of({"vision": 1024, "audio": 400}), text_tokens=64)
    (s,) = synthetic_samples(job, cfg, family)
    vision, audio = family.module("vision"), family.module("audio")
    assert vision.num_placeholders(s, cfg) == 1024 // 4 and audio.num_placeholders(s, cfg) == audio_tokens(400)
    assert s.num_tokens == 64 + 256 + audio_tokens(400)
    assert tuple(s.pixel_values.shape) == (1024, cfg.vision.patch_dim) and is_fake(s.pixel_values)
    assert tuple(s.audio_features.shape) == (cfg.audio.num_mel_bins, 400) and is_fake(s.audio_features)
    assert not is_fake(s.input_ids) and s.audio_feature_lens.tolist() == [400]
    assert int((s.labels != -100).sum()) == 64  # the text is supervised, the placeholders are not


# ---- router bytes: the payload dtype and the encoder's output width ---------------------------------------------


def test_router_bytes_follow_the_compute_dtype_and_the_encoders_width() -> None:
    """The language model's router bytes: every encoder's embeddings in and their gradients out, rows x the
    width of the encoder's output (read from its encode, not a config field) x the compute dtype's size
    (bfloat16 by default; float32 doubles them). An encoder's SP rank moves its own rows."""
    family, cfg = omni()
    media = media_of({"vision": 256, "audio": 400})
    text = measure(GroupJob("text", media=media, text_tokens=64, device="cpu"), cfg, family)
    (s,) = synthetic_samples(GroupJob("text", media=media, text_tokens=64), cfg, family)
    rows = sum(e.num_placeholders(s, cfg) for e in family.encoders)
    width = cfg.text.hidden_size  # what both encoders project to
    assert text.router == 2 * rows * width * 2
    wide = measure(GroupJob("text", media=media, text_tokens=64, device="cpu", dtype="float32"), cfg, family)
    assert wide.router == 2 * text.router
    audio = measure(GroupJob("audio", inner=2, inner_kind="sp", media=media, device="cpu"), cfg, family)
    whole = measure(GroupJob("audio", media=media, device="cpu"), cfg, family)
    assert whole.router == 2 * family.module("audio").num_placeholders(s, cfg) * width * 2
    assert 0 < audio.router < whole.router  # this rank's chunks only


# ---- depth: the audio encoder extended along its layers ---------------------------------------------------------


def test_audio_depth_extrapolation_matches_whole_encoder() -> None:
    """Two shallow audio encoders (8 and 16 layers) extended to 32 give the 32-layer encoder's figures exactly."""
    family, cfg = omni()
    cfg = replace(cfg, audio=replace(cfg.audio, encoder_layers=32))
    job = GroupJob("audio", inner=2, inner_kind="sp", media=media_of({"audio": 800}), device="cpu")
    ext, whole = measure_model(job, cfg, family), measure(job, cfg, family)
    assert ext.flops == pytest.approx(whole.flops, rel=1e-12)
    assert (ext.weights, ext.grads, ext.optimizer, ext.peak) == (whole.weights, whole.grads, whole.optimizer,
                                                                 whole.peak)


# ---- dhp plan on Qwen2.5-Omni and on the toy third family -------------------------------------------------------


def test_plan_omni_has_vision_audio_and_text_groups(tmp_path: Any, capsys: Any) -> None:
    """``dhp plan omni-tiny`` (the path of ``dhp plan omni-7b --gpus 8``): every row has the three groups, the
    audio size as given, and an override line for each group."""
    out = tmp_path / "plan.json"
    assert main(["plan", "omni-tiny", "--gpus", "3", "--vision-tokens", "256", "--audio-tokens", "400", *FAST,
                 "--strategies", "dhp-disaggregated", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "audio tok" in printed and "audio GB" in printed and "fastest that fits" in printed
    doc = json.loads(out.read_text())
    assert doc["family"] == "qwen2_5_omni" and _groups(doc) == {"vision", "audio", "text"}
    for row in doc["rows"]:
        assert row["media_tokens"] == {"vision": 256, "audio": 400}
        assert {g["ranks"] for g in row["groups"].values()} == {1}  # one GPU each of the three
        assert "audio.parallel.dp=1" in row["overrides"] and "runtime.placement=disaggregated" in row["overrides"]


def test_toy_third_family_is_planned_with_three_groups(tmp_path: Any) -> None:
    """The toy family of the tests (Qwen2.5-VL plus a data-parallel toy audio encoder), named by
    ``--family module:ATTR`` as a user's plugin is: three groups, its audio encoder never given SP (it has
    none), the placeholders of both encoders in the language model's sequence."""
    out = tmp_path / "plan.json"
    assert main(["plan", "tiny", "--family", "tests.toy_audio:TOY_FAMILY", "--gpus", "2",
                 "--vision-tokens", "256",
                 "--audio-tokens", "32", *FAST, "--strategies", "dhp-collocated,uniform-tp", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["family"] == "toy_qwen_audio" and _groups(doc) == {"vision", "audio", "text"}
    assert {r["strategy"] for r in doc["rows"]} == {"dhp-collocated", "uniform-tp"}
    for row in doc["rows"]:
        assert row["fits"] and row["tokens_per_s"] > 0
        assert "audio.parallel.sp=1" in row["overrides"] and "audio.parallel.tp=1" in row["overrides"]
        assert "audio.parallel.dp=2" in row["overrides"]  # data parallel over both GPUs
        assert row["groups"]["audio"]["peak_gb"] > row["groups"]["audio"]["weights_gb"] > 0


def test_an_encoder_without_media_in_the_sample_runs_no_micro_batch() -> None:
    """A group whose encoder has no media in the sample is what the engine runs for it: no forward, its
    gradients zeros, its optimizer step (the static run's figures)."""
    family, cfg = omni()
    job = GroupJob("audio", media=media_of({"vision": 256}), device="cpu")
    idle, static = measure(job, cfg, family), measure(replace(job, static=True), cfg, family)
    assert (idle.flops, idle.router, idle.peak, idle.grads) == (0.0, 0, static.peak, static.grads)
    assert idle.grads > 0


def test_plan_refuses_an_encoder_without_a_size_option() -> None:
    from dhp.errors import UsageError
    from dhp.plan.command import media_points

    class Args:
        vision_tokens = "256"

    with pytest.raises(UsageError, match="the audio encoder of qwen2_5_omni has no --audio-tokens option"):
        media_points(get_family("qwen2_5_omni"), Args())
    assert media_points(get_family("qwen2_5_vl"), Args()) == [{"vision": 256}]
