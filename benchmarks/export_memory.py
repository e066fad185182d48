"""Peak memory of `dhp export` against the model's size: the export streams one shard at a time.

Builds a Qwen2.5-VL with a ~0.5B-parameter language model, writes it as a dhp
checkpoint (DCP, one directory per module, as the workers write it), then exports
it to Hugging Face safetensors in a fresh process and reports that process's peak
RSS above its baseline, next to the model's size:

    .venv/bin/python benchmarks/export_memory.py [--layers 12] [--shard-mb 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_config(layers: int):
    """A ~0.5B-parameter language model (12 layers of width 1536) behind the tiny vision encoder."""
    from dhp.models.qwen2_5_vl.config import tiny

    cfg = tiny(vocab_size=32000)
    return replace(cfg, text=replace(cfg.text, hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers,
                                     num_attention_heads=12, num_key_value_heads=2, mrope_section=(16, 24, 24)),
                   vision=replace(cfg.vision, out_hidden_size=1536))


def write_checkpoint(ckpt: Path, layers: int) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    from dhp import checkpoint
    from dhp.models.registry import get_family

    cfg = bench_config(layers)
    family = get_family("qwen2_5_vl")
    total = 0
    for spec in family.modules:
        module = spec.build(cfg)
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        state = {"model": module.state_dict()}
        total += sum(t.numel() * t.element_size() for t in {id(t): t for t in state["model"].values()}.values())
        dcp.save(state, checkpoint_id=str(ckpt / spec.name), no_dist=True)
        del module, state
    checkpoint.finish(ckpt, {"step": 0, "config": {}, "family": family.name, "model": cfg.to_dict()})
    return total


def export_child(ckpt: str, out: str, shard_mb: int, layers: str) -> None:
    """Runs in a fresh process: export, then print the peak RSS above the baseline after imports."""
    from dhp import checkpoint
    from dhp.models.registry import get_family

    cfg = bench_config(int(layers))
    base = _vm("VmHWM")
    checkpoint.export_hf(Path(ckpt), Path(out), get_family("qwen2_5_vl"), cfg, max_shard_bytes=shard_mb * 2**20)
    print(json.dumps({"baseline_mb": base, "peak_mb": _vm("VmHWM")}))


def _vm(field: str) -> float:
    """A /proc/self/status figure in MB (VmHWM: this process's peak RSS; ru_maxrss would carry the parent's
    across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        export_child(args.child[0], args.child[1], int(args.child[2]), args.child[3])
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out = Path(tmp) / "ckpt", Path(tmp) / "hf"
        size = write_checkpoint(ckpt, args.layers)
        res = subprocess.run([sys.executable, __file__, "--child", str(ckpt), str(out), str(args.shard_mb),
                              str(args.layers)], capture_output=True, text=True, check=True, cwd=ROOT)
        got = json.loads(res.stdout.strip().splitlines()[-1])
        grown = got["peak_mb"] - got["baseline_mb"]
        files = sorted(p.name for p in out.glob("*.safetensors"))
        print(f"model: {size / 2**20:.0f} MB float32 ({size / 4 / 1e6:.0f} M parameters); "
              f"export shards of at most {args.shard_mb} MB: {len(files)} files")
        print(f"export process: peak RSS {got['peak_mb']:.0f} MB, {grown:.0f} MB above its baseline after imports "
              f"= {grown / (size / 2**20):.2f} x the model")


if __name__ == "__main__":
    main()
