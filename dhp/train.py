"""The driver: resolve data, tokenizer and model, run the steps, log, checkpoint, recover, evaluate, export.

The loop is the same for every backend and every model family. A backend owns
the module engines (in this process for ``local``, in Ray actor groups for
``ray``) and runs one step from a ``StepPlan``; the driver only sees sample ids,
scalars and timings. The model family is looked up by name (``dhp.models.registry``).

Durable state (``dhp/checkpoint.py``): every ``train.checkpoint_every`` steps, and at
the end, each group writes its own DCP shards; the driver writes a JSON record and a
completion marker. A run resumes from the newest complete checkpoint
(``train.resume=auto``) on any layout and either backend, and survives
``runtime.max_failures`` worker failures by restarting every group from it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dhp import checkpoint
from dhp.backends import make_backend
from dhp.backends.base import process_memory_gb
from dhp.config import Config, ConfigError, compute_dtype, dump_config
from dhp.data.lazy import LazyPlanner, lazy_planner, read_in_full
from dhp.data.sampler import StepPlan
from dhp.data.tokenizer import Tokenizer
from dhp.errors import CheckpointError, DataError, Interrupted
from dhp.inputs import dataset_spec, indexed_fingerprint, open_dataset, prepare, sample_flops
from dhp.observe.flops import Peak, mfu, run_peak
from dhp.observe.metrics_file import metric_rows
from dhp.observe.trace import TraceWriter, traced_steps
from dhp.runtime.errors import WorkerError
from dhp.storage import AnyPath, RunFiles, UrlPath, check_writable, download_dir, location, rmtree

# ---- logging -----------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl, and a progress bar on a terminal or plain lines otherwise.

    One row per step: a resumed run keeps the rows up to its checkpoint and replaces the rest."""

    def __init__(self, out_dir: Path, total: int, every: int, start_step: int = 0, tensorboard: bool = False) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.every = every
        self.file = None
        self.truncate(start_step)
        self.scalars = None
        if tensorboard:  # every metric also as TensorBoard scalars
            from dhp.observe.tensorboard import Scalars

            self.scalars = Scalars(out_dir / "tensorboard")
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def truncate(self, step: int) -> None:
        """Keep the rows of steps 1..``step`` (those a checkpoint covers), drop the later ones."""
        rows = []
        if step and self.path.is_file():
            rows = [line for line, row in metric_rows(self.path.read_text(), self.path) if row["step"] <= step]
        if self.file is not None:
            self.file.close()
        self.path.write_text("".join(r + "\n" for r in rows))
        self.file = self.path.open("a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.scalars is not None:
            self.scalars.write(row)
        short = (f"loss {row['loss']:.4f} lr {row['lr']:.2e} gnorm {row['grad_norm']:.3f} "
                 f"tok/s {row['tokens_per_s']:.0f}")
        mfu = [f"{k.removeprefix('mfu_')} {v:.1%}" for k, v in row.items() if k.startswith("mfu_")]
        if mfu:
            short += " mfu " + " ".join(mfu)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(short)
        elif row["step"] % self.every == 0 or row["step"] == 1:
            print(f"step {row['step']:>5} | {short} | mem {row['memory_gb']:.2f} GB", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.scalars is not None:
            self.scalars.close()
        self.file.close()


# ---- the output directory ----------------------------------------------------------------------

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "workers.json", "final", "checkpoints", "trace.json",
             "tensorboard")


def previous_run(out: AnyPath) -> list[str]:
    """What of an earlier run ``out`` holds."""
    return [name for name in RUN_FILES if (out / name).exists()]


def choose_start(cfg: Config, out: AnyPath) -> tuple[AnyPath, dict] | None:
    """The checkpoint to resume from, or None for a fresh start; refuses to overwrite another run silently.

    Decided before anything starts, so a refused run leaves nothing behind."""
    resume = cfg.train.resume
    if resume not in ("auto", "none"):
        ckpt = location(resume)  # a path or a URL
        try:
            found = ckpt, checkpoint.read_record(ckpt)
        except CheckpointError as e:
            raise CheckpointError(f"train.resume: {e}") from None
        earlier = previous_run(out)
        if not is_runs_own(ckpt, out) and earlier and not cfg.output.overwrite:
            raise ConfigError(f"output.dir: {out} holds another run ({', '.join(earlier)}) and train.resume={resume} "
                              "is not one of its checkpoints; choose another output.dir for the run that goes on "
                              "from it, or set output.overwrite=true to replace that run")
        return found
    if resume == "auto" and not cfg.output.overwrite:
        found = checkpoint.latest(out)
        if found is not None:
            return found
    earlier = previous_run(out)
    if earlier and not cfg.output.overwrite:
        if resume == "none":
            why, fixes = "train.resume=none", "train.resume=auto to continue it, "
        else:  # auto found nothing to continue
            why = ("it has no complete checkpoint to resume (the run stopped before writing one; "
                   "train.checkpoint_every=N writes them along the way)")
            fixes = ""
        raise ConfigError(f"output.dir: {out} holds another run ({', '.join(earlier)}) and {why}; set "
                          f"output.overwrite=true to replace it, {fixes}or choose another output.dir")
    return None


def is_runs_own(ckpt: AnyPath, out: AnyPath) -> bool:
    """Whether checkpoint ``ckpt`` is one of run ``out``'s own (``out/checkpoints/step_N``); otherwise a run that
    resumes from it is a new run (a branch) in ``out``."""
    run = ckpt.parent.parent
    if isinstance(run, UrlPath) or isinstance(out, UrlPath):
        return str(run).rstrip("/") == str(out).rstrip("/")
    return run.resolve() == Path(out).resolve()


def clear_previous_run(out: AnyPath) -> None:
    for name in RUN_FILES:
        p = out / name
        if isinstance(p, UrlPath):
            rmtree(p)
        elif p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


# ---- interrupts --------------------------------------------------------------------------------


class StopRequest:
    """Turns the first Ctrl-C / SIGTERM into a request to stop after the current step; a second Ctrl-C stops now."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.starting = True  # until the first step: a signal stops once every group is up, before any step
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def install(self) -> None:
        """(Re)install the handlers: entered before the backend starts, so a Ctrl-C while Ray and the workers
        come up never lands inside them; installed again once they are up (a library may have replaced them)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.signal(sig, self._handle)
                self._old.setdefault(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        when = "once the workers are up" if self.starting else "after this step"
        print(f"dhp: {signal.Signals(signum).name}: stopping {when} "
              "(Ctrl-C again to stop at once, without a checkpoint)", flush=True)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# ---- the run -----------------------------------------------------------------------------------


def layouts_of(cfg: Config) -> dict[str, dict]:
    return {m: dataclasses.asdict(c.parallel) for m, c in cfg.modules.items()}


def model_record(model_cfg: object) -> dict:
    d = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dataclasses.asdict(model_cfg)
    return json.loads(json.dumps(d))  # tuples as lists: what the JSON record reads back


class Run:
    """One training run: the backend (restarted on failure), the metrics, the checkpoints."""

    def __init__(self, cfg: Config, out: AnyPath) -> None:
        self.cfg, self.out = cfg, out
        self.files: RunFiles | None = None  # where the run's own files are written (staged for a URL)
        self.start_from = choose_start(cfg, out)
        prepared = prepare(cfg)  # inputs, validated data, the plan (each group balancing its own cost)
        self.inputs, self.dataset, self.dataset_spec, self.planner = (prepared.inputs, prepared.dataset, prepared.spec,
                                                              prepared.planner)
        self.planner = lazy_planner(self.planner, self.dataset, cfg)  # data.validate=lazy: media read before each step
        self.family = self.inputs.family
        self.lengths = self.dataset.lengths()  # tokens per sample, for the per-step token count
        self._init_observability()
        skipped = sorted({i.index for i in self.dataset.skipped})
        self.fingerprint = (checkpoint.data_fingerprint(self.inputs.train_path, len(self.dataset), skipped)
                            if Path(self.inputs.train_path).is_file() else indexed_fingerprint(self.dataset, skipped))
        self.record_base = {
            "seed": cfg.train.seed, "config": cfg.to_dict(), "family": self.family.name,
            "model": model_record(self.inputs.model_cfg), "layouts": layouts_of(cfg),
            "backend": cfg.runtime.backend, "data_path": str(self.inputs.train_path),
            "data_fingerprint": self.fingerprint, "num_samples": len(self.dataset), "skipped": skipped,
        }
        if self.start_from is not None:
            self._check_compatible(*self.start_from)
        self.backend = None
        self.save_seconds: list[float] = []

    def _check_compatible(self, ckpt: Path, record: dict) -> None:
        """Refuse a checkpoint of another model or data; name the schedule and data keys that differ and refuse
        them too unless ``train.resume_changes=allow``, then say in the log what changes from its step on."""
        found = checkpoint.compatibility(record, self.family.name, self.record_base["model"], self.fingerprint,
                                         self.cfg.to_dict(), str(self.inputs.train_path), len(self.dataset))
        if found.refused:
            raise CheckpointError(f"train.resume: {ckpt} cannot continue this run: "
                                  + "; ".join(map(str, found.refused)) + ". Resume with the same model and data, "
                                  "or start a new run (output.overwrite=true, or another output.dir)")
        if not found.changed:
            return
        changes = "; ".join(map(str, found.changed))
        step = record.get("step", 0)
        if self.cfg.train.resume_changes != "allow":
            raise ConfigError(f"train.resume_changes: {ckpt} (step {step}) was written with other settings: "
                              f"{changes}. Set train.resume_changes=allow to go on from step {step} with this "
                              "run's values (the learning-rate schedule is planned again over this run's keys), "
                              "give the checkpoint's values back, or start a new run (output.overwrite=true)")
        print(f"dhp: resuming {ckpt.name} with changed settings (train.resume_changes=allow): "
              + ", ".join(f"{c.what} {c.saved!r} -> {c.now!r}" for c in found.changed), flush=True)
        print(f"dhp: {self._lr_change(record, step)}", flush=True)

    def _lr_change(self, record: dict, step: int) -> str:
        """The learning rate of the next step under this run's schedule, beside the checkpoint's."""
        from dhp.config import config_from_dict
        from dhp.engine import lr_lambda

        t = self.cfg.train
        now = t.lr * lr_lambda(self.cfg)(step)
        text = f"from step {step + 1} of {t.steps}: learning rate {now:.3g}"
        try:
            old_cfg = config_from_dict(record["config"])
        except (ConfigError, KeyError, TypeError):
            return text + " (this run's schedule: warmup and cosine over train.steps)"
        old = old_cfg.train.lr * lr_lambda(old_cfg)(step)
        left = "" if step < old_cfg.train.steps else f"; it had ended at step {old_cfg.train.steps}"
        return text + f" (the checkpoint's schedule: {old:.3g}{left}), then this run's warmup and cosine"

    # -- backend lifecycle
    def start_backend(self, start: tuple[Path, dict] | None) -> int:
        """Start every group; load ``start``'s checkpoint if given. Returns the step the run goes on from."""
        if self.cfg.runtime.backend == "ray":
            from dhp.backends.ray_backend import resolve_worker_gpus

            self.inputs = resolve_worker_gpus(self.inputs)  # runtime.gpus_per_worker=auto: what the cluster has
        self._check_attention()
        print(f"dhp: starting the {self.cfg.runtime.backend} backend: {self._groups_text()}", flush=True)
        print(f"dhp: {self._precision_text()}", flush=True)
        self.backend = make_backend(self.inputs, self.dataset, self.dataset_spec)
        step = 0
        if start is not None:
            ckpt, record = start
            same = record["layouts"] == layouts_of(self.cfg) and record["backend"] == self.cfg.runtime.backend
            self.backend.load_checkpoint(ckpt, record["step"], same_layout=same)
            step = record["step"]
            print(f"dhp: resumed from {ckpt} (step {step}"
                  + ("" if same else f", written by another layout: {record['backend']} {record['layouts']}")
                  + ")", flush=True)
        return step

    def _device_type(self) -> str:
        """``cuda`` or ``cpu``: where the groups compute (Ray: ``runtime.gpus_per_worker`` as resolved)."""
        rt = self.inputs.cfg.runtime
        if rt.backend == "ray":
            return "cuda" if float(rt.gpus_per_worker) > 0 else "cpu"
        from dhp.backends.local import local_device

        return local_device(self.cfg.train.device).split(":")[0]

    def _precision_text(self) -> str:
        """``train.dtype`` as the groups' device resolves it (auto: bfloat16 on CUDA, float32 on the CPU), and
        ``train.precision``: what the weights and optimizer state are held in."""
        device, t = self._device_type(), self.cfg.train
        return (f"compute dtype {compute_dtype(t, device)} on {device} (train.dtype={t.dtype}), "
                f"train.precision={t.precision}")

    def _check_attention(self) -> None:
        """``train.attention=varlen`` where its kernels cannot run: a config error before any worker starts (the
        attention itself would stop at the first step, ``dhp.ops.attention.attention_kernel``)."""
        if self.cfg.train.attention != "varlen":
            return
        from dhp.ops.attention import varlen_unusable

        device = self._device_type()
        why = varlen_unusable(device, getattr(torch, compute_dtype(self.cfg.train, device)))
        if why is not None:
            raise ConfigError(f"train.attention=varlen: {why}; use train.attention=auto or sdpa"
                              + (" (or train.dtype=bfloat16)" if device == "cuda" else ""))

    def _groups_text(self) -> str:
        return groups_text(self.inputs.cfg, self.family.module_names)

    def write_workers(self) -> None:
        (self.files.local / "workers.json").write_text(json.dumps(self.backend.workers(), indent=2) + "\n")
        self.files.sync()

    def _carry_metrics(self, ckpt: AnyPath, record: dict) -> None:
        """A branch's metrics.jsonl starts with the rows of the run it goes on from, up to the checkpoint's step
        (where that run's metrics.jsonl is still beside its checkpoints): one history for ``dhp report``."""
        source = ckpt.parent.parent / "metrics.jsonl"
        if not source.exists():
            return
        rows = [line for line, row in metric_rows(source.read_text(), source) if row["step"] <= record["step"]]
        (self.files.local / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))

    # -- checkpoints
    def save(self, step: int, epoch: int) -> Path:
        ckpt = checkpoint.step_dir(self.out, step)
        if ckpt.exists():
            rmtree(ckpt) if isinstance(ckpt, UrlPath) else shutil.rmtree(ckpt)
        t0 = time.perf_counter()
        per_group = self.backend.save_checkpoint(ckpt)
        checkpoint.finish(ckpt, {**self.record_base, "step": step, "epoch": epoch,
                                 "save_seconds": per_group})
        blocked = time.perf_counter() - t0
        self.save_seconds.append(blocked)
        removed = checkpoint.prune(self.out, self.cfg.train.keep_checkpoints)
        self.files.sync()  # a URL output.dir gets the metrics up to this checkpoint
        print(f"dhp: checkpoint {ckpt} (step {step}) written in {blocked:.2f} s"
              + (f"; removed {', '.join(p.name for p in removed)}" if removed else ""), flush=True)
        return ckpt

    # -- the loop
    def execute(self) -> dict:
        cfg, out = self.cfg, self.out
        steps = cfg.train.steps
        stop = StopRequest().__enter__()  # before Ray and the workers start: a Ctrl-C never lands inside them
        try:
            step = self.start_backend(self.start_from)
        except BaseException:
            stop.__exit__()
            raise
        stop.install()
        stop.starting = False
        if stop.signum is not None:  # stopped while the groups came up: leave before output.dir is touched
            self.backend.shutdown()
            stop.__exit__()
            ckpt = self.start_from[0] if self.start_from is not None else None
            raise Interrupted(stop.signum, self._interrupted_message(stop.signum, step, ckpt))
        try:
            branch = self.start_from is not None and not is_runs_own(self.start_from[0], out)
            if self.start_from is None or branch:  # a new run in output.dir (a branch: from another run's step)
                out.mkdir(parents=True, exist_ok=True)
                clear_previous_run(out)
            self.files = RunFiles(out)
            if branch:
                self._carry_metrics(*self.start_from)
            elif self.start_from is not None:
                self.files.pull("metrics.jsonl")  # the rows up to the checkpoint, from a URL output.dir
            dump_config(cfg, self.files.local / "config.yaml")
            self.write_workers()
            print(f"dhp: {len(self.dataset)} training samples from {self.inputs.train_path} "
                  f"({len(self.dataset.skipped)} skipped); model {self.family.name}; output {out}", flush=True)
            metrics = MetricsLog(self.files.local, steps, cfg.train.log_every, start_step=step,
                                 tensorboard=cfg.output.tensorboard)
            steps_traced = traced_steps(cfg.output.trace_steps)
            self.trace = TraceWriter(self.files.local / "trace.json", list(self.family.module_names), steps_traced) \
                if steps_traced else None
            if step >= steps:
                print(f"dhp: {out} is already at step {step} of train.steps={steps}: nothing to train (raise "
                      "train.steps to continue, or set output.overwrite=true to start again)", flush=True)
            rows: list[dict] = []
            last_ckpt = None
            failures = 0
            start = time.perf_counter()
            with stop:
                while step < steps and stop.signum is None:
                    plan = self._plan(step)
                    try:
                        row = self._step(plan, step)
                    except WorkerError as e:
                        e.step = step + 1
                        if failures >= cfg.runtime.max_failures:
                            raise
                        failures += 1
                        step = self._recover(e, failures, metrics)
                        continue
                    step += 1
                    metrics.write(row)
                    rows.append(row)
                    if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and step < steps:
                        last_ckpt = self.save(step, plan.epoch)
                if stop.signum is not None:
                    if self.start_from is not None and not rows:
                        last_ckpt = self.start_from[0]  # stopped before a step: the checkpoint it started from
                    elif cfg.train.checkpoint_on_exit and step > 0:
                        last_ckpt = self.save(step, self.planner.plan(step - 1).epoch)
                    raise Interrupted(stop.signum, self._interrupted_message(stop.signum, step, last_ckpt))
            if self.start_from is not None and step == self.start_from[1]["step"] and not rows:
                last_ckpt = self.start_from[0]  # nothing new since the checkpoint we started from
            elif step > 0:
                last_ckpt = self.save(step, self.planner.plan(step - 1).epoch)
            metrics.close()
        except BaseException:
            if self.files is not None:
                self._sync_files()
                self.files.close()
                self.files = None
            raise
        finally:
            stop.__exit__()
            self.backend.shutdown()
            if isinstance(self.planner, LazyPlanner):
                self.planner.close()
        try:
            return self.finish(rows, last_ckpt, time.perf_counter() - start, failures)
        finally:
            self._sync_files()  # metrics, trace, summary: to a URL output.dir
            self.files.close()

    def _sync_files(self) -> None:
        """Upload the staged run files to a URL output.dir; a failure here is reported, never hides the run's own."""
        if self.files is None:
            return
        try:
            self.files.sync()
        except Exception as e:  # noqa: BLE001 - any storage error: say it, keep the run's outcome
            print(f"dhp: could not upload the run's files to {self.out}: {type(e).__name__}: {e}", flush=True)

    def _plan(self, step: int) -> StepPlan:
        """Step ``step``'s plan. A sample found bad before it (``data.validate=lazy``, ``data.on_error=raise``)
        stops the run after a checkpoint of the steps so far (``train.checkpoint_on_exit``), named in the error."""
        try:
            return self.planner.plan(step)
        except DataError as e:
            if not (isinstance(self.planner, LazyPlanner) and step > 0 and self.cfg.train.checkpoint_on_exit):
                raise
            found = checkpoint.latest(self.out)
            ckpt = found[0] if found is not None and found[1]["step"] == step else \
                self.save(step, self.planner.step_ids(step - 1)[0])
            raise DataError(f"{e}\ncheckpoint {ckpt} holds the run up to step {step}: fix the file (or set "
                            "data.on_error=skip) and run the same command to resume there", e.issues) from None

    def skipped_samples(self) -> int:
        """The samples skipped so far: those validation dropped, and those found bad before their step
        (``data.validate=lazy``)."""
        lazily = len(self.planner.skipped) if isinstance(self.planner, LazyPlanner) else 0
        return len(self.dataset.skipped) + lazily

    # -- observability: model FLOPs per sample, the peak MFU is measured against, the timeline
    def _init_observability(self) -> None:
        from dhp.engine import encoder_trains

        if self.cfg.output.tensorboard:
            from dhp.observe.tensorboard import require_tensorboard

            require_tensorboard()  # before anything starts
        trains = {e.name: encoder_trains(self.cfg, e) for e in self.family.encoders}
        self.sample_flops = sample_flops(self.family, self.inputs.model_cfg, self.dataset, trains)  # (kept: index)
        self.peaks: dict[str, Peak | None] | None = None  # per module, known after the first step
        self.trace: TraceWriter | None = None

    def _mfu(self, plan, stats, dt: float) -> dict[str, float]:
        if not self.sample_flops or not stats.devices:
            return {}
        if self.peaks is None:
            self.peaks = {}
            for m, dev in stats.devices.items():
                gpu = dev.get("device_name", "cpu") != "cpu"
                self.peaks[m] = run_peak(gpu, dev.get("device_name"), self.cfg.runtime.peak_tflops,
                                         int(dev.get("threads", 1)))
            labels = sorted({p.label for p in self.peaks.values() if p is not None})
            if labels:
                print(f"dhp: MFU (mfu_<module>) against the {'; '.join(labels)}", flush=True)
        out = {}
        for m, per_sample in self.sample_flops.items():
            flops = sum(per_sample[i] for i in plan.sample_ids)
            out[f"model_flops_{m}"] = flops
            peak = self.peaks.get(m)
            if peak is not None and m in stats.devices:
                out[f"mfu_{m}"] = mfu(flops, dt, int(stats.devices[m].get("ranks", 1)), peak.flops)
        return out

    def _upcoming(self, step: int) -> StepPlan | None:
        """Step ``step + 1``'s plan as the loaders' hint during step ``step`` (None after the last step). A lazily
        validated run hints its unvalidated plan: a sample found bad there is swapped in the real plan, and the
        swapped-in one is loaded when its step takes it."""
        if step + 1 >= self.cfg.train.steps:
            return None
        planner = self.planner.planner if isinstance(self.planner, LazyPlanner) else self.planner
        return planner.plan(step + 1)

    def _step(self, plan, step: int) -> dict:
        t0 = time.perf_counter()
        stats = self.backend.run_step(plan, self._upcoming(step))
        dt = time.perf_counter() - t0
        tokens = sum(self.lengths[i] for i in plan.sample_ids)
        row = {
            "step": step + 1, "epoch": plan.epoch, "loss": stats.loss, "lr": stats.lr,
            "grad_norm": stats.grad_norm, "tokens": tokens, "supervised_tokens": stats.supervised_tokens,
            "samples": len(plan.sample_ids), "step_time_s": dt, "tokens_per_s": tokens / dt,
            "samples_per_s": len(plan.sample_ids) / dt,
            "memory_gb": max(process_memory_gb(), stats.worker_memory_gb),
            **{f"memory_gb_{m}": v for m, v in stats.memory_gb_by_module.items()},
            "skipped_samples": self.skipped_samples(),
            **{f"time_{k}_s": v for k, v in stats.timings.items()},
            **{f"imbalance_{m}": v for m, v in stats.imbalance.items()},
        }
        if stats.router_bytes:
            row["router_bytes"] = stats.router_bytes
            row.update({f"router_bytes_{d}": v for d, v in stats.router_bytes_by_direction.items()})
        row.update({f"comm_{k}_bytes": v for k, v in stats.comm_bytes.items()})
        row.update({f"busy_{m}": v for m, v in stats.busy_fraction.items()})
        row.update(self._mfu(plan, stats, dt))
        if self.trace is not None and self.trace.wants(step + 1):
            self.trace.add_step(step + 1, stats.spans)
        return row

    def _recover(self, error: WorkerError, failures: int, metrics: MetricsLog) -> int:
        """Tear every group down, start fresh ones, resume from the newest complete checkpoint."""
        first_line = str(error).splitlines()[-1] if str(error).strip() else type(error).__name__
        print(f"dhp: step {error.step}: {error.module} rank {error.rank} {error.what} ({first_line}); "
              f"restarting every group (failure {failures} of runtime.max_failures="
              f"{self.cfg.runtime.max_failures})", flush=True)
        self.backend.shutdown()
        found = checkpoint.latest(self.out)
        if found is not None:
            self._check_compatible(*found)
        step = self.start_backend(found)  # no checkpoint yet: a fresh start from the same seed
        self.write_workers()
        metrics.truncate(step)
        return step

    def _interrupted_message(self, signum: int, step: int, ckpt: Path | None) -> str:
        cmd = "dhp train ... (the same config and overrides)"
        if sys.argv[0].endswith("dhp"):
            cmd = " ".join(shlex.quote(a) for a in ["dhp", *sys.argv[1:]])
        name = signal.Signals(signum).name
        if step == 0 and ckpt is None:
            return f"stopped by {name} before the first step; nothing to resume. Start again with: {cmd}"
        saved = f"checkpoint {ckpt} (step {step})" if ckpt is not None else "no checkpoint"
        return (f"stopped by {name} after step {step}; {saved}. Resume with the same command "
                f"(train.resume=auto): {cmd}")

    # -- the end
    def finish(self, rows: list[dict], ckpt: Path | None, elapsed: float, failures: int) -> dict:
        cfg, out, family, inputs = self.cfg, self.out, self.family, self.inputs
        warm = rows[1:] or rows
        summary = {
            "steps": cfg.train.steps, "steps_this_run": len(rows), "time_s": elapsed,
            "final_loss": rows[-1]["loss"] if rows else None,
            "tokens_per_s_after_warmup": (sum(r["tokens"] for r in warm) / sum(r["step_time_s"] for r in warm))
            if warm else None,
            "peak_memory_gb": {m: max((r.get(f"memory_gb_{m}", 0.0) for r in rows), default=0.0)
                               for m in family.module_names},
            "layout": {"backend": cfg.runtime.backend, "placement": cfg.runtime.placement, **layouts_of(cfg)},
            "skipped_samples": self.skipped_samples(), "failures_survived": failures,
            "checkpoint_save_s": self.save_seconds, "output_dir": str(out),
        }
        if ckpt is not None:
            summary["last_checkpoint"] = str(ckpt)
        final = out / "final"
        wants_eval = cfg.train.eval_at_end and inputs.eval_path is not None and cfg.data.eval_samples > 0
        if (cfg.output.save_final or wants_eval) and ckpt is not None:
            print(f"dhp: exporting {ckpt.name} to {final} (Hugging Face safetensors, shard by shard)", flush=True)
            checkpoint.export_hf(ckpt, final, family, inputs.model_cfg, inputs.tokenizer_dir,
                                 source_dir=checkpoint.source_dir(cfg))
            summary["checkpoint"] = str(final)
        if cfg.train.eval_at_end and inputs.eval_path is None:
            print("dhp: no data.eval_path: evaluation skipped", flush=True)
        elif cfg.train.eval_at_end and cfg.data.eval_samples == 0:
            print("dhp: data.eval_samples=0: evaluation skipped", flush=True)
        if wants_eval and "checkpoint" in summary:
            from dhp.evaluate import evaluate

            model = family.full_model(inputs.model_cfg, _load_exported(family, final))  # the driver holds it for eval
            eval_ds = open_dataset(read_in_full(dataset_spec(inputs, inputs.eval_path)))  # (no step reads it)
            summary["eval"] = evaluate(model, eval_ds, Tokenizer(inputs.tokenizer_dir), cfg.data.eval_samples,
                                       cfg.data.max_new_tokens)
        if not cfg.output.save_final and final.exists() and "checkpoint" in summary:
            rmtree(final) if isinstance(final, UrlPath) else shutil.rmtree(final)  # exported only to evaluate
            del summary["checkpoint"]
        (self.files.local / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print_summary(summary)
        return summary


def _load_exported(family: object, final: AnyPath) -> dict:
    """The exported weights, read back (a URL's export is downloaded to a temporary directory first)."""
    if not isinstance(final, UrlPath):
        return family.weights.load_hf(final)
    with tempfile.TemporaryDirectory(prefix="dhp-eval-") as d:
        return family.weights.load_hf(download_dir(final, Path(d)))


def groups_text(cfg: Config, modules: tuple[str, ...] | list[str]) -> str:
    """Each group's layout, device and collective backend, for the start line:
    ``vision sp2 on cuda (nccl, 1 GPU per worker), text tp2 on cuda (nccl, 1 GPU per worker); disaggregated``.
    ``runtime.gpus_per_worker`` is a number by then (``auto`` resolved against the cluster)."""
    rt = cfg.runtime
    if rt.backend == "ray":
        gpus = float(rt.gpus_per_worker)
        where = (f"cuda (nccl, {gpus:g} GPU per worker)" if gpus > 0 else
                 f"cpu (gloo, {rt.cpus_per_worker:g} CPU per worker)")
    else:
        from dhp.backends.local import local_device

        where = f"{local_device(cfg.train.device)} (one process)"
    return ", ".join(f"{m} {layout_text(cfg, m)} on {where}" for m in modules) \
        + ("" if rt.backend == "local" else f"; {rt.placement}")


def layout_text(cfg: Config, m: str) -> str:
    """``dp2xsp2 zero1``, ``tp2``, ``single``: a group's layout in one word."""
    p = cfg.module(m).parallel
    parts = [f"{k}{getattr(p, k)}" for k in ("dp", "sp", "tp") if getattr(p, k) > 1]
    return "x".join(parts or ["single"]) + (f" zero{p.zero}" if p.zero else "")


def train(cfg: Config) -> dict:
    """Run training as configured; returns the summary (also written to output.dir/summary.json)."""
    torch.manual_seed(cfg.train.seed)
    out = location(cfg.output.dir)  # a local path, or a URL (s3://, gs://: dhp/storage.py)
    check_writable(out)
    return Run(cfg, out).execute()


def print_summary(summary: dict) -> None:
    loss = summary["final_loss"]
    ran = summary["steps_this_run"]
    steps = (f"{summary['steps']} steps" if ran == summary["steps"]
             else f"step {summary['steps']} ({ran} step{'s' if ran != 1 else ''} this run, after a resume)")
    print(f"dhp: done, {steps} in {summary['time_s']:.1f} s"
          + (f", final loss {loss:.4f}" if loss is not None else "")
          + (f", {summary['tokens_per_s_after_warmup']:.0f} tokens/s after the first step"
             if summary.get("tokens_per_s_after_warmup") else ""))
    mem = ", ".join(f"{m} {v:.2f} GB" for m, v in summary["peak_memory_gb"].items() if v)
    if mem:
        print(f"dhp: peak memory per group: {mem}")
    if summary["skipped_samples"]:
        print(f"dhp: {summary['skipped_samples']} samples skipped (data.on_error=skip)")
    if summary["failures_survived"]:
        print(f"dhp: survived {summary['failures_survived']} worker failure(s)")
    if "eval" in summary:
        e = summary["eval"]
        print(f"dhp: eval exact-match {e['accuracy']:.3f} on {e['samples']} held-out samples "
              f"(eval loss {e['loss']:.4f})")
    if "last_checkpoint" in summary:
        print(f"dhp: last checkpoint {summary['last_checkpoint']}")
    if "checkpoint" in summary:
        print(f"dhp: Hugging Face checkpoint in {summary['checkpoint']}")
