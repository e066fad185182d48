"""The real presets build on the meta device with the published parameter counts."""

from __future__ import annotations

import pytest
import torch

from dhp.models.qwen2_5_vl import build_model, count_parameters, preset


@pytest.mark.parametrize(
    "name, vision_b, text_b",
    [("3b", 0.669, 3.09), ("7b", 0.676, 7.62), ("32b", 0.684, 32.76), ("72b", 0.700, 72.71)],
)
def test_real_presets_on_meta(name, vision_b, text_b):
    model = build_model(preset(name), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_parameters(model.visual) / 1e9 == pytest.approx(vision_b, rel=0.01)
    assert count_parameters(model.language) / 1e9 == pytest.approx(text_b, rel=0.01)


def test_tiny_is_small_and_runs():
    model = build_model(preset("tiny"), seed=0)
    assert count_parameters(model) < 2_000_000
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, model.cfg.text.vocab_size)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset("huge")
