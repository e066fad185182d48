"""Issue 9's GPU check: the 7B language model starts the way every worker starts it, and trains a step.

Built on the meta device, activation checkpointing applied there, materialized on the GPU with
``to_empty``, then filled by the shard-local deterministic init (``dhp.engine.materialize``: the
same code path a worker runs, on one rank). One forward and backward in bfloat16 autocast over a
packed micro-batch, with float32 master weights. Prints JSON: parameters, the build and init
times, the memory after materializing (what the weights take), the peak of the step, tokens/s and
the step's model FLOP/s against the device table's peak.

    python benchmarks/gpu_start.py [--preset 7b] [--tokens 4096] [--samples 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--no-checkpointing", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"  # CPU: a smoke run of the same path (use --preset tiny)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    from dhp.engine import materialize
    from dhp.models.registry import get_family
    from dhp.observe.devices import detect_device
    from dhp.parallel.sharding import apply_activation_checkpointing

    out: dict = {"preset": args.preset, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    family = get_family("qwen2_5_vl")
    model_cfg = family.preset_config(args.preset)
    spec = family.language
    t0 = time.perf_counter()
    with torch.device("meta"):
        module = spec.build(model_cfg)
    if not args.no_checkpointing:
        apply_activation_checkpointing(module.layers)
    out["meta_build_s"] = time.perf_counter() - t0
    n_params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    out["parameters_b"] = n_params / 1e9
    t0 = time.perf_counter()
    materialize(spec, module, model_cfg, device, seed=0)
    sync()
    out["materialize_and_init_s"] = time.perf_counter() - t0
    if cuda:
        out["allocated_after_init_gb"] = torch.cuda.memory_allocated() / 2**30
    out["weights_gb_expected"] = n_params * 4 / 2**30
    t = model_cfg.text
    T, S = args.tokens, args.samples
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, t.vocab_size, (1, T), generator=g).to(device)
    seq = T // S
    pos = torch.arange(seq).repeat(S)[:T].view(1, 1, T).expand(3, 1, T).contiguous().to(device)
    cu = torch.arange(0, T + 1, seq, dtype=torch.int32)
    targets = torch.roll(ids, -1, dims=1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):  # the first one warms up kernels
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = module.loss_sum(ids, pos, targets, None, cu)
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=False)
    step = min(times[1:])
    out["loss_per_token"] = float(loss) / T
    out["step_s"] = step
    if cuda:
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out["tokens_per_s"] = T / step
    # model FLOPs: 6 per parameter per token (forward + backward) + causal attention (QK^T, AV: 6 * 2 * L * T_s^2 * C)
    attn = 6 * 2 * t.num_hidden_layers * S * seq * seq * t.hidden_size / 2
    flops = 6 * n_params * T + attn
    dev = detect_device()
    out["model_tflops_per_s"] = flops / step / 1e12
    if dev is not None:
        out["mfu"] = flops / step / dev.peak_flops
        out["peak_tflops_table"] = dev.peak_bf16_tflops
    out["activation_checkpointing"] = not args.no_checkpointing
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
