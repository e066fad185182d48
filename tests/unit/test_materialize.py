"""Shard-local init and loading (``dhp.parallel.materialize``): every layout starts from the same weights.

Modules are built on the meta device, parallelized there (TP, Megatron SP, FSDP2, FSDP2 over TP, the
vision TP baseline whose fused qkv is not in canonical order), materialised with ``to_empty`` and then
initialised by parameter name, or loaded from an HF checkpoint slice by slice. Assembled with
``full_tensor()`` they must equal the single-process module bit for bit, and no rank may materialise a
whole sharded parameter on the way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dhp.config import ConfigError
from dhp.engine import build_module
from dhp.models.qwen2_5_vl import build_model, save_hf_checkpoint
from dhp.models.qwen2_5_vl.family import FAMILY, vision_layout_transforms
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_rule, reset_rotary_buffers
from dhp.models.qwen2_5_vl.weights import WEIGHTS
from dhp.parallel.materialize import (
    CheckpointError,
    DictSource,
    SafetensorsSource,
    init_by_name,
    load_by_name,
    to_empty,
    track_materialized,
)
from tests.dist_utils import run_distributed
from tests.unit.test_tensor_parallel import full, text_cfg

SEED = 5
CHUNK = 1000  # elements per init chunk: small, so the tiny model's parameters span several chunks
LAYOUTS = ("tp", "tp_sp", "fsdp2", "fsdp4", "fsdp2_tp2")


def text_on_meta(tie: bool) -> TextModel:
    cfg = text_cfg(tie)
    with torch.device("meta"):
        return TextModel(cfg.text, cfg.image_token_id)


def materialised(module: nn.Module) -> nn.Module:
    to_empty(module, "cpu")
    reset_rotary_buffers(module)
    return module


def reference_text(tie: bool) -> TextModel:
    m = materialised(text_on_meta(tie))
    init_by_name(m, SEED, init_rule, chunk_elems=CHUNK)
    return m


def hf_text_key(name: str) -> tuple[str, ...]:
    return WEIGHTS.hf_names("language." + name)


# ---- single process -----------------------------------------------------------------------------------------


def test_plain_init_is_by_name_and_chunk_local() -> None:
    """Values depend on (seed, name) only: two builds agree; a different seed or name does not; the rule holds."""
    a, b = reference_text(False), reference_text(False)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    other = materialised(text_on_meta(False))
    init_by_name(other, SEED + 1, init_rule, chunk_elems=CHUNK)
    assert not torch.equal(other.embed_tokens.weight, a.embed_tokens.weight)
    assert not torch.equal(a.layers[0].mlp.gate_up_proj.weight, a.layers[1].mlp.gate_up_proj.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert torch.equal(a.layers[0].self_attn.qkv_proj.bias, torch.zeros_like(a.layers[0].self_attn.qkv_proj.bias))
    assert a.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(a.rotary.inv_freq, TextModel(text_cfg().text, 0).rotary.inv_freq)  # buffers recomputed


def test_tied_weights_are_initialised_once() -> None:
    m = reference_text(True)
    assert m.lm_head.weight is m.embed_tokens.weight
    with track_materialized() as seen:
        init_by_name(m, SEED, init_rule, chunk_elems=CHUNK)
    assert "embed_tokens.weight" in seen and "lm_head.weight" not in seen


def test_engine_module_equals_build_model_and_hf_load() -> None:
    """A group's module (meta, to_empty, init by name) is the whole model's module, and reloads from HF."""
    cfg = text_cfg(True)
    model = build_model(cfg, seed=SEED)
    for spec, ref in ((FAMILY.module("vision"), model.visual), (FAMILY.module("text"), model.language)):
        got = build_module(spec, cfg, SEED, "cpu", None)
        for (n, p), (_, q) in zip(ref.state_dict().items(), got.state_dict().items(), strict=True):
            assert torch.equal(p, q), n
        for (n, b), (_, c) in zip(ref.named_buffers(), got.named_buffers(), strict=True):
            assert torch.equal(b, c), n


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, str]:
    out = {}
    for tie in (False, True):
        d = tmp_path_factory.mktemp(f"hf_tie{tie}")
        save_hf_checkpoint(build_model(text_cfg(tie), seed=0), d)
        out[tie] = str(d)
    return out


def test_engine_loads_its_module_from_hf(checkpoints: dict[bool, str]) -> None:
    cfg = text_cfg(True)
    ref = build_model(cfg, seed=0)
    for spec, want in ((FAMILY.module("vision"), ref.visual), (FAMILY.module("text"), ref.language)):
        got = build_module(spec, cfg, 123, "cpu", None, hf_path=checkpoints[True])
        for (n, p), (_, q) in zip(want.state_dict().items(), got.state_dict().items(), strict=True):
            assert torch.equal(p, q), n


def test_missing_tensor_names_tensor_and_file(checkpoints: dict[bool, str], tmp_path: Path) -> None:
    src = Path(checkpoints[False])
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    m = materialised(text_on_meta(False))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*" + re.escape(str(tmp_path))):
        load_by_name(m, SafetensorsSource(tmp_path), key_of=hf_text_key)
    # through the engine: a ConfigError (one line in the CLI), before any training
    with pytest.raises(ConfigError, match=r"model\.hf_path: .*up_proj"):
        build_module(FAMILY.module("text"), text_cfg(False), 0, "cpu", None, hf_path=str(tmp_path))


def test_missing_tensor_of_a_sharded_checkpoint_names_the_index(checkpoints: dict[bool, str],
                                                                 tmp_path: Path) -> None:
    model = build_model(text_cfg(False), seed=0)
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=20_000)  # several files and an index
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    m = materialised(text_on_meta(False))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*model\.safetensors\.index\.json"):
        load_by_name(m, SafetensorsSource(tmp_path), key_of=hf_text_key)


def test_wrong_shape_names_tensor_and_file(checkpoints: dict[bool, str]) -> None:
    from dataclasses import replace

    cfg = text_cfg(False)
    cfg = replace(cfg, text=replace(cfg.text, intermediate_size=160))
    with torch.device("meta"):
        m = TextModel(cfg.text, cfg.image_token_id)
    materialised(m)
    file = str(Path(checkpoints[False]) / "model.safetensors")
    # the fused gate/up reads as HF's gate_proj and up_proj concatenated: [2 * 192, 96] against [2 * 160, 96]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight \+ model\.layers\.0\.mlp\."
                       r"up_proj\.weight in " + re.escape(file) + r" has shape \[384, 96\].*\[320, 96\]"):
        load_by_name(m, SafetensorsSource(checkpoints[False]), key_of=hf_text_key)


def test_state_dict_source_is_strict() -> None:
    ref = reference_text(False)
    state = dict(ref.state_dict())
    state["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_by_name(materialised(text_on_meta(False)), DictSource(state), strict_unused=True)
    del state["extra.weight"], state["norm.weight"]
    with pytest.raises(CheckpointError, match="norm.weight"):
        load_by_name(materialised(text_on_meta(False)), DictSource(state))


# ---- four gloo ranks: every layout --------------------------------------------------------------------------


def _layouts(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    from dhp.runtime.mesh import ModuleLayout, create_mesh_groups, device_mesh

    layout = ModuleLayout("text", 2, 2, "tp")
    mesh = device_mesh(layout, 0, create_mesh_groups([layout], "gloo", rank), "cpu")
    world = DeviceMesh("cpu", list(range(4)))
    return {"mesh": mesh, "world": world}


def _parallelize(module: TextModel, layout: str, meshes: dict[str, Any]) -> None:
    from dhp.models.qwen2_5_vl.parallelize import parallelize_text
    from dhp.parallel.sharding import apply_fsdp

    mesh = meshes["mesh"]
    if layout in ("tp", "tp_sp", "fsdp2_tp2"):
        parallelize_text(module, mesh["tp"], sequence_parallel=layout == "tp_sp")
    if layout == "fsdp2":
        apply_fsdp(module, mesh["dp"], list(module.layers), forward_methods=("loss_sum",))
    if layout == "fsdp4":  # 4 ranks: uneven shards (301 vocabulary rows)
        apply_fsdp(module, meshes["world"], list(module.layers), forward_methods=("loss_sum",))
    if layout == "fsdp2_tp2":  # FSDP2 over TP: _StridedShard on dp
        apply_fsdp(module, mesh["dp"], list(module.layers), forward_methods=("loss_sum",))


def _text_transforms(module: TextModel, layout: str) -> dict[str, Any]:
    """The layout's non-canonical text parameters (the engine passes the same): under TP the fused gate/up rows
    grouped by rank."""
    from dhp.models.qwen2_5_vl.family import language_layout_transforms

    tp = layout in ("tp", "tp_sp", "fsdp2_tp2")
    par = SimpleNamespace(inner_kind="tp" if tp else None, config=SimpleNamespace(tp=2 if tp else 1))
    return language_layout_transforms(module, par)


def _canonical(module: nn.Module, transforms: dict[str, Any]) -> dict[str, torch.Tensor]:
    got = {n: full(p) for n, p in module.named_parameters()}
    return {n: transforms[n].to_canonical(t) if n in transforms else t for n, t in got.items()}


def _sharded_sizes(module: nn.Module) -> dict[str, tuple[int, int]]:
    from dhp.parallel.tensor import local_tensor

    return {n: (p.numel(), local_tensor(p).numel()) for n, p in module.named_parameters()}


def _worker(rank: int, world_size: int, ckpts: dict[bool, str]) -> dict[str, Any]:
    from dhp.models.qwen2_5_vl.parallelize import parallelize_vision_tp

    torch.manual_seed(100 + rank)  # nothing may depend on a rank's global RNG
    meshes = _layouts(rank)
    out: dict[str, Any] = {}
    for tie in (False, True):
        for layout in LAYOUTS:
            m = text_on_meta(tie)
            _parallelize(m, layout, meshes)
            materialised(m)
            transforms = _text_transforms(m, layout)
            with track_materialized() as seen:
                init_by_name(m, SEED, init_rule, chunk_elems=CHUNK, transforms=transforms)
            out[f"init/{layout}/{tie}"] = _canonical(m, transforms)
            out[f"init_seen/{layout}/{tie}"] = dict(seen)
            out[f"transformed/{layout}/{tie}"] = sorted(transforms)
            out[f"sizes/{layout}/{tie}"] = _sharded_sizes(m)
            out[f"tied/{layout}/{tie}"] = m.lm_head.weight is m.embed_tokens.weight

            m = text_on_meta(tie)
            _parallelize(m, layout, meshes)
            materialised(m)
            with track_materialized() as seen:
                load_by_name(m, SafetensorsSource(ckpts[tie]), key_of=hf_text_key, transforms=transforms)
            out[f"load/{layout}/{tie}"] = _canonical(m, transforms)
            out[f"load_seen/{layout}/{tie}"] = dict(seen)
            if layout == "tp" and not tie:  # what this TP rank holds of the fused gate/up, as it is
                mlp = m.layers[1].mlp.gate_up_proj
                out["gate_up_local"] = {"weight": mlp.weight.to_local().clone(), "tp_rank": meshes["mesh"]["tp"]
                                        .get_local_rank()}
                qkv = m.layers[2].self_attn.qkv_proj
                out["qkv_local"] = {"weight": qkv.weight.to_local().clone(), "bias": qkv.bias.to_local().clone()}
    # the vision TP baseline: fused qkv rows in rank order (a layout transform), from init and from HF
    cfg = text_cfg(False)
    for how in ("init", "load"):
        with torch.device("meta"):
            v = VisionTransformer(cfg.vision)
        parallelize_vision_tp(v, meshes["mesh"]["tp"])
        materialised(v)
        par = SimpleNamespace(inner_kind="tp", config=SimpleNamespace(tp=2))
        transforms = vision_layout_transforms(v, par)
        if how == "init":
            init_by_name(v, SEED, init_rule, transforms=transforms, chunk_elems=CHUNK)
        else:
            load_by_name(v, SafetensorsSource(ckpts[False]), key_of=lambda n: WEIGHTS.hf_names("visual." + n),
                         transforms=transforms)
        got = {n: full(p) for n, p in v.named_parameters()}
        out[f"vision/{how}"] = {n: transforms[n].to_canonical(t) if n in transforms else t for n, t in got.items()}
        out[f"vision_transformed/{how}"] = sorted(transforms)
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints: dict[bool, str]) -> list[dict[str, Any]]:
    return run_distributed(_worker, 4, checkpoints, timeout_s=300)


def _assert_equal(got: dict[str, torch.Tensor], want: nn.Module, what: str) -> None:
    want_named = dict(want.named_parameters())
    assert got.keys() == want_named.keys(), what
    for n, t in got.items():
        assert torch.equal(t, want_named[n].detach()), f"{what}: {n}"


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_is_the_same_in_every_layout(ranks: list[dict[str, Any]], layout: str, tie: bool) -> None:
    ref = reference_text(tie)
    for r, res in enumerate(ranks):
        _assert_equal(res[f"init/{layout}/{tie}"], ref, f"rank {r} {layout} tie={tie}")
        assert res[f"tied/{layout}/{tie}"] == tie


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_local_hf_load_equals_a_full_load(ranks: list[dict[str, Any]], layout: str, tie: bool) -> None:
    ref = build_model(text_cfg(tie), seed=0).language
    for r, res in enumerate(ranks):
        _assert_equal(res[f"load/{layout}/{tie}"], ref, f"rank {r} {layout} tie={tie}")


@pytest.mark.parametrize("what", ["init", "load"])
def test_no_rank_materialises_a_whole_sharded_parameter_under_tp2(ranks: list[dict[str, Any]], what: str) -> None:
    """Under tp 2 the largest temporary a rank creates for a sharded parameter (a generated chunk, a slice read
    from the checkpoint) is smaller than that parameter: its shard, or one chunk of rows."""
    checked = 0
    for res in ranks:
        sizes, seen = res["sizes/tp/False"], res[f"{what}_seen/tp/False"]
        transformed = res["transformed/tp/False"]
        # every layer's fused q/k/v (weight and bias) and gate/up weight
        assert len(transformed) == 3 * text_cfg(False).text.num_hidden_layers
        for name, (numel, local) in sizes.items():
            if name in transformed:  # a layout transform: made whole (canonical), reordered, then sliced
                assert seen.get(name, numel) == numel, name  # (a zero bias's init draws nothing)
                continue
            if local < numel:  # sharded here
                assert seen.get(name, 0) < numel, (name, seen.get(name), numel)  # zeros and ones: none
                if what == "load":
                    assert seen[name] == local, name  # exactly its own slice
                checked += 1
    assert checked >= 4 * 2 * 2  # every other projection of every layer (o, down), on both ranks


def test_a_tp_rank_holds_its_own_gate_and_up_rows(ranks: list[dict[str, Any]], checkpoints: dict[bool, str]) -> None:
    """Under TP 2 the fused gate/up a rank holds is [its rows of HF's gate_proj; its rows of up_proj] (Megatron's
    layout), not a slice across the concatenation (rank 0: gate only)."""
    hf = load_file(Path(checkpoints[False]) / "model.safetensors")
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    half = gate.shape[0] // 2
    for res in ranks:
        got = res["gate_up_local"]
        r = got["tp_rank"]
        want = torch.cat([gate[r * half:(r + 1) * half], up[r * half:(r + 1) * half]])
        assert torch.equal(got["weight"], want), r


def test_a_tp_rank_holds_its_own_q_k_and_v_heads(ranks: list[dict[str, Any]], checkpoints: dict[bool, str]) -> None:
    """Under TP 2 the fused GQA qkv a rank holds (loaded shard-locally from HF's q_proj, k_proj, v_proj) is [its q
    heads; its k heads; its v heads]: unequal parts (4 q heads, 2 kv heads of 24), each cut by rank."""
    hf = load_file(Path(checkpoints[False]) / "model.safetensors")
    for kind in ("weight", "bias"):
        q, k, v = (hf[f"model.layers.2.self_attn.{p}_proj.{kind}"] for p in "qkv")
        assert (q.shape[0], k.shape[0], v.shape[0]) == (96, 48, 48)
        for res in ranks:
            r = res["gate_up_local"]["tp_rank"]
            want = torch.cat([q[r * 48:(r + 1) * 48], k[r * 24:(r + 1) * 24], v[r * 24:(r + 1) * 24]])
            assert torch.equal(res["qkv_local"][kind], want), (kind, r)


@pytest.mark.parametrize("how", ["init", "load"])
def test_vision_tp_baseline_layout_transform(ranks: list[dict[str, Any]], how: str) -> None:
    """The fused qkv rows a TP rank holds are in rank order: made whole in canonical order, then transformed."""
    cfg = text_cfg(False)
    if how == "init":
        with torch.device("meta"):
            ref = VisionTransformer(cfg.vision)
        materialised(ref)
        init_by_name(ref, SEED, init_rule, chunk_elems=CHUNK)
    else:
        ref = build_model(cfg, seed=0).visual
    for r, res in enumerate(ranks):
        assert res[f"vision_transformed/{how}"], "qkv weight and bias under TP"
        _assert_equal(res[f"vision/{how}"], ref, f"rank {r} vision {how}")
