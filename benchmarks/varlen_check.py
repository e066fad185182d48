"""Varlen attention against the SDPA path, on the packed shapes the models run: the numeric check the CPU tests
cannot make (FlashAttention's variable-length kernels run on CUDA in bfloat16 only).

Cases: text (causal, grouped-query heads: Qwen2.5-VL-32B at TP 8 has 5 query and 1 KV heads per rank, head 128,
packed samples of unequal lengths) and vision (non-causal, 16 heads of 80: windows of 64 patches with smaller edge
windows, and whole images for the full-attention blocks). Per case: the largest absolute difference of the output
and of the q, k, v gradients (varlen vs SDPA, both bfloat16, relative to the SDPA result's scale), and the time
of forward + backward of each. ``benchmarks/gpu_check.py`` calls ``check_attention_kernels``; on a machine
without CUDA this runs the SDPA path only (a dry run of the shapes).

    python benchmarks/varlen_check.py [--out outputs/bench/varlen_check.json] [--scale 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dhp.ops.attention import Segments, attention_kernel, packed_attention, varlen_kernel

TOLERANCE = 2e-2  # bfloat16 (8 bits of mantissa): both kernels accumulate in float32, round their output to bf16


def _cases(scale: int) -> dict[str, dict]:
    text_lengths = [1500, 3000, 700, 2992][: max(1, scale * 4)]
    windows = [64] * (48 * scale) + [32, 16, 48]  # windows of 8x8 merged units (4 patches each), edge ones smaller
    images = [4096 * scale, 1024, 2300]
    return {
        "text_tp8_32b": {"lengths": text_lengths, "heads": 5, "kv_heads": 1, "head_dim": 128, "causal": True},
        "vision_windows": {"lengths": windows, "heads": 16, "kv_heads": 16, "head_dim": 80, "causal": False},
        "vision_full": {"lengths": images, "heads": 16, "kv_heads": 16, "head_dim": 80, "causal": False},
    }


def _run(kernel: str, q, k, v, bounds: list[int], causal: bool) -> tuple[torch.Tensor, tuple, float]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    segments = Segments(bounds, kernel)
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = packed_attention(q, k, v, segments, causal)
    out.float().square().sum().backward()
    sync()
    return out.detach(), (q.grad, k.grad, v.grad), time.perf_counter() - t0


def check_attention_kernels(device: str = "cuda", scale: int = 1) -> dict:
    """Per case: the kernel ``auto`` picks, the differences varlen - SDPA (output, dq, dk, dv; relative to the
    largest SDPA magnitude), whether they are within ``TOLERANCE``, and the seconds of each (second run)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    out: dict = {"device": device, "varlen_kernel": varlen_kernel(), "tolerance": TOLERANCE, "cases": {}}
    for name, c in _cases(scale).items():
        bounds = [0]
        for n in c["lengths"]:
            bounds.append(bounds[-1] + n)
        shape = (bounds[-1], c["heads"], c["head_dim"])
        q = torch.randn(shape, generator=g).to(device, dtype)
        k, v = (torch.randn(bounds[-1], c["kv_heads"], c["head_dim"], generator=g).to(device, dtype)
                for _ in range(2))
        row: dict = {"tokens": bounds[-1], "segments": len(c["lengths"]), "auto": attention_kernel("auto", q)}
        kernels = ["sdpa"] + (["varlen"] if row["auto"] == "varlen" else [])
        results = {}
        for kernel in kernels:
            _run(kernel, q, k, v, bounds, c["causal"])  # warm-up (kernel selection, allocator)
            results[kernel] = _run(kernel, q, k, v, bounds, c["causal"])
            row[f"{kernel}_s"] = results[kernel][2]
        if "varlen" in results:
            (o_ref, g_ref, _), (o, grads, _) = results["sdpa"], results["varlen"]
            diffs = {"out": _rel(o, o_ref)} | {f"d{n}": _rel(a, b) for n, a, b in zip("qkv", grads, g_ref, strict=True)}
            row["max_rel_diff"] = diffs
            row["equal_within_tolerance"] = all(d < TOLERANCE for d in diffs.values())
        out["cases"][name] = row
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/bench/varlen_check.json"))
    ap.add_argument("--scale", type=int, default=1, help="longer sequences (x scale)")
    args = ap.parse_args()
    result = check_attention_kernels("cuda" if torch.cuda.is_available() else "cpu", args.scale)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
