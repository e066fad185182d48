"""dhp's LoRA against PEFT's on transformers' Qwen2.5-VL (tiny, float32): forward, adapter gradients, targets.

The two models hold the same base weights (``hf_model_like``) and the same adapters (random A and B, copied from
dhp's under PEFT's names through ``peft_tensors``, fused q/k/v and gate/up cut into their parts), so logits and
the gradient of every adapter must agree (the names, transformers' in-memory module paths, are those
``dhp export --adapter`` writes); a wrong scale, a part's B multiplying another part's A, or a
missing part changes both.
"""

from __future__ import annotations

import pytest
import torch

from dhp.models.qwen2_5_vl import build_model
from dhp.models.qwen2_5_vl.weights import WEIGHTS
from dhp.parallel.lora import (
    LoRALinear,
    apply_lora,
    is_adapter,
    lora_modules,
    memory_names,
    merge_adapters,
    parts_by_weights,
    peft_tensors,
    targeted,
)
from tests.hf_reference import hf_model_like, tiny_cfg
from tests.unit.test_model_parity import TWO_IMAGES, dhp_forward, hf_forward, make_inputs

TEXT_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # k_proj and up_proj left out: parts off
VISION_TARGETS = ["qkv", "proj", "up_proj", "down_proj"]  # gate_proj left out
R, ALPHA = 4, 8.0


def with_lora(model, seed: int = 0) -> dict:
    """LoRA on dhp's model (text and vision targets as above), A and B random; {module: (scale, target, r)}."""
    targets = {}
    for prefix, module, names in (("language", model.language, TEXT_TARGETS), ("visual", model.visual,
                                                                            VISION_TARGETS)):
        apply_lora(module, R, ALPHA, 0.0, names, parts_by_weights(WEIGHTS, prefix, module, model.cfg),
                   skip=("merger.",))
        targets |= {f"{prefix}.{n}": (m.scaling, m.target, m.r) for n, m in lora_modules(module)}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            p.requires_grad_(is_adapter(name))
    return targets


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    cfg = tiny_cfg()
    model = build_model(cfg, seed=0)
    hf = hf_model_like(model, tmp_path_factory.mktemp("ckpt"))
    targets = with_lora(model)
    pattern = (r"model\.language_model\..*\.(" + "|".join(TEXT_TARGETS) + r")|model\.visual\.blocks\..*\.("
               + "|".join(VISION_TARGETS) + ")")
    peft = get_peft_model(hf, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=pattern))
    ours = peft_tensors(model.state_dict(), targets, memory_names(WEIGHTS))
    theirs = {k: p for k, p in peft.named_parameters() if "lora_" in k}
    assert len(ours) == len(theirs) > 40
    with torch.no_grad():
        for key, value in ours.items():
            theirs[key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")].copy_(value)
    return cfg, model, peft, targets


def test_logits_and_adapter_gradients_match_peft(pair):
    cfg, model, peft, targets = pair
    ids, pv, grid = make_inputs(cfg, TWO_IMAGES, seed=1)
    weights = torch.randn(cfg.text.vocab_size, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    peft.zero_grad()
    ours = dhp_forward(model, ids, pv, grid)
    ref = hf_forward(peft, cfg, ids, pv, grid)
    assert (ours - ref).abs().max().item() < 1e-4
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if is_adapter(n)}
    ours_g = peft_tensors(grads, targets, memory_names(WEIGHTS))
    theirs = {k.replace(".default.", "."): p.grad for k, p in peft.named_parameters() if "lora_" in k}
    checked = {"visual": 0, "language_model": 0}
    for key, g in ours_g.items():
        ref_g = theirs[key]
        assert ref_g is not None and g.abs().max() > 0, key
        assert (g - ref_g).abs().max().item() / (ref_g.abs().max().item() + 1e-6) < 1e-4, key
        checked["visual" if ".visual." in key else "language_model"] += 1
    assert checked["visual"] >= 16 and checked["language_model"] >= 20
    # the parts the targets leave out have no adapter and get no gradient (k_proj, up_proj, vision gate_proj)
    qkv = model.language.layers[0].self_attn.qkv_proj
    q, k, _ = qkv.target.rows
    assert qkv.target.active == (True, False, True)
    assert qkv.lora_B.weight.grad[q:q + k].abs().max() == 0 and qkv.lora_A.weight.grad[R:2 * R].abs().max() == 0


def test_lora_changes_the_output_and_merging_folds_it(pair):
    """The adapters matter (the base alone gives other logits) and the merged weights give the LoRA logits."""
    cfg, model, _, targets = pair
    ids, pv, grid = make_inputs(cfg, TWO_IMAGES, seed=3)
    with torch.no_grad():
        lora_logits = dhp_forward(model, ids, pv, grid)
        merged = merge_adapters(model.state_dict(), targets)
        plain = build_model(cfg, seed=0)
        base_logits = dhp_forward(plain, ids, pv, grid)
        plain.load_state_dict(merged)
        merged_logits = dhp_forward(plain, ids, pv, grid)
    assert (lora_logits - base_logits).abs().max() > 1e-2
    assert (lora_logits - merged_logits).abs().max() < 1e-4


def test_targets_follow_peft_rules():
    assert targeted("model.layers.0.self_attn.q_proj", ["q_proj"])
    assert not targeted("model.layers.0.self_attn.q_proj", ["proj"])  # whole last components, not substrings
    assert targeted("model.layers.0.self_attn.q_proj", r".*layers\.0\..*q_proj")
    assert not targeted("model.layers.1.self_attn.q_proj", r".*layers\.0\..*q_proj")
    assert targeted("model.layers.0.mlp.down_proj", "all-linear") and not targeted("lm_head", "all-linear")


def test_a_target_that_matches_nothing_is_an_error():
    cfg = tiny_cfg()
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="q_porj.*match no Linear.*q_proj"):
        apply_lora(model.language, R, ALPHA, 0.0, ["q_porj"], parts_by_weights(WEIGHTS, "language", model.language,
                                                                                 model.cfg))
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


@pytest.mark.parametrize("overrides, message", [
    (["text.lora.r=-1"], r"text\.lora\.r: must be >= 0"),
    (["text.lora.r=4", "text.lora.alpha=0"], r"text\.lora\.alpha: must be > 0"),
    (["vision.lora.r=4", "vision.lora.dropout=1.0"], r"vision\.lora\.dropout: must be in \[0, 1\)"),
    (["text.lora.r=4", "text.lora.target_modules=(q_proj"], r"text\.lora\.target_modules: not a regex"),
    (["text.lora.r=4", "text.trainable=false"], r"text\.lora\.r=4: adapters on a frozen module"),
])
def test_bad_lora_settings_name_the_key(overrides, message):
    from dhp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["runtime.backend=local", *overrides])


def test_lora_settings_parse_as_peft_users_write_them():
    from dhp.config import load_config

    cfg = load_config(None, ["runtime.backend=local", "text.lora.r=8", "text.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.text.lora.enabled and cfg.text.lora.target_modules == ["q_proj", "v_proj"]
    assert not cfg.vision.lora.enabled and cfg.vision.lora.target_modules == "all-linear"
    # LLaMA-Factory's `lora_target: q_proj,v_proj`: the same list (as one regex it would match no module name)
    comma = load_config(None, ["runtime.backend=local", "text.lora.r=8", "text.lora.target_modules=q_proj, v_proj"])
    assert comma.text.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(None, ["text.lora.target_modules=.*proj"]).text.lora.target_modules == ".*proj"  # a regex
