"""GPU checks that CPU tests cannot make (run on a CUDA machine; Ray is not needed).

1. The model on CUDA equals the CPU model (float32 logits) and transformers' model on CUDA.
2. Mixed precision: the module engines train in bfloat16 autocast with float32 master weights;
   FSDP2 (world of one) with the bfloat16 policy runs and keeps float32 master weights.
3. The Qwen2.5-VL vision encoder at its real width (hidden 1280, 32 blocks, 4 full-attention)
   on long single images: peak memory and time of forward + backward in bfloat16, with and
   without activation checkpointing — window attention must keep memory linear in patches.
4. CUDA IPC between two processes (the collocated transport) vs a host round trip.
5. MFU (issue 12): the language model at 3B width on 8k tokens packed from several samples, and the vision
   encoder at its real width on 16k patches, forward + backward in bfloat16 autocast (float32 master weights,
   as the engines train), against the device table's peak (``dhp.observe.devices``). Model FLOPs are the closed
   forms of ``dhp.models.qwen2_5_vl.flops`` (checked against FlopCounterMode by tests/unit/test_flops.py).
0. Issue 22 (``hotpath``, first): one Qwen2.5-VL-32B text layer at its TP 8 local shape (16k tokens in 4k
   samples) and one full-attention vision block at 16k and 64k patches, each as eager or compiled, SDPA-packed or
   varlen attention (the model's own selection, ``Segments(bounds, kernel)``), bf16 autocast over float32
   weights or pure bf16 weights, activation checkpointing on or off: tokens/s, MFU, peak memory, device-to-host
   syncs per step (``torch.cuda.set_sync_debug_mode``) and per micro-batch of the tiny model; bf16 GEMM
   efficiency at the planner's shapes. Variants past ``--hotpath-budget-s`` are skipped by name.
   ``--dry-run`` runs it on the CPU with the tiny preset and small shapes (no MFU, memory or sync figures).
6. Issue 9: the 7B language model built on the meta device, activation checkpointing applied there, then
   materialized on CUDA by ``dhp.engine.materialize`` (shard-local ``init_by_name``); forward and backward in
   bfloat16 autocast on a few k tokens; peak memory.

    python benchmarks/gpu_check.py [--out outputs/bench/gpu_check.json] [--patches 4096,16384,65536]
                                   [--checks hotpath,text_mfu,vision_mfu,lm7b,parity,bf16,ipc,vision]
    python benchmarks/gpu_check.py --checks hotpath            # issue 22's figures alone (about 5 min on an H200)
    python benchmarks/gpu_check.py --dry-run --out /tmp/x.json # the same code on the CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dhp.models.qwen2_5_vl.config import VisionConfig, tiny
from dhp.models.qwen2_5_vl.model import build_model
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights


def tiny_inputs(cfg, device):
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 12, 20], [1, 6, 10]])
    ids = [5, 6, cfg.vision_start_token_id] + [cfg.image_token_id] * 60 + [cfg.vision_end_token_id]
    ids += [7, 8, cfg.vision_start_token_id] + [cfg.image_token_id] * 15 + [cfg.vision_end_token_id] + [9] * 5
    pv = torch.randn(12 * 20 + 6 * 10, cfg.vision.patch_dim, generator=g)
    return torch.tensor([ids], device=device), pv.to(device), grid


def check_parity(results: dict) -> None:
    cfg = tiny(vocab_size=300, image_token_id=290, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293)
    cpu = build_model(cfg, seed=0)
    gpu = build_model(cfg, seed=0).cuda()
    ids, pv, grid = tiny_inputs(cfg, "cpu")
    ref = cpu(ids, pv, grid)
    out = gpu(ids.cuda(), pv.cuda(), grid).cpu()
    results["cuda_vs_cpu_logits_max_abs_diff"] = float((out - ref).abs().max())
    try:
        import tempfile

        from transformers import Qwen2_5_VLForConditionalGeneration

        from dhp.models.qwen2_5_vl import save_hf_checkpoint

        with tempfile.TemporaryDirectory() as d:
            save_hf_checkpoint(cpu, d)
            hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).cuda().eval()
            mm = (ids == cfg.image_token_id).int()
            hf_out = hf(input_ids=ids.cuda(), pixel_values=pv.cuda(), image_grid_thw=grid.cuda(),
                        mm_token_type_ids=mm.cuda()).logits.cpu()
        results["cuda_vs_transformers_cuda_logits_max_abs_diff"] = float((out - hf_out).abs().max())
    except Exception as e:  # noqa: BLE001 - report, do not hide the other checks
        results["transformers_check_error"] = repr(e)


def check_bf16_training(results: dict) -> None:
    """bf16 autocast steps of the tiny model through the engine code path (token-mean loss, clipping)."""
    cfg = tiny(vocab_size=300, image_token_id=290, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293)
    model = build_model(cfg, seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, pv, grid = tiny_inputs(cfg, "cuda")
    targets = torch.roll(ids, -1, dims=1)
    targets[0, -1] = -100
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            emb = model.visual(pv, grid)
            loss = model.language.loss_sum(ids, model.position_ids(ids, grid), targets, emb)
        (loss / (targets != -100).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss) / int((targets != -100).sum()))
    results["bf16_autocast_losses_first_last"] = [losses[0], losses[-1]]
    results["bf16_master_weights_dtype"] = str(next(model.parameters()).dtype)

    # FSDP2 with the bfloat16 policy (a world of one: the policy and the engine wiring, not the sharding)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.parallel.sharding import apply_fsdp, mixed_precision_policy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        text = build_model(cfg, seed=0).language.cuda()
        apply_fsdp(text, init_device_mesh("cuda", (1,)), list(text.layers),
                   mp_policy=mixed_precision_policy(torch.bfloat16), forward_methods=("loss_sum",))
        text_ids = torch.randint(0, 280, (1, 64), device="cuda")
        text_targets = torch.roll(text_ids, -1, dims=1)
        loss = text.loss_sum(text_ids, torch.arange(64, device="cuda").expand(3, 1, -1), text_targets)
        loss.backward()
        grad = next(p for p in text.parameters() if p.grad is not None).grad
        results["fsdp2_bf16_loss"] = float(loss)
        results["fsdp2_bf16_param_dtype"] = str(next(text.parameters()).dtype)
        results["fsdp2_bf16_grad_dtype"] = str(grad.dtype)
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        results["nccl_all_reduce_ok"] = bool(x[0].item() == 1.0)
    finally:
        dist.destroy_process_group()


def vision_memory(results: dict, patches_list: list[int]) -> None:
    cfg = replace(VisionConfig(), out_hidden_size=3584)  # Qwen2.5-VL-7B's encoder
    rows = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = VisionTransformer(cfg).cuda()
        init_weights(model, 0.02)
        if checkpointing:
            from dhp.parallel.sharding import apply_activation_checkpointing

            apply_activation_checkpointing(list(model.blocks))
        for n in patches_list:
            side = int(n ** 0.5) // 8 * 8
            grid = torch.tensor([[1, side, side]])
            pv = torch.randn(side * side, cfg.patch_dim, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(pv, grid)
                out.float().square().mean().backward()
                torch.cuda.synchronize()
                row = {"patches": side * side, "checkpointing": checkpointing,
                       "peak_gb_above_weights": (torch.cuda.max_memory_allocated() - base) / 2**30,
                       "fwd_bwd_s": time.perf_counter() - t0}
            except torch.OutOfMemoryError:
                row = {"patches": side * side, "checkpointing": checkpointing, "oom": True}
            model.zero_grad(set_to_none=True)
            del pv
            torch.cuda.empty_cache()
            rows.append(row)
            print("vision", row, flush=True)
        del model
        torch.cuda.empty_cache()
    results["vision_encoder_7b_bf16"] = rows


def _ipc_child(q_in, q_out) -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    q_out.put("ready")
    for _ in range(2):
        t = q_in.get()
        torch.cuda.synchronize()
        q_out.put(float(t[0].item()))
        del t


def ipc_transfer(results: dict) -> None:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q_in, q_out))
    p.start()
    assert q_out.get(timeout=120) == "ready"  # the child's CUDA context exists: time the hand-off only
    x = torch.full((64 << 20,), 3.0, device="cuda")  # 256 MB float32
    q_in.put(torch.ones(1, device="cuda"))  # warm the IPC path
    q_out.get(timeout=120)
    t0 = time.perf_counter()
    q_in.put(x)
    value = q_out.get(timeout=120)
    ipc_s = time.perf_counter() - t0
    p.join(timeout=60)
    t0 = time.perf_counter()
    y = x.cpu().cuda()
    torch.cuda.synchronize()
    host_s = time.perf_counter() - t0
    results["cuda_ipc_256MB"] = {"received_value": value, "ipc_handoff_s": ipc_s, "host_roundtrip_s": host_s}
    del y


def _timed_fwd_bwd(step, iters: int = 5, warmup: int = 2) -> float:
    """Seconds per call of ``step()`` (forward + backward), after ``warmup`` calls, CUDA synchronised."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _peak_flops() -> tuple[float, str]:
    from dhp.observe.flops import device_peak

    name = torch.cuda.get_device_name(0)
    peak = device_peak(name)
    if peak is None:  # not in the table: say so, measure against the H100/H200 figure
        return 989e12, f"{name} not in dhp.observe.devices; 989 TFLOP/s assumed"
    return peak.flops, peak.label


def _text_batch(segments: list[int], vocab: int, device: str):
    tokens = sum(segments)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 150000), (1, tokens), generator=g)  # below every special token id
    pos = torch.cat([torch.arange(s) for s in segments]).view(1, 1, -1).expand(3, 1, -1).contiguous()
    targets = torch.roll(ids, -1, dims=1)
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()])
    return ids.to(device), pos.to(device), targets.to(device), cu


def text_mfu(results: dict, segments: list[int]) -> None:
    """The language model at Qwen2.5-VL-3B's width (all 36 layers, tied 151936 vocab) on one packed micro-batch."""
    from dhp.models.qwen2_5_vl.config import preset
    from dhp.models.qwen2_5_vl.flops import text_flops
    from dhp.models.qwen2_5_vl.text import TextModel
    from dhp.models.qwen2_5_vl.vision import init_weights

    cfg = preset("3b")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TextModel(cfg.text, cfg.image_token_id)
    init_weights(model, 0.02)
    ids, pos, targets, cu = _text_batch(segments, cfg.text.vocab_size, "cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss_sum(ids, pos, targets, None, cu)
        loss.backward()

    torch.cuda.reset_peak_memory_stats()
    seconds = _timed_fwd_bwd(step)
    fwd, bwd = text_flops(segments, cfg.text)
    peak, label = _peak_flops()
    results["text_mfu_3b_width"] = {
        "segments": segments, "tokens": sum(segments), "fwd_bwd_s": seconds, "model_tflops": (fwd + bwd) / 1e12,
        "achieved_tflops": (fwd + bwd) / seconds / 1e12, "mfu": (fwd + bwd) / seconds / peak, "peak": label,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "target_mfu": 0.55}
    print("text_mfu", results["text_mfu_3b_width"], flush=True)


def vision_mfu(results: dict, grids: list[tuple[int, int, int]]) -> None:
    """The vision encoder at its real width (Qwen2.5-VL-7B's: 32 blocks, hidden 1280, out 3584)."""
    from dhp.models.qwen2_5_vl.flops import vision_flops

    cfg = replace(VisionConfig(), out_hidden_size=3584)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = VisionTransformer(cfg)
    init_weights(model, 0.02)
    grid = torch.tensor(grids)
    patches = sum(t * h * w for t, h, w in grids)
    pv = torch.randn(patches, cfg.patch_dim, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(pv, grid)
        out.float().square().mean().backward()

    torch.cuda.reset_peak_memory_stats()
    seconds = _timed_fwd_bwd(step)
    fwd, bwd = vision_flops(grids, cfg)
    peak, label = _peak_flops()
    results["vision_mfu_real_width"] = {
        "grids": grids, "patches": patches, "fwd_bwd_s": seconds, "model_tflops": (fwd + bwd) / 1e12,
        "achieved_tflops": (fwd + bwd) / seconds / 1e12, "mfu": (fwd + bwd) / seconds / peak, "peak": label,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "target_mfu": 0.40}
    print("vision_mfu", results["vision_mfu_real_width"], flush=True)


def lm_7b_meta(results: dict, segments: list[int]) -> None:
    """Issue 9: 7B language model from the meta device to CUDA through the engine's own path, one fwd + bwd."""
    from dhp.engine import materialize
    from dhp.models.registry import get_family
    from dhp.parallel.sharding import apply_activation_checkpointing

    family = get_family("qwen2_5_vl")
    cfg = family.preset_config("7b")
    spec = family.language
    with torch.device("meta"):
        module = spec.build(cfg)
    apply_activation_checkpointing(module.layers)  # on meta, before materialize: the engine's order
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    materialize(spec, module, cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    materialize_s = time.perf_counter() - t0
    weights_gb = torch.cuda.memory_allocated() / 2**30
    ids, pos, targets, cu = _text_batch(segments, cfg.text.vocab_size, "cuda")
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = module.loss_sum(ids, pos, targets, None, cu)
    loss.backward()
    torch.cuda.synchronize()
    grads = sum(1 for p in module.parameters() if p.grad is not None)
    results["lm_7b_meta_materialize"] = {
        "segments": segments, "materialize_s": materialize_s, "weights_gb": weights_gb,
        "fwd_bwd_s": time.perf_counter() - t0, "loss_per_token": float(loss) / sum(segments),
        "params_with_grad": grads, "params": sum(1 for _ in module.parameters()),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
        "param_dtype": str(next(module.parameters()).dtype), "activation_checkpointing": True}
    print("lm_7b", results["lm_7b_meta_materialize"], flush=True)
    del module, loss
    torch.cuda.empty_cache()


# ---- issue 22: the hot path of one layer (eager vs compiled, SDPA vs varlen, autocast vs bf16, AC) ----------------

HOTPATH_VARIANTS = {  # name: (compiled, attention kernel, pure bf16 parameters, activation checkpointing)
    "eager_sdpa_autocast": (False, "sdpa", False, False),
    "eager_varlen_autocast": (False, "varlen", False, False),
    "eager_sdpa_bf16": (False, "sdpa", True, False),
    "eager_varlen_bf16": (False, "varlen", True, False),
    "eager_sdpa_autocast_ac": (False, "sdpa", False, True),
    "eager_varlen_bf16_ac": (False, "varlen", True, True),
    "compiled_sdpa_autocast": (True, "sdpa", False, False),
    "compiled_varlen_bf16": (True, "varlen", True, False),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _text_layer_local(preset_name: str, tp: int):
    """One decoder layer of the preset's language model at its TP ``tp`` local shape: each rank's q/k/v heads and
    MLP slice (the attention reads its head counts from the projection widths), hidden size whole."""
    from torch import nn

    from dhp.models.qwen2_5_vl.config import preset
    from dhp.models.qwen2_5_vl.text import DecoderLayer, MRotary

    cfg = (tiny() if preset_name == "tiny" else preset(preset_name)).text
    hd, c = cfg.head_dim, cfg.hidden_size
    q, kv, i = cfg.num_attention_heads // tp * hd, cfg.num_key_value_heads // tp * hd, cfg.intermediate_size // tp
    layer = DecoderLayer(cfg)
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv_proj = nn.Linear(c, q + 2 * kv)  # [q; k; v] of this rank's heads, as the fused TP shard holds them
    attn.o_proj = nn.Linear(q, c, bias=False)
    mlp.gate_up_proj = nn.Linear(c, 2 * i, bias=False)  # [gate; up], as SwiGLU fuses them
    mlp.down_proj = nn.Linear(i, c, bias=False)
    return layer, MRotary(cfg), cfg


def _hotpath_case(kind: str, preset_name: str, tokens: int, segment: int, device: str, tp: int):
    """(build(bf16) -> (module, step inputs), segment boundaries, description) of one measured block."""
    from dhp.models.qwen2_5_vl.config import preset
    from dhp.models.qwen2_5_vl.vision import VisionBlock, VisionRotary

    bounds = list(range(0, tokens, segment)) + [tokens]
    g = torch.Generator().manual_seed(0)
    if kind == "text":
        layer, rotary, cfg = _text_layer_local(preset_name, tp)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        rope = rotary(pos.view(1, 1, -1).expand(3, 1, -1))
        x = torch.randn(1, tokens, cfg.hidden_size, generator=g)
        desc = {"hidden": cfg.hidden_size, "tp": tp, "q_heads_local": cfg.num_attention_heads // tp,
                "kv_heads_local": cfg.num_key_value_heads // tp, "mlp_local": cfg.intermediate_size // tp}
        return layer, x, rope, bounds, desc
    vcfg = (tiny() if preset_name == "tiny" else preset(preset_name)).vision
    block = VisionBlock(vcfg, full_attention=True)
    side = int(tokens ** 0.5)
    hpos = torch.arange(tokens) // side
    rope = VisionRotary(vcfg)(torch.stack([hpos, torch.arange(tokens) % side], dim=-1))
    x = torch.randn(tokens, vcfg.hidden_size, generator=g)
    return block, x, rope, bounds, {"hidden": vcfg.hidden_size, "heads": vcfg.num_heads, "full_attention": True}


def _segments(bounds: list[int], kernel: str):
    """The boundaries as the model's attention selection takes them (``Segments`` with its kernel), or a tensor
    where that selection is not there (then the model's default kernel runs)."""
    try:
        from dhp.ops.attention import Segments
    except ImportError:
        return torch.tensor(bounds)
    return Segments(bounds, kernel)


def _measure_variant(kind: str, case, variant: tuple, device: str, iters: int, flops: float | None,
                     peak: float | None) -> dict:
    from dhp.engine import cast_parameters
    from dhp.models.qwen2_5_vl.vision import init_weights
    from dhp.parallel.sharding import apply_activation_checkpointing

    compiled, kernel, pure, ac = variant
    module, x, rope, bounds, _ = case
    module = module.to(device)
    init_weights(module, 0.02)
    if pure:
        cast_parameters(module, torch.bfloat16)
    if ac:
        apply_activation_checkpointing([module])
    if compiled:
        module.forward = torch.compile(module.forward)
    x = x.to(device, torch.bfloat16 if pure else torch.float32).requires_grad_()
    rope = tuple(r.to(device) for r in rope)
    segs = _segments(bounds, kernel)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            out = module(x, segs, rope) if kind == "vision" else module(x, rope, segs)
        out.float().square().mean().backward()

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    t0 = time.perf_counter()
    step()  # the first call (compiles, if compiled)
    _sync(device)
    first_s = time.perf_counter() - t0
    if compiled:
        step()  # a second warm call: what the first backward left to compile or to allocate
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    seconds = (time.perf_counter() - t0) / iters
    tokens = bounds[-1]
    row = {"fwd_bwd_s": seconds, "first_call_s": first_s, "tokens_per_s": tokens / seconds,
           "mfu": flops / seconds / peak if flops and peak else None,
           "peak_memory_gb": (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None}
    if device == "cuda":
        row["syncs_per_step"] = _count_syncs(step)
    return row


def _count_syncs(step) -> int:
    """Device-to-host syncs of one ``step()``: the warnings ``torch.cuda.set_sync_debug_mode("warn")`` raises."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _model_flops(kind: str, case, device: str) -> float:
    """FLOPs of one forward + backward of the block (eager, SDPA, no recomputation): what MFU counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from dhp.models.qwen2_5_vl.vision import init_weights
    from dhp.plan.measure import _register_cpu_attention_flops

    _register_cpu_attention_flops()
    module, x, rope, bounds, _ = case
    module = module.to(device)
    init_weights(module, 0.02)
    x = x.to(device).requires_grad_()
    counter = FlopCounterMode(display=False)
    rope, segs = tuple(r.to(device) for r in rope), _segments(bounds, "sdpa")
    with counter, torch.autocast(device, dtype=torch.bfloat16):
        out = module(x, segs, rope) if kind == "vision" else module(x, rope, segs)
        out.float().square().mean().backward()
    module.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def gemm_efficiency(preset_name: str, tokens: int, tp: int, device: str, peak: float | None,
                    iters: int) -> list[dict]:
    """bf16 GEMM throughput at the shapes the planner's text (TP ``tp`` local) and vision rows run:
    ``[tokens, K] x [K, N]`` per projection."""
    from dhp.models.qwen2_5_vl.config import preset

    cfg = tiny() if preset_name == "tiny" else preset(preset_name)
    t, v = cfg.text, cfg.vision
    hd = t.head_dim
    shapes = {
        "text_q": (t.hidden_size, t.num_attention_heads // tp * hd),
        "text_kv": (t.hidden_size, t.num_key_value_heads // tp * hd),
        "text_qkv_fused": (t.hidden_size, (t.num_attention_heads + 2 * t.num_key_value_heads) // tp * hd),
        "text_o": (t.num_attention_heads // tp * hd, t.hidden_size),
        "text_gate_up_fused": (t.hidden_size, 2 * t.intermediate_size // tp),
        "text_down": (t.intermediate_size // tp, t.hidden_size),
        "vision_qkv": (v.hidden_size, 3 * v.hidden_size),
        "vision_mlp_up": (v.hidden_size, v.intermediate_size),
        "vision_mlp_down": (v.intermediate_size, v.hidden_size),
    }
    rows = []
    for name, (k, n) in shapes.items():
        a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        a @ b
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(device)
        s = (time.perf_counter() - t0) / iters
        flops = 2 * tokens * k * n
        rows.append({"gemm": name, "m": tokens, "k": k, "n": n, "tflops": flops / s / 1e12,
                     "efficiency": flops / s / peak if peak else None})
    return rows


def hotpath(results: dict, device: str, preset_name: str, text_tokens: int, patches: list[int],
            variants: list[str], budget_s: float, iters: int) -> None:
    """Issue 22's figures: one text layer at TP 8 local shape and one full-attention vision block per patch
    count, each variant's tokens/s, MFU, peak memory and syncs; GEMM efficiency at the planner's shapes.
    Variants past ``budget_s`` are skipped (and named so)."""
    start = time.perf_counter()
    peak = _peak_flops()[0] if device == "cuda" else None
    tp = 8 if preset_name != "tiny" else 2
    cases = [("text", f"text_layer_tp{tp}", text_tokens, min(4096, text_tokens))]
    cases += [("vision", f"vision_block_{n}", n, n) for n in patches]  # full attention over one image
    out: dict = {"preset": preset_name, "device": device, "variants": {k: HOTPATH_VARIANTS[k] for k in variants}}
    for kind, name, tokens, segment in cases:
        desc = _hotpath_case(kind, preset_name, tokens, segment, device, tp)[-1]
        flops = _model_flops(kind, _hotpath_case(kind, preset_name, tokens, segment, device, tp), device)
        entry = {"tokens": tokens, "segment": segment, "model_flops": flops, **desc, "runs": {}}
        for v in variants:
            if time.perf_counter() - start > budget_s:
                entry["runs"][v] = {"skipped": f"time budget of {budget_s:g} s spent"}
                continue
            compiled, kernel, pure, ac = HOTPATH_VARIANTS[v]
            if kernel == "varlen" and not (device == "cuda" and _varlen_available()):
                entry["runs"][v] = {"skipped": "varlen attention runs on CUDA only"}
                continue
            case = _hotpath_case(kind, preset_name, tokens, segment, device, tp)
            try:
                entry["runs"][v] = _measure_variant(kind, case, HOTPATH_VARIANTS[v], device, iters, flops, peak)
            except Exception as e:  # noqa: BLE001 - report, then measure the next variant
                entry["runs"][v] = {"error": repr(e)[:400]}
            print("hotpath", name, v, entry["runs"][v], flush=True)
        out[name] = entry
    if device == "cuda":
        out["syncs_per_micro_batch"] = micro_batch_syncs()
    out["gemm"] = gemm_efficiency(preset_name, text_tokens, tp, device, peak, iters)
    out["seconds"] = time.perf_counter() - start
    results["hotpath"] = out


def _varlen_available() -> bool:
    try:
        from dhp.ops.attention import varlen_kernel
    except ImportError:
        return False
    return varlen_kernel() is not None


def micro_batch_syncs() -> dict:
    """Device-to-host syncs of one micro-batch (forward + backward) of the tiny model's language model (two
    packed samples, boundaries as host ``Segments``) and vision encoder (two images), bf16 autocast on CUDA."""
    cfg = tiny(vocab_size=300, image_token_id=290, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293)
    model = build_model(cfg, seed=0).cuda()
    ids, pv, grid = tiny_inputs(cfg, "cuda")
    targets = torch.roll(ids, -1, dims=1)
    pos = model.position_ids(ids, grid)
    text_ids = torch.randint(0, 280, (1, 96), device="cuda")
    text_pos = torch.cat([torch.arange(40), torch.arange(56)]).view(1, 1, -1).expand(3, 1, -1).cuda()
    segs = _segments([0, 40, 96], "auto")

    def text_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.language.loss_sum(text_ids, text_pos, torch.roll(text_ids, -1, dims=1), None, segs)
        loss.backward()

    def vision_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.visual(pv, grid)
        out.float().square().mean().backward()

    text_step(), vision_step()  # warm: lazily made device tensors, cuBLAS handles
    del pos, targets
    return {"text_tiny_2_samples": _count_syncs(text_step), "vision_tiny_2_images": _count_syncs(vision_step)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="outputs/bench/gpu_check.json")
    p.add_argument("--patches", default="4096,16384,65536")
    p.add_argument("--checks", default="hotpath,text_mfu,vision_mfu,lm7b,parity,bf16,ipc,vision")
    p.add_argument("--text-segments", default="2048,1536,1024,2048,1536",
                   help="text MFU: tokens of each packed sample (default: 8192 in all)")
    p.add_argument("--vision-grids", default="64x64,64x64,64x64,64x64",
                   help="vision MFU: images as HxW patches (default: 4 x 4096 = 16384 patches)")
    p.add_argument("--lm7b-segments", default="2048,1024,1024", help="7B check: tokens of each packed sample")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the hot-path check only")
    p.add_argument("--preset", default="32b", help="hot path: the model whose layer shapes are measured")
    p.add_argument("--hotpath-text-tokens", type=int, default=16384, help="hot path: tokens of the text layer")
    p.add_argument("--hotpath-patches", default="16384,65536", help="hot path: patches of the vision block")
    p.add_argument("--hotpath-variants", default=",".join(HOTPATH_VARIANTS))
    p.add_argument("--hotpath-budget-s", type=float, default=300.0, help="hot path: later variants are skipped")
    p.add_argument("--iters", type=int, default=5, help="hot path: timed calls per variant")
    p.add_argument("--dry-run", action="store_true",
                   help="the hot-path check on the CPU with the tiny preset and small shapes (no GPU needed)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.preset, args.checks = "cpu", "tiny", "hotpath"
        args.hotpath_text_tokens, args.hotpath_patches, args.iters = 256, "256,1024", 1
    checks = args.checks.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (--dry-run runs the hot-path check on the CPU)")
    if args.device == "cpu" and set(checks) - {"hotpath"}:
        others = sorted(set(checks) - {"hotpath"})
        raise SystemExit(f"gpu_check: --device cpu runs the hot-path check only, not {others}")
    results: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                     "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as the engines run float32 matmuls on CUDA
    text_segments = [int(x) for x in args.text_segments.split(",")]
    grids = [(1, *map(int, g.split("x"))) for g in args.vision_grids.split(",")]
    lm_segments = [int(x) for x in args.lm7b_segments.split(",")]
    hot_patches = [int(x) for x in args.hotpath_patches.split(",") if x]
    variants = [v for v in args.hotpath_variants.split(",") if v]
    for name, fn in (("hotpath", lambda r: hotpath(r, args.device, args.preset, args.hotpath_text_tokens,
                                                   hot_patches, variants, args.hotpath_budget_s, args.iters)),
                     ("text_mfu", lambda r: text_mfu(r, text_segments)),
                     ("vision_mfu", lambda r: vision_mfu(r, grids)),
                     ("lm7b", lambda r: lm_7b_meta(r, lm_segments)),
                     ("parity", check_parity), ("bf16", check_bf16_training), ("ipc", ipc_transfer)):
        if name not in checks:
            continue
        t0 = time.perf_counter()
        try:
            fn(results)
        except Exception as e:  # noqa: BLE001 - report every check
            results[f"{name}_error"] = repr(e)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        results[f"{name}_seconds"] = time.perf_counter() - t0
        print(name, f"{time.perf_counter() - t0:.1f}s", flush=True)
    if "vision" in checks:
        try:
            vision_memory(results, [int(x) for x in args.patches.split(",")])
        except Exception as e:  # noqa: BLE001 - report every check
            results["vision_error"] = repr(e)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
