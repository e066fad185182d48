"""Host memory of starting a model: one text rank under tp 2, and the driver, with and without shard-local loading.

Why: a rank that builds its whole module in float32 before sharding it needs the whole model's memory
(131 GB per rank for Qwen2.5-VL-32B's language model); a driver that reads the checkpoint needs the whole
checkpoint. Since issue 9 a rank builds on the meta device, parallelizes there, ``to_empty``s its own
shards and reads only its slices of the safetensors files (``dhp.engine.materialize``,
``dhp.parallel.materialize``); the driver reads config.json and the index.

Cases (each a fresh subprocess, peak = ``VmHWM`` of /proc/self/status, ``base`` = RSS just before building):

- ``rank_load_tp2``: 2 gloo ranks, the text module of a Qwen2.5-1.5B-sized language model (1.54 B parameters,
  tied embeddings) built on meta, TP 2, loaded from a bf16 HF checkpoint; every rank's peak;
- ``rank_init_tp2``: the same, from the shard-local random init;
- ``rank_load_old``: what a rank did before (one process, no TP): the whole module built in float32,
  initialised, the checkpoint's text tensors read whole, ``load_state_dict`` (a lower bound of the old per-rank
  peak under TP 2, which then also made the sharded copies);
- ``driver``: ``resolve_inputs`` from ``model.hf_path`` for a small and the large checkpoint, now and with the
  old driver line (``family.weights.load_hf``) added, its tensors read once (as shipping them to workers did).

    python benchmarks/load_memory.py [--out outputs/bench/load_memory.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30


def text_config(size: str):
    """Qwen2.5-1.5B's language model dimensions ("large"), or a small one; the tiny vision tower."""
    from dhp.models.qwen2_5_vl.config import TextConfig

    if size == "large":
        return TextConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    return TextConfig(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, mrope_section=(8, 12, 12),
                      tie_word_embeddings=True)


def model_config(size: str, tokenizer_dir: Path):
    from dhp.data.tokenizer import Tokenizer
    from dhp.models.qwen2_5_vl.config import tiny
    from dhp.models.qwen2_5_vl.processor import vision_token_ids

    base = tiny(**vision_token_ids(Tokenizer(tokenizer_dir)))
    text = text_config(size)
    return replace(base, vision=replace(base.vision, out_hidden_size=text.hidden_size), text=text)


def write_checkpoint(cfg, out: Path, shard_bytes: int = GIB) -> int:
    """A random bf16 HF checkpoint of ``cfg`` written tensor by tensor (never the whole model in memory)."""
    from safetensors.torch import save_file

    from dhp.models.qwen2_5_vl.model import Qwen2_5_VL
    from dhp.models.qwen2_5_vl.weights import WEIGHTS
    from dhp.parallel.materialize import INDEX_FILE

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict() | {"dtype": "bfloat16"}, indent=2))
    with torch.device("meta"):
        model = Qwen2_5_VL(cfg)
    names = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied weights once
    g = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map, total = 0, [], {}, 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for n, shape in names:
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        shard.update(WEIGHTS.to_hf(n, t, cfg))  # fused q/k/v and gate/up: their HF parts
        size += t.numel() * 2
        total += t.numel()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total * 2}, "weight_map": weight_map}))
    return total


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status("VmRSS")


def peak() -> int:
    return _status("VmHWM")


def _text_params(module) -> tuple[int, int]:
    from dhp.parallel.tensor import local_tensor

    ps = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() for p in ps), sum(local_tensor(p).numel() for p in ps)


# ---- cases (run in their own process) ------------------------------------------------------------------------
def _rank_worker(rank: int, world_size: int, ckpt: str, how: str) -> dict[str, Any]:
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh

    from dhp.engine import materialize
    from dhp.models.qwen2_5_vl.family import FAMILY
    from dhp.models.qwen2_5_vl.weights import read_hf_config
    from dhp.models.spec import ParallelizeOptions
    from dhp.parallel.tensor import local_tensor

    cfg = read_hf_config(ckpt)
    spec = FAMILY.language
    mesh = DeviceMesh("cpu", list(range(world_size)))
    par = SimpleNamespace(inner_kind="tp", mesh={"tp": mesh}, spec=SimpleNamespace(tp=world_size))
    base = rss()
    t0 = time.perf_counter()
    with torch.device("meta"):
        module = spec.build(cfg)
    spec.parallelize(module, par, ParallelizeOptions())
    materialize(spec, module, cfg, "cpu", 0, None, par, hf_path=ckpt if how == "load" else None)
    seconds = time.perf_counter() - t0
    full, local = _text_params(module)
    return {"base": base, "peak": peak(), "seconds": seconds, "params": full, "local_params": local,
            "checksum": float(local_tensor(module.norm.weight).double().sum())}


def case_rank(ckpt: str, how: str) -> dict[str, Any]:
    from tests.spawn import run_distributed

    return {"ranks": run_distributed(_rank_worker, 2, ckpt, how, timeout_s=600)}


def case_rank_old(ckpt: str) -> dict[str, Any]:
    """The path before issue 9: the whole module in float32, initialised, the checkpoint read whole, loaded."""
    from dhp.models.qwen2_5_vl.family import FAMILY
    from dhp.models.qwen2_5_vl.vision import init_weights
    from dhp.models.qwen2_5_vl.weights import load_hf_state_dict, read_hf_config

    cfg = read_hf_config(ckpt)
    base = rss()
    t0 = time.perf_counter()
    module = FAMILY.language.build(cfg)
    torch.manual_seed(1)
    init_weights(module, 0.02)
    with torch.device("meta"):
        keys = ["language." + k for k in FAMILY.language.build(cfg).state_dict()]
    state = load_hf_state_dict(ckpt, keys)
    module.load_state_dict({k.removeprefix("language."): v for k, v in state.items()}, strict=False)
    seconds = time.perf_counter() - t0
    full, _ = _text_params(module)
    return {"base": base, "peak": peak(), "seconds": seconds, "params": full}


def case_driver(ckpt: str, data: str, old: bool) -> dict[str, Any]:
    from dhp.config import load_config
    from dhp.inputs import resolve_inputs

    demo = Path(data)
    cfg = load_config(None, [f"model.hf_path={ckpt}", f"data.path={demo / 'train.jsonl'}",
                             f"data.tokenizer={demo / 'tokenizer'}", "runtime.backend=local"])
    base = rss()
    inputs = resolve_inputs(cfg)
    if old:  # the driver line before issue 9; its tensors are file-backed until read, and shipping them to the
        # workers (Ray's object store) reads every byte: touch each once, as that serialisation would
        state = inputs.family.weights.load_hf(cfg.model.hf_path)
        for t in state.values():
            t.view(-1)[:: max(1, 4096 // t.element_size())].sum()  # one element per page
    return {"base": base, "peak": peak(), "driver_read_weights": old}


def run_case(*args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)
    if done.returncode:
        raise RuntimeError(f"case {args} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bench/load_memory.json")
    ap.add_argument("--keep", default=None, help="write the checkpoints and data here (and reuse them)")
    ap.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        kind, *rest = args.case
        result = {"rank": lambda: case_rank(rest[0], rest[1]), "rank_old": lambda: case_rank_old(rest[0]),
                  "driver": lambda: case_driver(rest[0], rest[1], rest[2] == "old")}[kind]()
        print(json.dumps(result))
        return

    from dhp.data.demo import make_demo_dataset

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dhp-load-memory-"))
    t0 = time.perf_counter()
    data = root / "demo"
    if not (data / "train.jsonl").exists():
        make_demo_dataset(data, seed=0, n_train=16, n_eval=4)
    ckpts, sizes = {}, {}
    for size in ("small", "large"):
        ckpts[size] = root / f"ckpt_{size}"
        cfg = model_config(size, data / "tokenizer")
        if not (ckpts[size] / "config.json").exists():
            write_checkpoint(cfg, ckpts[size])
        sizes[size] = sum(f.stat().st_size for f in ckpts[size].glob("*.safetensors"))
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in sizes.items()), flush=True)

    large = str(ckpts["large"])
    results: dict[str, Any] = {"checkpoint_bytes": sizes}
    results["rank_load_tp2"] = run_case("rank", large, "load")
    results["rank_init_tp2"] = run_case("rank", large, "init")
    results["rank_load_old"] = run_case("rank_old", large)
    for size in ("small", "large"):
        for mode in ("new", "old"):
            results[f"driver_{size}_{mode}"] = run_case("driver", str(ckpts[size]), str(data), mode)

    params = results["rank_load_old"]["params"]
    full_bytes = params * 4
    print(f"\ntext module: {params / 1e9:.2f} B parameters, float32 {full_bytes / GIB:.2f} GiB "
          f"(2-core CPU machine, {torch.__version__})")
    print(f"{'case':<28}{'peak GiB':>10}{'base GiB':>10}{'peak/full':>11}{'(peak-base)/full':>18}{'s':>7}")
    rows = [(f"{k} rank {i}", r) for k in ("rank_load_tp2", "rank_init_tp2") for i, r in
            enumerate(results[k]["ranks"])] + [("rank_load_old", results["rank_load_old"])]
    for name, r in rows:
        print(f"{name:<28}{r['peak'] / GIB:>10.2f}{r['base'] / GIB:>10.2f}{r['peak'] / full_bytes:>11.2f}"
              f"{(r['peak'] - r['base']) / full_bytes:>18.2f}{r['seconds']:>7.1f}")
    print(f"\n{'driver (resolve_inputs)':<28}{'ckpt GiB':>10}{'peak GiB':>10}{'peak-base':>11}")
    for size in ("small", "large"):
        for mode in ("new", "old"):
            r = results[f"driver_{size}_{mode}"]
            print(f"{size + ' ' + mode:<28}{sizes[size] / GIB:>10.2f}{r['peak'] / GIB:>10.2f}"
                  f"{(r['peak'] - r['base']) / GIB:>11.2f}")
    results["text_params"], results["full_fp32_bytes"] = params, full_bytes
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
