"""The ``dhp`` command: train, info, data (demo, check), export, bench, report, plan.

Each subcommand parses its flags here and calls one function of the layer below (``dhp.train``,
``dhp.checkpoint``, ``dhp.bench``, ``dhp.plan.command``, ``dhp.observe.report``); nothing here trains.

Errors: a mistake the user can fix (``dhp.errors``: config, data, model or
checkpoint) is one ``dhp: ...`` line naming the key or file and the fix, with
an exit code per class (``EXIT_CODES``); a failed Ray worker is one paragraph
(module, rank, method, step, the worker's own error line). ``--debug`` or
``DHP_DEBUG=1`` adds the traceback, and lets Ray's startup messages through.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import re
import signal
import sys
import textwrap
import threading
import traceback
from importlib import resources
from pathlib import Path

from dhp.config import ConfigError, load_config
from dhp.errors import (
    EXIT_BUG,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_WORKER,
    DataError,
    DhpError,
    ModelError,
    UsageError,
)

EMBEDDED = "demo"  # the name of the embedded demo config on the command line
# the embedded configs (dhp/configs/NAME.yaml, shipped in the package), by name on the command line: a pip install
# has no configs/ folder to point at; tests/unit/test_cli_help.py holds this equal to the package's files
EMBEDDED_NAMES = ("demo", "omni_demo", "qwen3_vl_demo", "video_demo")
# the built-in families' presets, for the help text (written out: the registry imports torch and the families;
# tests/unit/test_cli_help.py holds it equal to the registry's)
PRESET_NAMES = ("tiny | 3b | 7b | 32b | 72b | omni-tiny | omni-3b | omni-7b | qwen3-vl-tiny | qwen3-vl-2b | "
                "qwen3-vl-4b | qwen3-vl-8b | qwen3-vl-32b")
CONFIG_HELP = f"YAML config file, or an embedded config by name ({', '.join(EMBEDDED_NAMES)})"
MAX_LISTED_PROBLEMS = 5  # per-sample problems printed under a data error (`dhp data check` lists more)

BASE_RULE = (
    "which config: with no argument at all, the embedded demo (dhp/configs/demo.yaml); otherwise the code "
    "defaults (dhp/config.py), then CONFIG if given (a YAML file, or an embedded config by name: "
    f"{', '.join(EMBEDDED_NAMES)}), then the "
    "key=value overrides in order. So `dhp train key=val` and `dhp train my.yaml key=val` start from the same "
    "defaults; `dhp train demo key=val` changes the demo."
)


def embedded_config_path(name: str = EMBEDDED) -> Path:
    """An embedded config (dhp/configs/NAME.yaml, shipped inside the package)."""
    return Path(str(resources.files("dhp") / "configs" / f"{name}.yaml"))


def default_config_path() -> Path:
    """The embedded default (configs/demo.yaml)."""
    return embedded_config_path(EMBEDDED)


def config_source(config: str | None, overrides: list[str]) -> tuple[str | Path | None, list[str]]:
    """Which config file a command starts from, and its overrides (``BASE_RULE``): no argument at all, the
    embedded demo; a first argument with ``=`` that is no file, an override; an embedded config's name that is no
    file here, that config. A name that is neither a file nor an embedded config is a usage error that lists
    them."""
    overrides = list(overrides)
    if config is None and not overrides:
        return default_config_path(), overrides
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]  # `dhp train key=value` with no file
    if config is None or Path(config).is_file():
        return config, overrides
    name = config.removesuffix(".yaml").removesuffix(".yml")
    if name in EMBEDDED_NAMES and "/" not in config:
        return embedded_config_path(name), overrides
    if Path(config).exists():
        raise UsageError(f"config {config} is a directory, not a YAML config file")
    raise UsageError(f"config file {config} does not exist"
                     + ("" if Path(config).is_absolute() else f" (relative to the current directory {Path.cwd()})")
                     + f"; the embedded configs, by name: {', '.join(EMBEDDED_NAMES)}")


def _config(args: argparse.Namespace):
    """The config of ``dhp train`` / ``dhp data check`` (``BASE_RULE``)."""
    return load_config(*config_source(args.config, args.overrides))


class EarlySignals:
    """Ctrl-C / SIGTERM while a command loads its libraries: recorded, then raised at a safe point (``release``).

    Python's default handler raises KeyboardInterrupt wherever the main thread is, and a library being imported
    can swallow it (seen: an interrupt about 2 s into `dhp train` lost, the run trained to its end)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> EarlySignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: at once
        self.signum = signum

    def release(self) -> None:
        """Python's own handlers again; a signal recorded meanwhile stops the command here, with 128 + its number."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.signum is not None:
            from dhp.errors import Interrupted

            name = signal.Signals(self.signum).name
            raise Interrupted(self.signum, f"stopped by {name} before training started; nothing to resume")


def cmd_train(args: argparse.Namespace) -> int:
    early = EarlySignals().install()  # until the libraries are loaded (the run installs its own handler later)
    try:
        cfg = _config(args)
        from dhp.train import train
    finally:
        early.release()
    train(cfg)
    return 0


def human_count(n: float) -> str:
    """12_345_678 -> '12.35 M': parameter counts in K, M or B (thousands, millions, billions)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def cmd_info(args: argparse.Namespace) -> int:
    from dhp.models.registry import UnknownFamily, get_family, resolve_family

    try:  # unset --family: the checkpoint's model_type, else the family with that preset
        family = get_family(args.family) if args.family else resolve_family(
            None, args.model if (Path(args.model) / "config.json").is_file() else None, args.model)
    except UnknownFamily as e:
        raise ConfigError(f"--family: {str(e).removeprefix('model.family: ')}") from None
    presets = ", ".join(family.presets) or "none"
    path = Path(args.model)
    if args.model not in family.presets:
        if not path.exists():
            raise ModelError(f"{args.model}: no such preset of {family.name} and no such directory; give a preset "
                             f"({presets}) or a Hugging Face checkpoint directory")
        if not (path / "config.json").is_file():
            raise ModelError(f"{args.model}: no config.json in it; give a Hugging Face checkpoint directory (the one "
                             f"holding config.json) or a preset ({presets})")
    try:
        model_cfg = family.preset_config(args.model)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelError(f"{args.model}: {e}") from None
    rows = family.describe(model_cfg)
    print(f"{family.name} {args.model}: parameters")
    for name, n, desc in rows:
        print(f"  {name:<26} {human_count(n):>9}  ({desc})")
    print(f"  {'total':<26} {human_count(sum(n for _, n, _ in rows)):>9}")
    return 0


def cmd_data_demo(args: argparse.Namespace) -> int:
    from dhp.data.demo import make_demo_dataset
    from dhp.storage import check_writable

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file; give a new or empty directory")
    check_writable(out, "OUT ")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"{out} is not empty; give a new or empty directory, or pass --overwrite to write the demo "
                         "files over what is there")
    paths = make_demo_dataset(out, seed=args.seed)
    n_train, n_eval = (sum(1 for line in p.read_text().splitlines() if line.strip()) for p in (paths.train, paths.eval))
    print(f"dhp: demo data set written to {paths.root}")
    print(f"  train      {paths.train}  ({n_train} samples)")
    print(f"  eval       {paths.eval}  ({n_eval} samples)")
    print(f"  images     {paths.images}/")
    print(f"  tokenizer  {paths.tokenizer}/")
    print(f"train on it: dhp train data.path={paths.train} data.eval_path={paths.eval} "
          f"data.tokenizer={paths.tokenizer}")
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    """Validate the training data as ``dhp train`` would (same config, same overrides), and report. Every image
    is read through now (``data.validate=full``) unless the command sets ``data.validate``: what a lazy run would
    find before each step is found here at once."""
    from dhp.inputs import dataset_spec, open_dataset, resolve_inputs

    cfg = _config(args)
    if not any(o.split("=", 1)[0].strip() == "data.validate" for o in [args.config or "", *args.overrides]):
        cfg.data.validate = "full"
    inputs = resolve_inputs(cfg)
    try:
        ds = open_dataset(dataset_spec(inputs, inputs.train_path))
    except DataError as e:  # the report: every problem listed in the error (up to MAX_LISTED_ISSUES)
        head, *rest = str(e).splitlines() or [""]
        print("\n".join([f"dhp: {e.label}: {head}", *(f"  {ln}" for ln in rest)]), file=sys.stderr)
        return e.exit_code
    lengths = ds.lengths()
    print(f"dhp: {inputs.train_path}: {len(ds)} good samples, {len(ds.skipped)} skipped; "
          f"tokens per sample min {min(lengths)} max {max(lengths)} mean {sum(lengths) / len(lengths):.0f}")
    for line in getattr(ds, "describe", lambda: [])():  # a mix: each source's share
        print(f"  {line}")
    if getattr(ds, "index_dir", None) is not None:
        print(f"  index: {ds.index_dir} (a second start reads it back; docs/data.md)")
    for issue in ds.skipped:
        print(f"  skipped: {issue}")
    return 0


# ---- errors -------------------------------------------------------------------------------------


def _epilog() -> str:
    codes = "\n".join(f"  {code:>3}  {what}" for code, what in sorted(EXIT_CODES.items()))
    note = textwrap.fill("An error is one `dhp: ...` line naming the key or file and the fix; --debug (or "
                         "DHP_DEBUG=1) adds the traceback and Ray's startup messages.", 100)
    return f"exit codes:\n    0  success\n{codes}\n\n{note}"


def _worker_error_line(detail: str) -> str:
    """The worker's own error: the last ``SomeError: message`` line of its traceback, else its last line."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning|Failure)\b(:|$)", ln):
            return ln
    return lines[-1] if lines else "(no message)"


def describe_worker_error(e: BaseException) -> str:
    """One paragraph: module, rank, method, step and the worker's own last error line."""
    module, rank = getattr(e, "module", "?"), getattr(e, "rank", "?")
    what = getattr(e, "what", f"failed in {getattr(e, 'method', '?')}()")
    step = getattr(e, "step", None)
    text = str(e)
    detail = text.split("worker traceback:", 1)[1] if "worker traceback:" in text else text
    where = f"{module} rank {rank}" if isinstance(rank, int) and rank >= 0 else f"the {module} group"
    at_step = f" at step {step}" if step is not None else ""
    return (f"dhp: worker failure: {where} {what}{at_step}:\n"
            f"  {_worker_error_line(detail)}\n"
            "  (the worker's traceback: rerun with --debug; its log is under /tmp/ray/session_latest/logs)")


def describe_error(e: BaseException) -> tuple[int, str]:
    """The exit code and the text printed for an exception that ended a command."""
    from dhp.runtime.errors import WorkerError  # a leaf module: no Ray import

    if isinstance(e, WorkerError):
        return EXIT_WORKER, describe_worker_error(e)
    if isinstance(e, DhpError):
        lines = str(e).splitlines() or [type(e).__name__]
        text = f"dhp: {e.label}: {lines[0]}"
        rest = lines[1:]
        if isinstance(e, DataError) and rest:
            shown = [ln for ln in rest if not ln.startswith("... and ")][:MAX_LISTED_PROBLEMS]
            n_more = len(e.issues) - len(shown) if e.issues else len(rest) - len(shown)
            text += "".join(f"\n  {ln}" for ln in shown)
            if n_more > 0:
                text += f"\n  ... and {n_more} more (`dhp data check` with the same arguments lists more)"
        elif rest:
            text += "".join(f"\n  {ln}" for ln in rest)
        return e.exit_code, text
    message = str(e).splitlines()[0] if str(e) else ""
    return EXIT_BUG, (f"dhp: unexpected error: {type(e).__name__}: {message}\n"
                      "  (this is likely a bug in dhp: rerun with --debug for the traceback and report it)")


def _debug_wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("DHP_DEBUG", "").strip().lower() not in (
        "", "0", "false", "no")


RAY_STARTUP_LOGGERS = {
    "ray._private.authentication.authentication_token_setup": logging.ERROR,  # the token-authentication notice
    "ray._private.worker": logging.WARNING,  # "Started a local Ray instance."
    "ray._private.services": logging.WARNING,
    "ray._private.node": logging.WARNING,
}


def _ray_startup_messages(show: bool) -> None:
    """Keep Ray's startup messages (the token-authentication notice, "Started a local Ray instance") out of the
    terminal unless ``show`` (--debug). Ray's token authentication itself stays as Ray sets it; its other
    warnings and errors still show."""
    for name, level in RAY_STARTUP_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if show else level)


MAX_TOKENS_START, MAX_TOKENS_STOP = 256, 65536  # `dhp bench --max-vision-tokens`: vision tokens of the first probe, cap


def bench_profile(args: argparse.Namespace, config: str | Path | None, overrides: list[str]) -> str | None:
    """The profile ``dhp bench`` predicts with: ``--profile``, else this machine's calibrated profile of the device
    the layouts train on (``dhp plan calibrate`` keeps it), else none (measured only); ``--no-profile``: none."""
    if args.profile or args.no_profile:
        return args.profile
    import torch

    from dhp.plan.profile import machine_profile

    device = load_config(config, overrides).train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    found = machine_profile(device)
    if found is not None:
        print(f"dhp bench: predicting each layout's step with this machine's {device} profile, {found} (written by "
              "`dhp plan calibrate`; --no-profile: measure only)", file=sys.stderr, flush=True)
    return str(found) if found is not None else None


def cmd_bench(args: argparse.Namespace) -> int:
    """Train each layout in turn on the same config; bench.json and charts in output.dir. With
    --max-vision-tokens: each layout's largest single image under a per-worker memory budget instead."""
    from dhp.bench import check_max_tokens_args, parse_layouts, run_bench, run_max_vision_tokens

    config, overrides = config_source(args.config, args.overrides)
    if args.steps < 1 or args.warmup < 0:
        raise UsageError("--steps must be >= 1 and --warmup >= 0")
    search_flags = {"--memory-budget-gb": args.memory_budget_gb, "--vision-tokens-start": args.vision_tokens_start,
                    "--vision-tokens-max": args.vision_tokens_max}
    if not args.max_vision_tokens:
        given = [f for f, v in search_flags.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --max-vision-tokens")
        run_bench(config, overrides, parse_layouts(args.layouts, args.workers), args.steps, args.warmup,
                  profile=bench_profile(args, config, overrides))
        return 0
    start = MAX_TOKENS_START if args.vision_tokens_start is None else args.vision_tokens_start
    stop = MAX_TOKENS_STOP if args.vision_tokens_max is None else args.vision_tokens_max
    check_max_tokens_args(args.memory_budget_gb, start, stop)  # before any layout is read
    run_max_vision_tokens(config, overrides, parse_layouts(args.layouts, args.workers), args.memory_budget_gb,
                          start, stop)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dhp.observe.report import make_report
    from dhp.storage import check_writable

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such directory; give a run's output.dir")
    runs = {"": run_dir}
    if not (run_dir / "metrics.jsonl").is_file() and (run_dir / "bench.json").is_file():
        # a `dhp bench` output.dir: one run per layout, each in its own folder; a report of each
        runs = {d.name: d for d in sorted(run_dir.iterdir()) if (d / "metrics.jsonl").is_file()}
        print(f"dhp: {run_dir} holds a dhp bench: a report of each layout ({', '.join(runs) or 'none ran a step'})")
    if args.out:
        check_writable(Path(args.out), "--out ")
    for name, d in runs.items():
        out = Path(args.out) / name if args.out else None
        for path in make_report(d, out):
            print(f"dhp: wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A Hugging Face directory from a training checkpoint, written shard by shard (never the whole model at once)."""
    import torch

    from dhp.checkpoint import export_adapter, export_checkpoint, resolve_checkpoint
    from dhp.storage import check_writable, location

    ckpt = resolve_checkpoint(args.checkpoint)  # a checkpoint, or a run's output.dir: its newest
    check_writable(location(args.out), "OUT ")
    if getattr(args, "adapter", False):  # LoRA adapters only, as PEFT writes them (docs/lora.md)
        out = export_adapter(ckpt, args.out)
        print(f"dhp: exported the LoRA adapters of {ckpt} to {out} (adapter_config.json, "
              "adapter_model.safetensors: peft.PeftModel.from_pretrained loads them onto the base model)")
        return 0
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_checkpoint(ckpt, args.out, dtype)  # paths or URLs (s3://...: dhp/storage.py)
    print(f"dhp: exported {ckpt} to {out} (config.json with the bos/eos/pad ids, safetensors, the "
          "tokenizer, and the source checkpoint's processor, chat template and generation config)")
    return 0


def version_text() -> str:
    """``dhp 0.1.0 (torch 2.13.0+cpu, ray 2.60.0, transformers 5.x, python 3.11.7)``: what a bug report needs,
    read from the installed packages' metadata (nothing imported)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from dhp import __version__

    def of(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    return f"dhp {__version__} ({', '.join(of(n) for n in ('torch', 'ray', 'transformers'))}, python " \
           f"{platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and Ray's startup messages (also: DHP_DEBUG=1)")
    fmt = argparse.RawDescriptionHelpFormatter
    rule = textwrap.fill(BASE_RULE, 100)
    p = argparse.ArgumentParser(prog="dhp", description="Disaggregated hybrid parallel training of VLMs on Ray",
                                epilog=_epilog(), formatter_class=fmt, parents=[common])
    p.add_argument("--version", action="version", version=version_text(),
                   help="dhp's version and those of torch, ray and transformers installed beside it")
    p.set_defaults(debug=False)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (no argument: the embedded demo)", parents=[common],
                       description=f"Train a model.\n\n{rule}", epilog=_epilog(), formatter_class=fmt)
    t.add_argument("config", nargs="?", help=CONFIG_HELP)
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=1e-4")
    t.set_defaults(fn=cmd_train)
    i = sub.add_parser("info", help="parameter counts of a preset (built on the meta device) or an HF directory",
                       parents=[common], epilog=_epilog(), formatter_class=fmt)
    i.add_argument("model", help=f"{PRESET_NAMES} | path to a Hugging Face checkpoint")
    i.add_argument("--family", default=None, help="model family (default: the family of the preset, or qwen2_5_vl)")
    i.set_defaults(fn=cmd_info)
    d = sub.add_parser("data", help="data tools", parents=[common])
    dsub = d.add_subparsers(dest="data_command", required=True)
    demo = dsub.add_parser("demo", help="write the demo data set (digits, real images) to OUT", parents=[common])
    demo.add_argument("out", help="a new or empty directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--overwrite", action="store_true", help="write into OUT even if it is not empty")
    demo.set_defaults(fn=cmd_data_demo)
    chk = dsub.add_parser("check", help="validate a data set as `dhp train` would, and report", parents=[common],
                          description=f"Validate the training data as `dhp train` would, every image read through "
                          f"(data.validate=full unless given).\n\n{rule}",
                          epilog=_epilog(), formatter_class=fmt)
    chk.add_argument("config", nargs="?", help=CONFIG_HELP)
    chk.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.path=train.jsonl")
    chk.set_defaults(fn=cmd_data_check)
    ex = sub.add_parser("export", help="write a Hugging Face directory from a training checkpoint", parents=[common],
                        epilog=_epilog(), formatter_class=fmt)
    ex.add_argument("checkpoint", help="a checkpoint directory, e.g. outputs/run/checkpoints/step_000120, or a "
                    "run's output.dir (its newest complete checkpoint)")
    ex.add_argument("out", help="the Hugging Face directory to write")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="cast floating-point weights (default: as trained)")
    ex.add_argument("--adapter", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter "
                    "directory instead (without it: the merged model, the adapters folded into the base)")
    ex.set_defaults(fn=cmd_export)
    b = sub.add_parser("bench", help="train several layouts in turn on the same config and compare them",
                       parents=[common], description=f"Measure layouts side by side (Ray backend).\n\n{rule}",
                       epilog=_epilog(), formatter_class=fmt)
    b.add_argument("config", nargs="?", help=CONFIG_HELP)
    b.add_argument("overrides", nargs="*", help="dotted key=value overrides shared by every layout")
    b.add_argument("--layouts", default="dhp,uniform_tp,fsdp",
                   help="comma-separated: dhp, uniform_tp, fsdp, or name=key=value;key=value (default: all three)")
    b.add_argument("--steps", type=int, default=3, help="measured steps per layout (default 3)")
    b.add_argument("--warmup", type=int, default=3, help="steps run first and left out (default 3: a run's first steps "
                   "build caches, allocate the optimizer's state, collect start-up's garbage)")
    b.add_argument("--workers", type=int, default=4, help="workers per layout of the named defaults: W/2 per group, "
                   "disaggregated; 2: both groups collocated on the two (default 4)")
    b.add_argument("--profile", default=None, help="a device profile (`dhp plan calibrate`): each layout carries "
                   "the planner's predicted_step_s beside its measured step time (default: this machine's, where "
                   "`dhp plan calibrate` has kept one)")
    b.add_argument("--no-profile", action="store_true", help="measure only: no prediction, not even with this "
                   "machine's calibrated profile")
    b.add_argument("--max-vision-tokens", action="store_true",
                   help="instead of training: per layout, grow one image until a worker's peak exceeds "
                        "--memory-budget-gb; report the largest that trains (bench.json: max_vision_tokens)")
    b.add_argument("--memory-budget-gb", type=float, default=None,
                   help="per-worker budget in GiB for --max-vision-tokens (CPU: the planner's tracked peak)")
    b.add_argument("--vision-tokens-start", type=int, default=None,
                   help=f"first probe, vision tokens (4 patches each; default {MAX_TOKENS_START})")
    b.add_argument("--vision-tokens-max", type=int, default=None,
                   help=f"largest probe, vision tokens (default {MAX_TOKENS_STOP})")
    b.set_defaults(fn=cmd_bench)
    rp = sub.add_parser("report", help="PNG plots of a run (loss, lr, tokens/s, MFU, memory, timeline)",
                        parents=[common], epilog=_epilog(), formatter_class=fmt)
    rp.add_argument("run_dir", help="a run's output.dir (metrics.jsonl, and trace.json if written), or a dhp "
                    "bench's (a report of each layout)")
    rp.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    rp.set_defaults(fn=cmd_report)
    pl = sub.add_parser("plan", help="predict memory and speed of every layout from fake runs of the real code",
                        parents=[common], epilog=_epilog(), formatter_class=fmt)
    pl.add_argument("model", help=f"a preset ({PRESET_NAMES}), a Hugging Face directory or a config.json; or "
                    "`calibrate` (with --out, --on, --quick): measure this machine's device profile for --profile")
    pl.add_argument("--family", default=None, help="the model family (model.family; default: the preset's or the "
                    "checkpoint's)")
    pl.add_argument("--gpus", type=int, default=None, help="GPUs to lay the model out on (required but for "
                    "calibrate)")
    pl.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU (default: the device's)")
    pl.add_argument("--device", default="h100", help="h100 | h200 | a100 | l40s (default h100), or one per group "
                    "(vision=l40s,text=h100: each group on a pool of its own, disaggregated)")
    pl.add_argument("--profile", default=None, help="a device profile from `dhp plan calibrate` (or one per group, "
                    "vision=FILE,text=FILE); default: the device table's roofline")
    pl.add_argument("--pool-link-gbs", type=float, default=None, help="GB/s per GPU between pools of a device per "
                    "group (default 50: 400 Gb/s InfiniBand)")
    pl.add_argument("--out", default=None, help="calibrate: where the profile goes (default profile.json)")
    pl.add_argument("--on", choices=["cpu", "cuda"], default=None, help="calibrate: the device to measure (default: "
                    "cuda when there is one)")
    pl.add_argument("--quick", action="store_true", help="calibrate: a small grid, for tests (seconds)")
    pl.add_argument("--threads", type=int, default=None, help="calibrate on cpu: torch threads while measuring "
                    "(default torch's; a CPU `dhp train` worker runs 1)")
    pl.add_argument("--no-runtime", action="store_true", help="calibrate: leave out Ray's actor round trip and "
                    "object store (measured in a local Ray it starts)")
    pl.add_argument("--published", action="store_true", help="the published experiment: 8 x H100 80 GB, 512 text "
                    "tokens, 1k-65k vision tokens, pure bf16, uniform TP against vision SP 8 + text TP 8, collocated; "
                    "prints the predicted ratio beside the published 1.26-1.37x")
    pl.add_argument("--peak-tflops", type=float, default=None, help="override the device's peak bf16 TFLOP/s")
    pl.add_argument("--vision-tokens", default="16384,65536", help="vision patches per sample, comma-separated")
    pl.add_argument("--audio-tokens", default="3000", help="audio mel frames per sample (100 per second; default "
                    "3000, 30 s), comma-separated: for a family with an audio encoder")
    pl.add_argument("--text-tokens", type=int, default=4096, help="text tokens per sample besides the placeholders")
    pl.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (default 1)")
    pl.add_argument("--precision", choices=["fp32_master", "bf16", "bf16_plain"], default="fp32_master",
                    help="train.precision of every group: float32 master weights (default) or pure bf16")
    pl.add_argument("--lora", default=None, help="LoRA adapters on every Linear of these modules, their bases "
                    "frozen: text=16,vision=8 (module=rank; a bare rank: the language model's)")
    pl.add_argument("--strategies", default=None,
                    help="comma-separated subset of dhp-collocated,dhp-disaggregated,uniform-tp,zero3")
    pl.add_argument("--json", default=None, help="write the rows as JSON here")
    pl.add_argument("--plot", default=None, help="write a PNG here: per-rank peak against the first encoder's "
                    "tokens, and each row's step-time breakdown per group at the largest size")
    pl.set_defaults(fn=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    from dhp.plan.command import run_plan

    return run_plan(args)


def main(argv: list[str] | None = None) -> int:
    """The ``dhp`` command. Called as the program (``argv`` None), a run stopped by a signal leaves at once
    (``os._exit``, output flushed): the workers are gone by then, and nothing is left to finalize but Ray's and
    torch's threads, whose teardown at interpreter exit is no part of a clean stop. ``kill -USR1 PID`` prints
    every thread's Python stack on stderr: a run that seems stuck says where it waits."""
    if argv is None and hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    code = _run(argv)
    if argv is None and code >= 128:  # 130: Ctrl-C, 143: SIGTERM
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():  # a Ray this run joined or left up: disconnect first
            ray.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line. ``key=value`` overrides may follow the flags as well as precede them (``dhp bench
    demo --steps 3 train.lr=1e-4``): argparse ends a positional list at the first flag, so the words after it that
    are overrides join the command's overrides, in order; anything else left over is the usual usage error."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _run(argv: list[str] | None) -> int:
    args = parse_command_line(argv)
    debug = _debug_wanted(args)
    _ray_startup_messages(show=debug)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("dhp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `dhp info 7b | head`: the reader left; nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    except Exception as e:  # noqa: BLE001 - every error ends here, as one line (the traceback with --debug)
        if debug:
            traceback.print_exc()
        code, text = describe_error(e)
        print(text, file=sys.stderr, flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
