"""A LoRA run's checkpoint: it resumes exactly, and both exports give dhp's logits in transformers.

One local run from a tiny Hugging Face checkpoint (``model.hf_path``), text LoRA on every Linear (r 4) and vision
LoRA on ``qkv`` and ``down_proj`` (r 2: a second rank in ``rank_pattern``), AdamW (its state must come back for
the resumed step to match). After two steps: ``dhp export --adapter`` loads in ``peft`` onto the checkpoint the
run started from with no missing or unexpected key, ``dhp export`` (merged) loads in transformers, and both give
the logits of dhp's own model with the trained adapters.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dhp import checkpoint
from dhp.backends import make_backend
from dhp.cli import main
from dhp.config import load_config
from dhp.inputs import prepare
from dhp.models.qwen2_5_vl import build_model, load_hf_checkpoint, save_hf_checkpoint
from dhp.models.qwen2_5_vl.weights import WEIGHTS
from dhp.parallel.lora import apply_lora, is_adapter, parts_by_weights
from tests.unit.test_model_parity import TWO_IMAGES, dhp_forward, hf_forward, make_inputs

LORA = ["text.lora.r=4", "text.lora.alpha=8", "vision.lora.r=2", "vision.lora.alpha=4",
        "vision.lora.target_modules=[qkv,down_proj]"]


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory):
    """(run config, the HF checkpoint it started from, its checkpoint after 2 steps, the weights after 2 and 3
    steps, the run's overrides)."""
    base = tmp_path_factory.mktemp("base")
    over = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1", "train.lr=1e-2",
            "runtime.backend=local", f"output.dir={tmp_path_factory.mktemp('run')}", *LORA]
    preset_run = prepare(load_config(None, over))
    save_hf_checkpoint(build_model(preset_run.inputs.model_cfg, seed=5), base)
    over.append(f"model.hf_path={base}")
    run = prepare(load_config(None, over))
    backend = make_backend(run.inputs, run.dataset, run.spec)
    ckpt = tmp_path_factory.mktemp("ckpt") / "step_000002"
    try:
        for s in range(2):
            backend.run_step(run.planner.plan(s))
        backend.save_checkpoint(ckpt)
        checkpoint.finish(ckpt, {"step": 2, "config": run.inputs.cfg.to_dict()})
        after2 = backend.state_dict()
        backend.run_step(run.planner.plan(2))
        after3 = backend.state_dict()
    finally:
        backend.shutdown()
    return run, base, ckpt, after2, after3, over


def test_a_lora_checkpoint_resumes_exactly(trained):
    """The DCP checkpoint holds the adapters and their AdamW state (and the frozen base, every time: it is
    the module's state, and a checkpoint stays whole without model.hf_path): step 3 after a resume equals
    step 3 of the run that went on."""
    run, _, ckpt, after2, after3, over = trained
    fresh = prepare(load_config(None, over))
    backend = make_backend(fresh.inputs, fresh.dataset, fresh.spec)
    try:
        backend.load_checkpoint(ckpt, 2, same_layout=True)
        resumed2 = backend.state_dict()
        backend.run_step(fresh.planner.plan(2))
        resumed3 = backend.state_dict()
    finally:
        backend.shutdown()
    assert resumed2.keys() == after2.keys() and any(is_adapter(k) for k in after2)
    assert all(torch.equal(resumed2[k], after2[k]) for k in after2)
    worst = max((resumed3[k] - after3[k]).abs().max().item() for k in after3)
    assert worst < 1e-6
    moved = max((after3[k] - after2[k]).abs().max().item() for k in after3 if is_adapter(k))
    assert moved > 1e-4  # the third step moved the adapters: equal weights mean the optimizer state came back


def dhp_lora_model(run, base, state):
    """dhp's model from the base checkpoint with the run's adapters, the trained state loaded."""
    model = load_hf_checkpoint(base)
    for section, prefix, module in (("text", "language", model.language), ("vision", "visual", model.visual)):
        lora = run.inputs.cfg.module(section).lora
        apply_lora(module, lora.r, lora.alpha, 0.0, lora.target_modules,
                   parts_by_weights(WEIGHTS, prefix, module, model.cfg), skip=("merger.",))
    model.load_state_dict(state)
    return model.eval()


def test_peft_adapter_and_merged_exports_give_dhp_logits(trained, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration as HF

    run, base, ckpt, after2, _, _ = trained
    assert main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "merged")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        "LORA", 4, 8, str(base))
    assert set(config["rank_pattern"].values()) == {2} and all(".visual." in m for m in config["rank_pattern"])
    assert config["modules_to_save"] == ["model.visual.merger"]  # merger.trainable: trained whole, beside LoRA

    cfg = run.inputs.model_cfg
    ids, pv, grid = make_inputs(cfg, TWO_IMAGES, seed=4)
    with torch.no_grad():
        ours = dhp_forward(dhp_lora_model(run, base, after2), ids, pv, grid)
        plain = hf_forward(HF.from_pretrained(str(base), dtype=torch.float32).eval(), cfg, ids, pv, grid)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            peft = PeftModel.from_pretrained(HF.from_pretrained(str(base), dtype=torch.float32), str(tmp_path /
                                                                                                   "adapter"))
        assert not [str(w.message) for w in said if "adapter keys" in str(w.message)]
        via_peft = hf_forward(peft.eval(), cfg, ids, pv, grid)
        merged = hf_forward(HF.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval(), cfg, ids, pv,
                            grid)
    assert (ours - plain).abs().max() > 1e-3  # the adapters trained: the base alone gives other logits
    assert (via_peft - ours).abs().max() < 1e-4
    assert (merged - ours).abs().max() < 1e-4


def test_export_adapter_of_a_run_without_lora_is_an_error(demo_data, tmp_path):
    over = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=4", "train.micro_batch_size=2", "runtime.backend=local",
            f"output.dir={tmp_path / 'run'}"]
    run = prepare(load_config(None, over))
    backend = make_backend(run.inputs, run.dataset, run.spec)
    try:
        backend.save_checkpoint(tmp_path / "ckpt")
    finally:
        backend.shutdown()
    checkpoint.finish(tmp_path / "ckpt", {"step": 0, "config": run.inputs.cfg.to_dict()})
    with pytest.raises(checkpoint.CheckpointError, match="no LoRA adapters.*without --adapter"):
        checkpoint.export_adapter(tmp_path / "ckpt", tmp_path / "out")


def test_a_lora_base_is_held_in_the_compute_dtype(demo_data, tmp_path):
    """Under ``train.dtype=bfloat16`` a LoRA module's frozen base is bfloat16 (2 bytes a parameter, no float32
    master), its adapters float32 with float32 AdamW state; a step trains the adapters and leaves the base."""
    over = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=2", "train.micro_batch_size=2", "runtime.backend=local", "train.dtype=bfloat16",
            "train.warmup_steps=1", f"output.dir={tmp_path / 'run'}", "text.lora.r=4"]
    run = prepare(load_config(None, over))
    backend = make_backend(run.inputs, run.dataset, run.spec)
    try:
        (text,) = [e for e in backend.engines if e.name == "text"]
        dtypes = {(is_adapter(n), p.dtype) for n, p in text.module.named_parameters()}
        assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
        before = {k: v.clone() for k, v in text.state_dict().items()}
        for s in range(2):
            stats = backend.run_step(run.planner.plan(s))
        after = text.state_dict()
        state = [v for st in text.optimizer.state.values() for v in st.values() if v.dim()]
    finally:
        backend.shutdown()
    assert torch.isfinite(torch.tensor(stats.loss))
    assert state and all(v.dtype == torch.float32 for v in state)
    assert all(torch.equal(after[k], before[k]) for k in after if not is_adapter(k))
    assert max((after[k] - before[k]).abs().max().item() for k in after if is_adapter(k)) > 0


def test_pure_bf16_adapters_train_in_the_dtype_of_all_that_trains(demo_data, tmp_path):
    """Under pure bf16 (``train.precision=bf16``) the adapters are bfloat16 like the projector trained whole
    beside them (``merger.trainable``): one dtype for every trained parameter, as ZeRO-1's optimizer needs (float32
    adapters beside a bf16 projector stopped ``vision.parallel.zero=1`` at its build); a step trains them."""
    over = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=2", "train.micro_batch_size=2", "runtime.backend=local", "train.dtype=bfloat16",
            "train.precision=bf16", "train.warmup_steps=1", f"output.dir={tmp_path / 'run'}", "text.lora.r=4",
            "vision.lora.r=4"]
    run = prepare(load_config(None, over))
    backend = make_backend(run.inputs, run.dataset, run.spec)
    try:
        before = {e.name: {k: v.clone() for k, v in e.module.state_dict().items()} for e in backend.engines}
        for e in backend.engines:
            assert {p.dtype for p in e.trainable} == {torch.bfloat16}, e.name
            assert any(is_adapter(n) for n, p in e.module.named_parameters() if p.requires_grad), e.name
        for s in range(2):
            stats = backend.run_step(run.planner.plan(s))
        after = {e.name: e.module.state_dict() for e in backend.engines}
    finally:
        backend.shutdown()
    assert torch.isfinite(torch.tensor(stats.loss))
    for name, state in after.items():
        moved = [k for k in state if not torch.equal(state[k], before[name][k])]
        assert any(is_adapter(k) for k in moved), (name, moved)
        assert all(is_adapter(k) or k.startswith("merger") for k in moved), (name, moved)
