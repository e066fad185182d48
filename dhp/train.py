"""The driver: resolve data, tokenizer and model, run the steps, log, evaluate, save.

The loop is the same for every backend. A backend owns the module engines
(in this process for ``local``, in Ray actor groups for ``ray``) and runs one
step from a ``StepPlan``; the driver only sees sample ids, scalars and timings.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from dhp.config import Config, ConfigError, dump_config
from dhp.data.llava import SFTDataset
from dhp.data.sampler import BatchPlanner, StepPlan
from dhp.data.tokenizer import Tokenizer
from dhp.engine import TextEngine, VisionEngine
from dhp.models.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLConfig, preset, read_hf_config, save_hf_checkpoint
from dhp.models.qwen2_5_vl.weights import load_hf_state_dict, load_into

# ---- what a run is made of ---------------------------------------------------------------------


@dataclass
class RunInputs:
    cfg: Config
    model_cfg: Qwen2_5_VLConfig
    tokenizer_dir: Path
    train_path: Path
    eval_path: Path | None
    init_state: dict[str, torch.Tensor] | None  # our-named weights from model.hf_path, or None (random init)


def resolve_inputs(cfg: Config) -> RunInputs:
    """Fill in the demo data set and tokenizer where the config leaves them unset."""
    data = cfg.data
    train_path = Path(data.path) if data.path else None
    eval_path = Path(data.eval_path) if data.eval_path else None
    tokenizer_dir = Path(data.tokenizer) if data.tokenizer else None
    if train_path is None:
        from dhp.data.demo import ensure_demo_dataset

        demo = ensure_demo_dataset()
        train_path, eval_path = demo / "train.jsonl", eval_path or demo / "eval.jsonl"
        tokenizer_dir = tokenizer_dir or demo / "tokenizer"
    if tokenizer_dir is None:
        if not cfg.model.hf_path:
            raise ConfigError("data.tokenizer: set it to a directory with tokenizer.json (or set model.hf_path)")
        tokenizer_dir = Path(cfg.model.hf_path)
    tok = Tokenizer(tokenizer_dir)
    tokens = {
        "image_token_id": tok.image_pad_id,
        "video_token_id": tok.video_pad_id,
        "vision_start_token_id": tok.vision_start_id,
        "vision_end_token_id": tok.vision_end_id,
    }
    init_state = None
    if cfg.model.hf_path:
        model_cfg = read_hf_config(cfg.model.hf_path)
        init_state = load_hf_state_dict(cfg.model.hf_path)
    elif cfg.model.preset == "tiny":
        from dhp.models.qwen2_5_vl.config import tiny

        model_cfg = tiny(vocab_size=64 * math.ceil(tok.vocab_size / 64), **tokens)
    else:
        model_cfg = preset(cfg.model.preset).with_tokens(**tokens)
    if tok.vocab_size > model_cfg.text.vocab_size:
        raise ConfigError(
            f"data.tokenizer: {tokenizer_dir} has {tok.vocab_size} tokens but the model's vocabulary has "
            f"{model_cfg.text.vocab_size}; use the model's own tokenizer"
        )
    for name, tid in tokens.items():
        if getattr(model_cfg, name) != tid:
            raise ConfigError(
                f"data.tokenizer: {tokenizer_dir} gives {name}={tid} but the model expects "
                f"{getattr(model_cfg, name)}; use the model's own tokenizer"
            )
    return RunInputs(cfg, model_cfg, tokenizer_dir, train_path, eval_path, init_state)


def module_state(state: dict[str, torch.Tensor] | None, prefix: str) -> dict[str, torch.Tensor] | None:
    """The part of an our-named state dict under ``prefix.`` with the prefix removed."""
    if state is None:
        return None
    return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}


# ---- backends ----------------------------------------------------------------------------------


@dataclass
class StepStats:
    loss: float  # global token mean
    supervised_tokens: int
    grad_norm: float
    lr: float
    timings: dict[str, float] = field(default_factory=dict)
    router_bytes: int = 0
    worker_memory_gb: float = 0.0  # peak over the workers (Ray backend)
    comm_bytes: dict[str, int] = field(default_factory=dict)  # "{group}_{collective}" -> bytes, all ranks


class Backend(Protocol):
    def run_step(self, plan: StepPlan) -> StepStats: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...  # whole-model, our names
    def shutdown(self) -> None: ...


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), at most 1; max_norm <= 0 disables."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


class LocalBackend:
    """The single-process reference: one vision engine and one text engine in this process."""

    def __init__(self, inputs: RunInputs, dataset: SFTDataset) -> None:
        cfg, mcfg = inputs.cfg, inputs.model_cfg
        self.cfg = cfg
        device = local_device(cfg.train.device)
        self.vision = VisionEngine(mcfg, cfg, dataset.get, device=device,
                                   state=module_state(inputs.init_state, "visual"))
        self.text = TextEngine(mcfg, cfg, dataset.get, device=device,
                               state=module_state(inputs.init_state, "language"))
        self.engines = [self.vision, self.text]

    def run_step(self, plan: StepPlan) -> StepStats:
        t = {"vision_forward": 0.0, "text_forward_backward": 0.0, "vision_backward": 0.0}
        loss_sum, n_sup = 0.0, 0
        for k, rnd in enumerate(plan.rounds):
            ids = rnd.sample_ids
            t0 = time.perf_counter()
            pieces = self.vision.forward(k, ids)
            t1 = time.perf_counter()
            loss, n, grads = self.text.forward_backward(ids, {i: [p] for i, p in pieces.items()})
            t2 = time.perf_counter()
            self.vision.backward(k, grads)
            t3 = time.perf_counter()
            loss_sum += loss
            n_sup += n
            t["vision_forward"] += t1 - t0
            t["text_forward_backward"] += t2 - t1
            t["vision_backward"] += t3 - t2
        return finish_step(self.cfg, self.engines, loss_sum, n_sup, t)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"visual.{k}": v for k, v in self.vision.state_dict().items()}
        out.update({f"language.{k}": v for k, v in self.text.state_dict().items()})
        return out

    def shutdown(self) -> None:
        pass


def local_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device; use train.device=cpu")
    return choice


def finish_step(cfg: Config, engines, loss_sum: float, n_sup: int, timings: dict[str, float]) -> StepStats:
    """Global token mean, one gradient norm over all modules, clipping, optimizer steps."""
    if n_sup == 0:
        raise RuntimeError("a global batch with no supervised token: check the data's assistant replies")
    for e in engines:
        e.finish_gradients(1.0 / n_sup)
    grad_norm = math.sqrt(sum(e.grad_norm_sq() for e in engines))
    coef = clip_coefficient(grad_norm, cfg.train.clip_grad_norm)
    lr = max(e.lr() for e in engines)
    for e in engines:
        e.step(coef)
    return StepStats(loss_sum / n_sup, n_sup, grad_norm, lr, timings)


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


def dataset_spec(cfg: Config, tokenizer_dir: Path, path: Path) -> dict:
    """What a worker needs to open the same data set and address samples by the same ids."""
    return {"data_cfg": replace(cfg.data, path=str(path)), "tokenizer_dir": str(tokenizer_dir), "path": str(path),
            "validated": None}


def open_dataset(spec: dict) -> SFTDataset:
    """The data set, validated when opened: a bad sample raises DataError naming file and sample
    (``data.on_error=raise``) or is dropped and counted (``skip``). With ``spec["validated"]`` (the
    driver's result, handed to workers) the image headers are not read again, and every worker
    indexes exactly the samples the driver planned with."""
    return SFTDataset(spec["data_cfg"], Tokenizer(spec["tokenizer_dir"]), path=spec["path"],
                      validated=spec["validated"])


def make_backend(inputs: RunInputs, dataset: SFTDataset, spec: dict) -> Backend:
    if inputs.cfg.runtime.backend == "local":
        for name in ("vision", "text"):
            p = getattr(inputs.cfg, name).parallel
            if (p.dp, p.sp, p.tp, p.zero) != (1, 1, 1, 0):
                raise ConfigError(
                    f"{name}.parallel: the local backend runs one process; set runtime.backend=ray for dp/sp/tp/zero"
                )
        return LocalBackend(inputs, dataset)
    from dhp.runtime.backend import RayBackend

    return RayBackend(inputs, spec)


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
    lengths = dataset.lengths()  # tokens per sample, for the plan and the per-step token count
    planner = BatchPlanner(
        lengths, cfg.train.global_batch_size, cfg.train.micro_batch_size,
        text_dp=cfg.text.parallel.dp, vision_dp=cfg.vision.parallel.dp, seed=cfg.train.seed,
    )
    print(f"dhp: {len(dataset)} training samples from {inputs.train_path} ({len(dataset.skipped)} skipped); "
          f"backend {cfg.runtime.backend}; output {out}", flush=True)
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
    model = Qwen2_5_VL(inputs.model_cfg)
    load_into(model, state, source="trained weights")
    summary = {"steps": cfg.train.steps, "time_s": elapsed, "final_loss": row["loss"],
               "skipped_samples": len(dataset.skipped), "output_dir": str(out)}
    if cfg.train.eval_at_end and inputs.eval_path is not None:
        from dhp.evaluate import evaluate

        eval_ds = open_dataset(dataset_spec(cfg, inputs.tokenizer_dir, inputs.eval_path))
        summary["eval"] = evaluate(model, eval_ds, tok, cfg.data.eval_samples, cfg.data.max_new_tokens)
    if cfg.output.save_final:
        final = out / "final"
        save_hf_checkpoint(model, final)
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
