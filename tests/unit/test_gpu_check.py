"""``benchmarks/gpu_check.py --dry-run``: the GPU check's hot-path code runs on the CPU with the tiny preset and
writes its JSON (the GPU figures themselves need a device: docs/performance.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_the_hot_path_json(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    variants = "eager_sdpa_autocast,eager_sdpa_bf16,eager_sdpa_autocast_ac,eager_varlen_bf16"  # compile: test_compile
    gpu_check.main(["--dry-run", "--out", str(out), "--hotpath-variants", variants])
    doc = json.loads(out.read_text())
    hot = doc["hotpath"]
    assert doc["device"] == "cpu" and hot["preset"] == "tiny" and "hotpath_error" not in doc
    assert {"text_layer_tp2", "vision_block_256", "vision_block_1024"} <= set(hot)
    for name in ("text_layer_tp2", "vision_block_256", "vision_block_1024"):
        entry = hot[name]
        assert entry["model_flops"] > 0
        runs = entry["runs"]
        assert runs["eager_varlen_bf16"] == {"skipped": "varlen attention runs on CUDA only"}
        for v in ("eager_sdpa_autocast", "eager_sdpa_bf16", "eager_sdpa_autocast_ac"):
            assert runs[v]["fwd_bwd_s"] > 0 and runs[v]["tokens_per_s"] > 0, (name, v, runs[v])
    assert hot["text_layer_tp2"]["q_heads_local"] == 2 and hot["text_layer_tp2"]["kv_heads_local"] == 1
    # model FLOPs grow with the square of a full-attention block's patches: more than 4x for 4x the patches
    assert hot["vision_block_1024"]["model_flops"] > 4 * hot["vision_block_256"]["model_flops"]
    gemms = {g["gemm"]: g for g in hot["gemm"]}
    assert {"text_qkv_fused", "text_gate_up_fused", "vision_qkv"} <= set(gemms)
    assert all(g["tflops"] > 0 for g in gemms.values())
