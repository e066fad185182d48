"""Model FLOPs: the Qwen2.5-VL closed forms equal FlopCounterMode on the meta device (tiny and 7B presets)."""

from __future__ import annotations

import pytest

from dhp.models.qwen2_5_vl import flops as qf
from dhp.models.qwen2_5_vl.config import preset
from dhp.models.registry import get_family
from dhp.models.spec import SampleInfo
from dhp.observe.flops import cpu_matmul_peak, device_peak, mfu, sample_flops

# images with edge windows (sides not multiples of the window), two frames, a small one
GRIDS = [(1, 16, 20), (2, 12, 12), (1, 8, 8)]
SEGMENTS = [100, 37, 250]  # a packed micro-batch of three samples


@pytest.mark.parametrize("name", ["tiny", "7b"])
def test_vision_closed_form_equals_flop_counter(name):
    cfg = preset(name)
    assert qf.count_vision(cfg, GRIDS) == qf.vision_flops(GRIDS, cfg.vision)
    assert qf.count_vision(cfg, GRIDS[:1]) == qf.vision_flops(GRIDS[:1], cfg.vision)


@pytest.mark.parametrize("name", ["tiny", "7b"])
def test_text_closed_form_equals_flop_counter(name):
    cfg = preset(name)
    assert qf.count_text(cfg, SEGMENTS) == qf.text_flops(SEGMENTS, cfg.text)
    fwd, bwd = qf.text_flops(SEGMENTS, cfg.text)
    assert bwd == 2 * fwd


def test_7b_text_is_about_six_n_per_token():
    """Sanity against the usual 6 * parameters * tokens (short sequences: attention is small)."""
    cfg = preset("7b").text
    fwd, bwd = qf.text_flops([512], cfg)
    n = (cfg.num_hidden_layers * (cfg.hidden_size * (cfg.hidden_size + 2 * 512 + cfg.hidden_size)
                                  + 3 * cfg.hidden_size * cfg.intermediate_size)
         + cfg.hidden_size * cfg.vocab_size)  # matmul weights (embedding lookups do no matmul)
    assert (fwd + bwd) / (6 * n * 512) == pytest.approx(1.0, abs=0.05)


def test_sample_flops_per_module_and_frozen_encoder():
    family, cfg = get_family("qwen2_5_vl"), preset("tiny")
    infos = [SampleInfo(0, 40, ((1, 8, 8),)), SampleInfo(1, 12, ())]
    out = sample_flops(family, cfg, infos, {"vision": True, "text": True})
    assert out["vision"][1] == 0.0 and out["vision"][0] == sum(qf.vision_flops([(1, 8, 8)], cfg.vision))
    assert out["text"][0] == sum(qf.text_flops([40], cfg.text))
    frozen = sample_flops(family, cfg, infos, {"vision": False, "text": True})
    assert frozen["vision"][0] == qf.vision_flops([(1, 8, 8)], cfg.vision)[0]  # forward only


def test_mfu_and_peaks():
    assert mfu(1e12, 2.0, 2, 1e12) == 0.25
    assert device_peak("NVIDIA H200").flops == 989e12
    assert device_peak("NVIDIA H200", peak_tflops=500).flops == 500e12
    assert device_peak("Some Unknown GPU") is None
    assert cpu_matmul_peak(1, seconds=0.2, n=128) > 1e8  # any CPU does > 0.1 GFLOP/s
