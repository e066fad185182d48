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


def cmd_train(args: argparse.Namespace) -> int:
    from dhp.train import train

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)  # `dhp train key=value` with no file
        config = None
    cfg = load_config(config or default_config_path(), overrides)
    train(cfg)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dhp.models.qwen2_5_vl import build_model, count_parameters, preset, read_hf_config

    mcfg = read_hf_config(args.model) if Path(args.model).is_dir() else preset(args.model)
    model = build_model(mcfg, device="meta")
    v, t = mcfg.vision, mcfg.text
    rows = [
        ("vision encoder + merger", count_parameters(model.visual),
         f"depth {v.depth}, hidden {v.hidden_size}, heads {v.num_heads}, full attention at "
         f"{list(v.fullatt_block_indexes)}"),
        ("language model + lm_head", count_parameters(model.language),
         f"layers {t.num_hidden_layers}, hidden {t.hidden_size}, heads {t.num_attention_heads}/"
         f"{t.num_key_value_heads} kv, vocab {t.vocab_size}, tied {t.tie_word_embeddings}"),
    ]
    print(f"Qwen2.5-VL {args.model}")
    for name, n, desc in rows:
        print(f"  {name:<26} {n / 1e9:8.3f} B  ({desc})")
    print(f"  {'total':<26} {count_parameters(model) / 1e9:8.3f} B")
    return 0


def cmd_data_demo(args: argparse.Namespace) -> int:
    from dhp.data.demo import make_demo_dataset

    paths = make_demo_dataset(args.out, seed=args.seed)
    print(f"dhp: demo data set written to {args.out}: {paths}")
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from dhp.data.tokenizer import Tokenizer
    from dhp.train import load_dataset, resolve_inputs

    cfg = load_config(args.config, args.overrides)
    inputs = resolve_inputs(cfg)
    ds = load_dataset(cfg, Tokenizer(inputs.tokenizer_dir), inputs.train_path)
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
    i.set_defaults(fn=cmd_info)
    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    demo = dsub.add_parser("demo", help="write the demo data set (digits, real images) to OUT")
    demo.add_argument("out")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(fn=cmd_data_demo)
    chk = dsub.add_parser("check", help="validate a data set as `dhp train` would, and report")
    chk.add_argument("config", nargs="?")
    chk.add_argument("overrides", nargs="*")
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
