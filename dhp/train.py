"""The driver: resolve data, tokenizer and model, run the steps, log, evaluate, save.

The loop is the same for every backend and every model family. A backend owns
the module engines (in this process for ``local``, in Ray actor groups for
``ray``) and runs one step from a ``StepPlan``; the driver only sees sample ids,
scalars and timings. The model family is looked up by name (``dhp.models.registry``).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dhp.backends import make_backend
from dhp.config import Config, ConfigError, dump_config
from dhp.data.tokenizer import Tokenizer
from dhp.inputs import dataset_spec, make_planner, open_dataset, resolve_inputs

# ---- logging -----------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl, and a progress bar on a terminal or plain lines otherwise."""

    def __init__(self, out_dir: Path, total: int, every: int) -> None:
        self.file = (out_dir / "metrics.jsonl").open("w")
        self.every = every
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        short = (f"loss {row['loss']:.4f} lr {row['lr']:.2e} gnorm {row['grad_norm']:.3f} "
                 f"tok/s {row['tokens_per_s']:.0f}")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(short)
        elif row["step"] % self.every == 0 or row["step"] == 1:
            print(f"step {row['step']:>5} | {short} | mem {row['memory_gb']:.2f} GB", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS of the driver (kB -> GB)


# ---- the run -----------------------------------------------------------------------------------


def train(cfg: Config) -> dict:
    """Run training as configured; returns the summary (also written to output.dir/summary.json)."""
    torch.manual_seed(cfg.train.seed)
    inputs = resolve_inputs(cfg)
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / "config.yaml")
    tok = Tokenizer(inputs.tokenizer_dir)
    spec = dataset_spec(cfg, inputs.tokenizer_dir, inputs.train_path)
    dataset = open_dataset(spec)
    spec["validated"] = dataset.validation  # workers reuse it instead of reading every image header again
    lengths = dataset.lengths()  # tokens per sample, for the per-step token count
    planner = make_planner(inputs, dataset)  # each group balances its own cost
    print(f"dhp: {len(dataset)} training samples from {inputs.train_path} ({len(dataset.skipped)} skipped); "
          f"model {inputs.family.name} ({', '.join(inputs.family.module_names)}); backend {cfg.runtime.backend}; "
          f"output {out}", flush=True)
    backend = make_backend(inputs, dataset, spec)
    metrics = MetricsLog(out, cfg.train.steps, cfg.train.log_every)
    start = time.perf_counter()
    try:
        for step in range(cfg.train.steps):
            plan = planner.plan(step)
            t0 = time.perf_counter()
            stats = backend.run_step(plan)
            dt = time.perf_counter() - t0
            tokens = sum(lengths[i] for i in plan.sample_ids)
            row = {
                "step": step + 1, "epoch": plan.epoch, "loss": stats.loss, "lr": stats.lr,
                "grad_norm": stats.grad_norm, "tokens": tokens, "supervised_tokens": stats.supervised_tokens,
                "samples": len(plan.sample_ids), "step_time_s": dt, "tokens_per_s": tokens / dt,
                "samples_per_s": len(plan.sample_ids) / dt,
                "memory_gb": max(memory_gb(), stats.worker_memory_gb),
                "skipped_samples": len(dataset.skipped),
                **{f"time_{k}_s": v for k, v in stats.timings.items()},
                **{f"imbalance_{m}": v for m, v in stats.imbalance.items()},
            }
            if stats.router_bytes:
                row["router_bytes"] = stats.router_bytes
            row.update({f"comm_{k}_bytes": v for k, v in stats.comm_bytes.items()})
            metrics.write(row)
        state = backend.state_dict()
    finally:
        metrics.close()
        backend.shutdown()
    elapsed = time.perf_counter() - start
    summary = {"steps": cfg.train.steps, "time_s": elapsed, "final_loss": row["loss"],
               "skipped_samples": len(dataset.skipped), "output_dir": str(out)}
    family = inputs.family
    wants_model = (cfg.train.eval_at_end and inputs.eval_path is not None) or cfg.output.save_final
    if wants_model and family.full_model is None:
        raise ConfigError(f"model family {family.name} has no whole model for evaluation and export; set "
                          "train.eval_at_end=false and output.save_final=false")
    model = family.full_model(inputs.model_cfg, state) if wants_model else None
    if cfg.train.eval_at_end and inputs.eval_path is not None:
        from dhp.evaluate import evaluate

        eval_ds = open_dataset(dataset_spec(cfg, inputs.tokenizer_dir, inputs.eval_path))
        summary["eval"] = evaluate(model, eval_ds, tok, cfg.data.eval_samples, cfg.data.max_new_tokens)
    if cfg.output.save_final:
        final = out / "final"
        family.save_hf(model, final)
        for f in inputs.tokenizer_dir.glob("tokenizer*.json"):
            shutil.copy(f, final / f.name)
        summary["checkpoint"] = str(final)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    return summary


def print_summary(summary: dict) -> None:
    print(f"dhp: done, {summary['steps']} steps in {summary['time_s']:.1f} s, final loss {summary['final_loss']:.4f}")
    if summary["skipped_samples"]:
        print(f"dhp: {summary['skipped_samples']} samples skipped (data.on_error=skip)")
    if "eval" in summary:
        e = summary["eval"]
        print(f"dhp: eval exact-match {e['accuracy']:.3f} on {e['samples']} held-out samples "
              f"(eval loss {e['loss']:.4f})")
    if "checkpoint" in summary:
        print(f"dhp: Hugging Face checkpoint in {summary['checkpoint']}")
