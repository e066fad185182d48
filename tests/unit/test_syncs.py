"""The sync audit: host reads of device values per step and module, on the CPU.

A training step of Qwen2.5-VL (vision + text) and of the Qwen2.5-Omni thinker (vision + audio + text) reads no
device value inside any module (segment boundaries, placeholder positions, supervised rows and the encoders'
token index are host metadata); the step itself reads two: the summed loss and the gradient norm, once each.
The counts stay the same when layers, samples per micro-batch and micro-batches all double.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from dhp.backends.local import LocalBackend
from dhp.config import load_config
from dhp.data.sampler import BatchPlanner
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs
from dhp.observe.syncs import SyncAudit
from dhp.ops.attention import Segments, host_metadata, packed_attention

ENGINE_METHODS = ("forward", "backward", "forward_backward", "finish_gradients", "grad_norm_sq", "step")


def test_the_audit_tells_device_reads_from_host_metadata():
    lin = torch.nn.Linear(4, 4)
    host = torch.tensor([0, 3, 5])  # made before the audit: host metadata
    with SyncAudit() as audit, audit.scope("m"):
        y = lin(torch.randn(5, 4))  # a factory's output, then a parameter's product: device values
        host.tolist(), int(host.sum())  # host: free
        with host_metadata():
            made_here = torch.arange(3) * 2
        made_here.tolist()  # host metadata made in a host region: free
        q = torch.randn(5, 2, 4)
        packed_attention(q, q, q, host, causal=True)  # host boundaries: free
        packed_attention(q, q, q, Segments([0, 3, 5]), causal=True)
        float(y.sum())  # 1: a scalar read
        y.tolist()  # 2
        (y > 0).nonzero()  # 3
        y[y > 0]  # 4: boolean-mask indexing
        moved = torch.tensor([1, 2, 3]).to("cpu")  # to the compute device: a device value from here
        int((moved == 2).sum())  # 5
        packed_attention(q, q, q, torch.tensor([0, 3, 5]).to("cpu"), causal=True)  # 6: boundaries on the device
    assert audit.counts == Counter({"m": 6}), audit.summary()
    assert [r.what for r in audit.reads][-1] == "Tensor.tolist" and "packed_attention" in audit.reads[-1].where
    assert host.tolist() == [0, 3, 5] and torch.Tensor.tolist is not None  # patches undone


def _double(model_cfg):
    """Every module's depth doubled (full-attention vision blocks too)."""
    changes = {}
    if hasattr(model_cfg, "text"):
        changes["text"] = dataclasses.replace(model_cfg.text, num_hidden_layers=2 * model_cfg.text.num_hidden_layers)
    if hasattr(model_cfg, "vision"):
        v = model_cfg.vision
        full = tuple(v.fullatt_block_indexes) + tuple(i + v.depth for i in v.fullatt_block_indexes)
        changes["vision"] = dataclasses.replace(v, depth=2 * v.depth, fullatt_block_indexes=full)
    if hasattr(model_cfg, "audio"):
        a = model_cfg.audio
        changes["audio"] = dataclasses.replace(a, encoder_layers=2 * a.encoder_layers)
    return dataclasses.replace(model_cfg, **changes)


def audited_step(overrides: list[str], double: bool) -> tuple[SyncAudit, dict[str, int]]:
    """Host reads of one local training step per module (the first: the optimizer makes its state too)."""
    cfg = load_config(None, overrides)
    inputs = resolve_inputs(cfg)
    if double:
        inputs = dataclasses.replace(inputs, model_cfg=_double(inputs.model_cfg))
    dataset = open_dataset(dataset_spec(inputs, inputs.train_path))
    load = dataset.get

    def host_load(*args, **kwargs):  # the data pipeline's work is host work (a loader thread, in a worker)
        with host_metadata():
            return load(*args, **kwargs)

    dataset.get = host_load
    backend = LocalBackend(inputs, dataset)
    costs = module_costs(inputs.family, inputs.model_cfg, dataset)
    planner = BatchPlanner(costs, {m: 1 for m in costs}, cfg.train.global_batch_size, cfg.train.micro_batch_size)
    plan = planner.plan(0)
    layers = {e.name: sum(1 for m in e.module.modules() if hasattr(m, "self_attn") or hasattr(m, "attn"))
              for e in backend.engines}
    with SyncAudit() as audit:
        for e in backend.engines:
            audit.watch(e.module)
            audit.scoped(e, e.name, ENGINE_METHODS)
        backend.run_step(plan)
    return audit, {"micro_batches": len(plan.rounds), "samples": len(plan.sample_ids), **layers}


def _check(base_overrides: list[str], modules: set[str]) -> None:
    base, base_sizes = audited_step(base_overrides, double=False)
    bigger, sizes = audited_step([o.replace("global_batch_size=2", "global_batch_size=8").replace(
        "micro_batch_size=1", "micro_batch_size=2") for o in base_overrides], double=True)
    assert sizes == {k: 2 * v if k != "samples" else 4 * v for k, v in base_sizes.items()}, (base_sizes, sizes)
    for audit in (base, bigger):
        # inside the modules: nothing; the step: the summed loss and the global gradient norm, read once each
        assert all(audit.ops[m] > 100 for m in modules), audit.ops  # every module ran its step under the audit
        assert {m: audit.counts[m] for m in modules} == dict.fromkeys(modules, 0), audit.summary()
        assert audit.counts["other"] == 2, audit.summary()
        assert {r.where.split(":")[0] for r in audit.reads} == {"backends/local.py", "backends/base.py"}


def test_qwen_vl_step_reads_nothing_inside_its_modules(demo_overrides):
    over = [*demo_overrides, "train.global_batch_size=2", "train.micro_batch_size=1"]
    _check(over, {"vision", "text"})


def test_omni_step_reads_nothing_inside_its_modules(omni_demo_data, tmp_path):
    over = [f"data.path={omni_demo_data.train}", f"data.tokenizer={omni_demo_data.tokenizer}", "data.max_pixels=9408",
            "model.family=qwen2_5_omni", "model.preset=omni-tiny", "train.global_batch_size=2",
            "train.micro_batch_size=1", "train.warmup_steps=1", f"output.dir={tmp_path / 'run'}",
            "runtime.backend=local"]
    _check(over, {"vision", "audio", "text"})
