"""The ``dhp`` command: train, info, data."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from dhp.config import ConfigError, load_config


def default_config_path() -> Path:
    """The embedded default (configs/demo.yaml, shipped inside the package)."""
    return Path(str(resources.files("dhp") / "configs" / "demo.yaml"))


def _config(args: argparse.Namespace):
    """The config of ``dhp train`` / ``dhp data check``: a YAML file (default: the embedded demo) and overrides."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)  # `dhp train key=value` with no file
        config = None
    return load_config(config or default_config_path(), overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from dhp.train import train

    train(_config(args))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dhp.models.registry import get_family

    family = get_family(args.family)
    try:
        model_cfg = family.preset_config(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"model: {e}") from None
    rows = family.describe(model_cfg)
    print(f"{family.name} {args.model}")
    for name, n, desc in rows:
        print(f"  {name:<26} {n / 1e9:8.3f} B  ({desc})")
    print(f"  {'total':<26} {sum(n for _, n, _ in rows) / 1e9:8.3f} B")
    return 0


def cmd_data_demo(args: argparse.Namespace) -> int:
    from dhp.data.demo import make_demo_dataset

    paths = make_demo_dataset(args.out, seed=args.seed)
    print(f"dhp: demo data set written to {args.out}: {paths}")
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    """Validate the training data exactly as ``dhp train`` would (same config, same overrides), and report."""
    from dhp.data.llava import DataError
    from dhp.inputs import dataset_spec, open_dataset, resolve_inputs

    cfg = _config(args)
    inputs = resolve_inputs(cfg)
    try:
        ds = open_dataset(dataset_spec(cfg, inputs.tokenizer_dir, inputs.train_path))
    except DataError as e:
        print(f"dhp: data error: {e}", file=sys.stderr)
        return 1
    lengths = ds.lengths()
    print(f"dhp: {inputs.train_path}: {len(ds)} good samples, {len(ds.skipped)} skipped; "
          f"tokens per sample min {min(lengths)} max {max(lengths)} mean {sum(lengths) / len(lengths):.0f}")
    for issue in ds.skipped:
        print(f"  skipped: {issue}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dhp", description="Disaggregated hybrid parallel training of VLMs on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (no config: the embedded demo)")
    t.add_argument("config", nargs="?", help="YAML config (default: the embedded configs/demo.yaml)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=1e-4")
    t.set_defaults(fn=cmd_train)
    i = sub.add_parser("info", help="parameter counts of a preset (built on the meta device) or an HF directory")
    i.add_argument("model", help="tiny | 3b | 7b | 32b | 72b | path to a Hugging Face checkpoint")
    i.add_argument("--family", default="qwen2_5_vl", help="model family (default: qwen2_5_vl)")
    i.set_defaults(fn=cmd_info)
    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    demo = dsub.add_parser("demo", help="write the demo data set (digits, real images) to OUT")
    demo.add_argument("out")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(fn=cmd_data_demo)
    chk = dsub.add_parser("check", help="validate a data set as `dhp train` would, and report")
    chk.add_argument("config", nargs="?", help="YAML config (default: the embedded configs/demo.yaml)")
    chk.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.path=train.jsonl")
    chk.set_defaults(fn=cmd_data_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"dhp: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dhp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
