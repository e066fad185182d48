"""Uneven tensor parallelism of Qwen2.5-VL's vision encoder: an MLP width that tp does not divide (gloo, 4 ranks).

The published uniform-TP baseline runs the 32B's vision at TP 8, whose MLP width 3420 is not a multiple of 8.
Each gate/up half is cut as ``torch.chunk`` cuts it (``ceil(I/tp)`` rows on the first ranks, fewer or none on the
last) and padded with zero rows, so every rank holds ``ceil(I/tp)`` rows of each half (``FusedColwise(uneven=
True)``); down_proj is DTensor's own uneven ``Shard(1)`` with its input cut to the real columns (``UnevenRowwise``).

One spawn of 4 ranks runs three widths against the unsharded module (same seed, float32):

* tp 2 over I = 75 (38 + 37 rows), on each row of a 2 x 2 mesh;
* tp 4 over I = 57 (15, 15, 15, 12: the 3420-over-8 pattern, 428 x 7 + 424), with LoRA on qkv, proj, up, down;
* tp 4 over I = 9 (3, 3, 3, 0: the last rank holds padding only);
* tp 2 over I = 75 with FSDP2 over dp 2 (the family's ``parallelize_vision``: TP, then ZeRO-3), both replicas on
  the same input, so FSDP's SUM reduction gives twice the single-process gradient.

For each: the output and every parameter's gradient (gathered, back to HF order by the family's
``layout_transforms``), the local shard sizes, the family's init in the layout, a reload from canonical full
tensors (the HF / state-dict path) and a DCP checkpoint round trip of weights and AdamW state
(``dhp.engine_checkpoint``). The planner's memory of the 32B vision at TP 8 equals the closed form.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dhp.engine_checkpoint import load_engine, save_engine
from dhp.models.qwen2_5_vl.config import preset, tiny
from dhp.models.qwen2_5_vl.family import VISION, check_vision_layout, parallelize_vision, vision_layout_transforms
from dhp.models.qwen2_5_vl.parallelize import (
    FusedColwise,
    chunk_rows,
    parallelize_vision_tp,
    rows_from_rank_order,
    rows_to_rank_order,
)
from dhp.models.qwen2_5_vl.vision import VisionTransformer
from dhp.models.qwen2_5_vl.weights import WEIGHTS
from dhp.models.spec import ParallelizeOptions
from dhp.parallel.lora import apply_lora, is_adapter, load_adapters, parts_by_weights
from dhp.parallel.materialize import DictSource, load_by_name, to_empty
from dhp.plan.measure import GroupJob, measure, media_of
from tests.dist_utils import run_distributed

WORLD = 4
# tp, I, LoRA, FSDP2 (ZeRO-3) over the other mesh dimension
CASES = {"tp2_odd": (2, 75, False, False), "tp4_uneven": (4, 57, True, False), "tp4_empty": (4, 9, False, False),
         "tp2_fsdp2": (2, 75, False, True)}
GRID = [[1, 8, 12]]  # 96 patches: 24 merged tokens, two windows
LORA_TARGETS = ["qkv", "proj", "up_proj", "down_proj"]  # gate_proj left out: a part without an adapter


def vision_cfg(width: int) -> Any:
    v = tiny().vision
    return replace(v, depth=2, intermediate_size=width, fullatt_block_indexes=(1,))


def build(width: int, lora: bool, seed: int = 0) -> VisionTransformer:
    """The same module on every rank and in the reference: norms, biases and adapters away from their init."""
    cfg = vision_cfg(width)
    torch.manual_seed(seed)
    model = VisionTransformer(cfg)
    if lora:
        apply_lora(model, 4, 8.0, 0.0, LORA_TARGETS, parts_by_weights(WEIGHTS, "visual", model, tiny()),
                   skip=("merger.",))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def inputs(width: int) -> dict[str, torch.Tensor]:
    cfg = vision_cfg(width)
    g = torch.Generator().manual_seed(2)
    n = sum(t * h * w for t, h, w in GRID)
    return {"pixel_values": torch.randn(n, cfg.patch_dim, generator=g), "grid_thw": torch.tensor(GRID),
            "weight": torch.randn(n // 4, cfg.out_hidden_size, generator=g)}


def par_of(tp: int) -> SimpleNamespace:
    return SimpleNamespace(inner_kind="tp", config=SimpleNamespace(tp=tp))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def canonical(model: nn.Module, tp: int, of: str = "weight") -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole and in HF order, as checkpoints see it (``layout_transforms``)."""
    transforms = vision_layout_transforms(model, par_of(tp)) if tp > 1 else {}
    out = {}
    for name, p in model.named_parameters():
        t = full(p if of == "weight" else p.grad)
        out[name] = transforms[name].to_canonical(t) if name in transforms else t
    return out


def run(model: nn.Module, x: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    out = model(x["pixel_values"], x["grid_thw"])
    (out * x["weight"]).sum().backward()
    return {"out": out.detach(), "grads": canonical(model, tp, "grad")}


class _Engine:
    """What ``save_engine``/``load_engine`` read of a module engine: the module, its optimizer, its layout."""

    def __init__(self, module: nn.Module, tp: int) -> None:
        self.module, self.tp = module, tp
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
        self.cfg = SimpleNamespace(train=SimpleNamespace(optimizer="adamw"))

    def layout_transforms(self) -> dict:
        return vision_layout_transforms(self.module, par_of(self.tp))

    def restore_schedule(self, step: int) -> None:
        pass

    def exp_avg(self) -> dict[str, torch.Tensor]:
        """Each parameter's first moment whole and in HF order (the padding rows dropped)."""
        transforms = self.layout_transforms()
        out = {}
        for name, p in self.module.named_parameters():
            t = full(self.optimizer.state[p]["exp_avg"])
            out[name] = transforms[name].to_canonical(t) if name in transforms else t
        return out


def _layout(model: VisionTransformer, mesh: DeviceMesh, dp_mesh: DeviceMesh | None) -> None:
    """Vision TP over ``mesh``; with ``dp_mesh``, the family's own order: TP, then FSDP2 over ``dp_mesh``."""
    if dp_mesh is None:
        parallelize_vision_tp(model, mesh)
        return
    par = SimpleNamespace(inner_kind="tp", mesh={"tp": mesh})
    parallelize_vision(model, par, ParallelizeOptions(fsdp_mesh=dp_mesh))


def _case(rank: int, mesh: DeviceMesh, width: int, lora: bool, ckpt: Path,
          dp_mesh: DeviceMesh | None = None) -> dict[str, Any]:
    tp = mesh.size()
    x = inputs(width)
    model = build(width, lora)
    _layout(model, mesh, dp_mesh)
    mlp = model.blocks[0].mlp
    res: dict[str, Any] = {"local": {"gate_up": tuple(_tp_local(mlp.gate_up_proj.weight).shape),
                                     "gate_up_bias": tuple(_tp_local(mlp.gate_up_proj.bias).shape),
                                     "down": tuple(_tp_local(mlp.down_proj.weight).shape),
                                     "global": tuple(mlp.gate_up_proj.weight.shape),
                                     "mesh_dims": mlp.gate_up_proj.weight.device_mesh.ndim}}
    res |= run(model, x, tp)
    res["weights"] = canonical(model, tp)
    # a checkpoint after one AdamW step (weights and state), read back into a module of another seed
    engine = _Engine(model, tp)
    engine.optimizer.step()
    group = mesh.get_group() if dp_mesh is None else dist.group.WORLD
    save_engine(engine, ckpt, group, rank)
    res["stepped"], res["exp_avg"] = canonical(model, tp), engine.exp_avg()
    fresh = build(width, lora, seed=7)
    _layout(fresh, mesh, dp_mesh)
    other = _Engine(fresh, tp)
    run(fresh, x, tp)
    other.optimizer.step()  # a state to overwrite
    load_engine(other, ckpt, group, rank, step=1, same_layout=True)
    res["loaded"], res["loaded_exp_avg"] = canonical(fresh, tp), other.exp_avg()
    res["padding_zero"] = _padding_is_zero(fresh, tp)
    # the family's init in this layout, and a reload from canonical full tensors (the HF / state-dict path)
    VISION.init(fresh, 5, vision_layout_transforms(fresh, par_of(tp)))
    res["init"] = canonical(fresh, tp)
    res["padding_zero_after_init"] = _padding_is_zero(fresh, tp)
    with torch.device("meta"):  # as the engine builds it: on meta, laid out there, then each rank's storage
        on_meta = build(width, lora)
    _layout(on_meta, mesh, dp_mesh)
    to_empty(on_meta, "cpu")
    VISION.reset_buffers(on_meta)
    VISION.init(on_meta, 5, vision_layout_transforms(on_meta, par_of(tp)))
    res["init_from_meta"] = canonical(on_meta, tp)
    res["padding_zero_from_meta"] = _padding_is_zero(on_meta, tp)
    transforms = vision_layout_transforms(fresh, par_of(tp))
    adapters = {n: p for n, p in fresh.named_parameters() if is_adapter(n)}
    load_adapters(adapters, res["weights"], transforms)  # the engine's path for a state that holds adapters
    res["adapters"] = {n: t for n, t in canonical(fresh, tp).items() if n in adapters}
    load_by_name(fresh, DictSource(res["weights"]), transforms=transforms, what="vision", strict_unused=True)
    res["reloaded"] = canonical(fresh, tp)
    return res


def _tp_local(p: torch.Tensor) -> torch.Tensor:
    """This TP rank's shard of ``p`` (under FSDP2 over TP: the TP shard, FSDP's dim gathered)."""
    if p.device_mesh.ndim == 1:
        return p.to_local()
    return p.redistribute(placements=[Replicate(), p.placements[-1]]).to_local()


def _padding_is_zero(model: nn.Module, tp: int) -> bool:
    """Every padding row of every gate/up weight, bias and adapter B is zero (re-ordered back, the parts padded)."""
    for name, p in model.named_parameters():
        if ".gate_up_proj." in name and not name.endswith("lora_A.weight"):
            t = full(p)
            half = t.shape[0] // 2
            by_rank = t.reshape(tp, 2, half // tp, *t.shape[1:])  # [rank, part, rows]
            real = model.blocks[0].mlp.down_proj.in_features
            c = chunk_rows(real, tp)
            pad = torch.cat([by_rank[:, i].reshape(tp * c, *t.shape[1:])[real:] for i in range(2)])
            if pad.numel() and pad.abs().max() != 0:
                return False
    return True


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # the plans must not depend on the rank's RNG
    flat = DeviceMesh("cpu", list(range(world)))
    rows = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    out = {}
    for case, (tp, width, lora, fsdp) in CASES.items():
        mesh = rows["tp"] if tp == 2 else flat
        row = rank // tp if tp == 2 and not fsdp else 0  # separate tp-2 groups write separate checkpoints
        out[case] = _case(rank, mesh, width, lora, Path(root) / f"{case}-{row}", rows["dp"] if fsdp else None)
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("uneven")), timeout_s=240)


def reference(case: str) -> dict[str, Any]:
    tp, width, lora, fsdp = CASES[case]
    model = build(width, lora)
    res = run(model, inputs(width), 1)
    if fsdp:  # two dp replicas on the same input, summed
        res["grads"] = {n: 2 * g for n, g in res["grads"].items()}
    res["weights"] = canonical(model, 1)
    VISION.init(model, 5)
    res["init"] = canonical(model, 1)
    return res


def chunks(n: int, tp: int) -> list[int]:
    """torch.chunk's cut of n rows over tp ranks (the closed form: ceil(n/tp) on the first ranks)."""
    c = -(-n // tp)
    return [max(0, min(c, n - r * c)) for r in range(tp)]


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for name, g in got.items():
        assert g.shape == want[name].shape, name
        assert (g - want[name]).abs().max().item() <= atol, name


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_vision_tp_matches_unsharded(sharded, case):
    """Output and every gradient (gate/up, its bias and adapter, down_proj's uneven columns) equal one process's
    on every rank, within 1e-5 in float32; the widths really are uneven."""
    tp, width, lora, _ = CASES[case]
    assert width % tp
    ref = reference(case)
    assert all(g.abs().max() > 0 for g in ref["grads"].values())  # every gradient checked is a real one
    for rank, res in enumerate(r[case] for r in sharded):
        assert (res["out"] - ref["out"]).abs().max().item() < 1e-5, rank
        assert_close(res["grads"], ref["grads"], atol=1e-5)
    if lora:
        assert any(".gate_up_proj.lora_B." in n for n in ref["grads"])


@pytest.mark.parametrize("case", list(CASES))
def test_local_shards_are_the_chunk_rule(sharded, case):
    """Rank r holds ceil(I/tp) rows of each gate/up half (its torch.chunk rows, then zero padding): an even
    Shard(0) of [2 tp ceil(I/tp), C]; down_proj holds its torch.chunk columns of I, as DTensor cuts them."""
    tp, width, _, fsdp = CASES[case]
    c, hidden = chunk_rows(width, tp), vision_cfg(width).hidden_size
    assert c == math.ceil(width / tp)
    for rank, res in enumerate(r[case] for r in sharded):
        local = res["local"]
        assert local["mesh_dims"] == (2 if fsdp else 1)  # FSDP2 really shards the TP shards a second time
        assert local["gate_up"] == (2 * c, hidden) and local["gate_up_bias"] == (2 * c,)
        assert local["global"] == (2 * tp * c, hidden)
        assert local["down"] == (hidden, chunks(width, tp)[rank % tp]), rank
    assert chunks(3420, 8) == [428] * 7 + [424]  # the 32B's vision at TP 8


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_checkpoint_init_and_reload_round_trip(sharded, case):
    """Through the family's ``layout_transforms``: the gathered weights are the unsharded module's exactly; a DCP
    checkpoint of weights and AdamW state reads back into another module bit for bit, padding rows zero; the
    family's init gives the unsharded values; a reload from canonical full tensors gives the weights back."""
    ref = reference(case)
    for rank, res in enumerate(r[case] for r in sharded):
        assert_close(res["weights"], ref["weights"], atol=0)
        assert_close(res["loaded"], res["stepped"], atol=0)
        assert_close(res["loaded_exp_avg"], res["exp_avg"], atol=0)
        assert any((res["stepped"][n] != ref["weights"][n]).any() for n in ref["weights"]), rank  # it stepped
        assert res["padding_zero"] and res["padding_zero_after_init"] and res["padding_zero_from_meta"], rank
        assert_close(res["init"], ref["init"], atol=0)
        assert_close(res["init_from_meta"], ref["init"], atol=0)
        assert_close(res["reloaded"], ref["weights"], atol=0)
        assert_close(res["adapters"], {n: w for n, w in ref["weights"].items() if is_adapter(n)}, atol=0)


def test_rank_order_pads_and_restores():
    """rows_to_rank_order pads each part at its end to ceil(n/tp) tp rows and groups them by rank; the inverse
    drops the padding and refuses a non-zero padding row or a tensor of the wrong length."""
    t = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(10, 3) + 1
    ordered = rows_to_rank_order(t, (5, 5), 4)  # c = 2: ranks hold [2, 2, 1, 0] real rows of each half
    assert ordered.shape == (16, 3)
    assert torch.equal(ordered[:4], torch.cat([t[0:2], t[5:7]]))  # rank 0: gate rows 0-1, up rows 0-1
    assert torch.equal(ordered[8:12], torch.cat([t[4:5], torch.zeros(1, 3), t[9:10], torch.zeros(1, 3)]))
    assert not ordered[12:].any()  # rank 3: padding only
    assert torch.equal(rows_from_rank_order(ordered, (5, 5), 4), t)
    bad = ordered.clone()
    bad[13] = 1.0
    with pytest.raises(ValueError, match="padding rows .* not zero"):
        rows_from_rank_order(bad, (5, 5), 4)
    with pytest.raises(ValueError, match="does not hold parts"):
        rows_from_rank_order(t, (5, 5), 4)


def test_uneven_fused_parts_must_be_equal():
    """Uneven shards are for equal parts (gate/up, whose local output is cut in halves); unequal parts (GQA's
    q/k/v) must divide tp, by name."""
    mesh = SimpleNamespace(size=lambda: 4)  # only the size: the checks run before any DTensor is made
    with pytest.raises(ValueError, match=r"needs parts of equal rows .*\[8, 6\]"):
        FusedColwise((8, 6), uneven=True)._partition_linear_fn("qkv", nn.Linear(4, 14), mesh)
    with pytest.raises(ValueError, match=r"tp=4 must divide every part of the fused gate_up_proj \(rows \[9, 9\]\)"):
        FusedColwise((9, 9))._partition_linear_fn("gate_up_proj", nn.Linear(4, 18), mesh)


def test_vision_layout_accepts_tp_that_divides_the_heads():
    """TP 8 of the 32B vision (16 heads, MLP width 3420) is accepted; a tp that splits a head is refused; so is an
    uneven MLP width for Qwen3-VL, which reuses the check with a plan of its own (fc1/fc2, even shards only)."""
    from dhp.models.qwen3_vl.config import tiny as qwen3_tiny
    from dhp.models.qwen3_vl.family import FAMILY as QWEN3_VL

    cfg = preset("32b")
    assert cfg.vision.intermediate_size % 8 and check_vision_layout(cfg, 1, 8) is None
    assert VISION.check_layout(cfg, 1, 8) is None
    assert check_vision_layout(cfg, 1, 3) == "vision.parallel.tp=3 must divide the vision heads (16)"
    assert check_vision_layout(cfg, 1, 8, uneven_mlp=False) == \
        "vision.parallel.tp=8 must divide the vision MLP width (3420)"
    q3 = qwen3_tiny()
    q3 = replace(q3, vision=replace(q3.vision, intermediate_size=75))
    assert QWEN3_VL.encoders[0].check_layout(q3, 1, 2) == "vision.parallel.tp=2 must divide the vision MLP width (75)"


def test_planner_memory_of_32b_vision_tp8_equals_closed_form():
    """Rank 0's weights at TP 8 (the planner's fake run): qkv and proj 1/8, gate/up ceil(3420/8) = 428 rows of each
    half, down_proj 428 columns (rank 0 holds the largest shard), norms, biases of proj/down, patch embedding and
    merger whole; float32, plus the rotary buffer."""
    cfg = preset("32b")
    v = replace(cfg.vision, depth=2, fullatt_block_indexes=(1,))
    cfg = replace(cfg, vision=v)
    got = measure(GroupJob("vision", inner=8, inner_kind="tp", media=media_of({"vision": 256}), device="cpu"), cfg)
    c, d, tp = chunk_rows(v.intermediate_size, 8), v.hidden_size, 8
    block = (2 * d  # norm1, norm2
             + 3 * d * (d + 1) // tp  # qkv weight and bias, whole heads
             + d * d // tp + d  # proj (Shard(1)) and its bias
             + 2 * c * (d + 1)  # gate/up and its bias: 428 rows of each half
             + d * c + d)  # down_proj's 428 columns and its bias
    whole = VisionTransformer(v)
    replicated = sum(p.numel() for n, p in whole.named_parameters() if not n.startswith("blocks."))
    buffers = sum(b.numel() * b.element_size() for b in whole.buffers())
    assert c == 428
    assert got.weights == 4 * (v.depth * block + replicated) + buffers
