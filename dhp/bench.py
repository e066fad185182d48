"""``dhp bench``: layouts measured side by side on the same model, data, global batch and workers.

Each layout is a list of config overrides applied on top of the run's config (the same
``dhp train`` rules: defaults, then CONFIG, then key=value overrides). The layouts run one
after another in this process, on the Ray backend, each for ``warmup + steps`` steps; the
warm-up steps are left out of every figure. Per layout ``bench.json`` holds:

* ``tokens_per_s`` and ``ratio_to_uniform_tp``;
* per group: ``busy`` and ``idle`` (mean over its ranks of the fraction of the step they compute),
  ``imbalance`` (busiest replica over the mean), ``mfu``, ``peak_memory_gb`` (the peak of its busiest rank);
* ``comm_bytes_per_step``: bytes each group hands to each kind of collective per step (all ranks);
  ``router_bytes_per_step``: embeddings and gradients moved between the groups;
* ``vision_comm_ratio_sp_tp`` (top level): vision collective bytes under ``dhp`` over ``uniform_tp``.

The default layouts for ``--workers W`` (even, >= 4) use W workers each, W/2 per group, on
separate workers (disaggregated):

* ``dhp``: vision Ulysses SP W/2, text TP W/2, vision one micro-batch ahead;
* ``uniform_tp``: vision TP W/2, text TP W/2 (the uniform tensor-parallel baseline);
* ``fsdp``: vision and text data parallel W/2 with ZeRO-3 (FSDP2).

PNG bar charts are written beside ``bench.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean
from typing import Any

from dhp.config import Config, ConfigError, load_config


def default_layouts(workers: int) -> dict[str, list[str]]:
    if workers < 4 or workers % 2:
        raise ConfigError(f"--workers {workers}: the default layouts need an even number >= 4 (W/2 per group)")
    h = workers // 2
    common = ["runtime.placement=disaggregated", "runtime.encoders_ahead=1"]
    plain = {"dp": 1, "sp": 1, "tp": 1, "zero": 0}

    def layout(vision: dict, text: dict) -> list[str]:
        out = list(common)
        for module, par in (("vision", plain | vision), ("text", {k: v for k, v in (plain | text).items()
                                                                  if k != "sp"})):
            out += [f"{module}.parallel.{k}={v}" for k, v in par.items()]
        return out

    return {
        "dhp": layout({"sp": h}, {"tp": h}),
        "uniform_tp": layout({"tp": h}, {"tp": h}),
        "fsdp": layout({"dp": h, "zero": 3}, {"dp": h, "zero": 3}),
    }


def parse_layouts(spec: str, workers: int) -> dict[str, list[str]]:
    """``dhp,uniform_tp,fsdp`` (names of the default layouts) and/or ``name=key=value;key=value``."""
    known = default_layouts(workers)
    out: dict[str, list[str]] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, sep, rest = item.partition("=")
        if sep:
            overrides = [o.strip() for o in rest.split(";") if o.strip()]
            bad = [o for o in overrides if "=" not in o]
            if not overrides or bad:
                raise ConfigError(f"--layouts: {item!r}: a layout is name=key=value;key=value (got {bad or rest!r})")
            out[name] = overrides
        elif name in known:
            out[name] = known[name]
        else:
            raise ConfigError(f"--layouts: unknown layout {name!r}; known: {', '.join(known)}, or give "
                              "name=key=value;key=value")
    if not out:
        raise ConfigError("--layouts: no layout given")
    return out


def layout_config(config: str | Path | None, overrides: list[str], layout: list[str], name: str, out: Path,
                  steps: int, warmup: int) -> Config:
    fixed = ["runtime.backend=ray", f"train.steps={warmup + steps}", f"output.dir={out / name}",
             "output.overwrite=true", "output.save_final=false", "train.eval_at_end=false",
             "train.checkpoint_every=0", "train.resume=none"]
    return load_config(config, [*overrides, *layout, *fixed])


def summarize(rows: list[dict], warmup: int, modules: list[str]) -> dict[str, Any]:
    """A layout's figures from its metrics rows, warm-up steps left out."""
    measured = [r for r in rows if r["step"] > warmup] or rows[-1:]
    seconds = sum(r["step_time_s"] for r in measured)
    out: dict[str, Any] = {
        "steps_measured": [r["step"] for r in measured],
        "step_time_s": seconds / len(measured),
        "tokens_per_s": sum(r["tokens"] for r in measured) / seconds,
        "router_bytes_per_step": mean(r.get("router_bytes", 0) for r in measured),
        "loss": [r["loss"] for r in measured],
        "groups": {},
        "comm_bytes_per_step": {},
    }
    for m in modules:
        busy = mean(r.get(f"busy_{m}", 0.0) for r in measured)
        group = {"busy": busy, "idle": max(0.0, 1.0 - busy),
                 "imbalance": mean(r.get(f"imbalance_{m}", 1.0) for r in measured),
                 "peak_memory_gb": max(r.get(f"memory_gb_{m}", 0.0) for r in measured)}
        if all(f"mfu_{m}" in r for r in measured):
            group["mfu"] = mean(r[f"mfu_{m}"] for r in measured)
        out["groups"][m] = group
        comm = {}
        for key in sorted({k for r in measured for k in r if k.startswith(f"comm_{m}_")}):
            comm[key.removeprefix(f"comm_{m}_").removesuffix("_bytes")] = mean(r.get(key, 0) for r in measured)
        out["comm_bytes_per_step"][m] = comm
    return out


def run_bench(config: str | Path | None, overrides: list[str], layouts: dict[str, list[str]], steps: int,
              warmup: int) -> dict[str, Any]:
    """Train every layout in turn; write ``output.dir/bench.json`` and the charts; return the results."""
    from dhp.train import train

    base = load_config(config, overrides)
    out = Path(base.output.dir)
    results: dict[str, Any] = {"steps": steps, "warmup": warmup, "overrides": overrides, "layouts": {}}
    cfgs = {name: layout_config(config, overrides, layout, name, out, steps, warmup)
            for name, layout in layouts.items()}  # every layout's config is checked before any runs
    for name, cfg in cfgs.items():
        print(f"dhp bench: layout {name}: {' '.join(layouts[name])}", flush=True)
        train(cfg)
        rows = [json.loads(line) for line in (Path(cfg.output.dir) / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        results["layouts"][name] = {"overrides": layouts[name], **summarize(rows, warmup, list(cfg.modules))}
    res = results["layouts"]
    if "uniform_tp" in res:
        for r in res.values():
            r["ratio_to_uniform_tp"] = r["tokens_per_s"] / res["uniform_tp"]["tokens_per_s"]
    if "dhp" in res and "uniform_tp" in res:
        def vision_bytes(r: dict) -> float:
            return sum(r["comm_bytes_per_step"].get("vision", {}).values())

        tp = vision_bytes(res["uniform_tp"])
        results["vision_comm_ratio_sp_tp"] = vision_bytes(res["dhp"]) / tp if tp else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    results["plots"] = [str(p) for p in plot_bench(results, out)]
    print_table(results)
    print(f"dhp bench: {out / 'bench.json'}; charts: {', '.join(results['plots'])}", flush=True)
    return results


def print_table(results: dict[str, Any]) -> None:
    res = results["layouts"]
    modules = sorted({m for r in res.values() for m in r["groups"]})
    head = f"{'layout':<12} {'tokens/s':>9} {'vs TP':>6} " + " ".join(
        f"{m + ' busy':>11} {m + ' mfu':>10} {m + ' GB':>8}" for m in modules)
    print(head)
    for name, r in res.items():
        cells = []
        for m in modules:
            g = r["groups"].get(m, {})
            cells.append(f"{g.get('busy', 0):>11.0%} {g.get('mfu', float('nan')):>10.2%} "
                         f"{g.get('peak_memory_gb', 0):>8.2f}")
        ratio = r.get("ratio_to_uniform_tp")
        print(f"{name:<12} {r['tokens_per_s']:>9.0f} {(f'{ratio:.2f}' if ratio else '-'):>6} " + " ".join(cells))
    if results.get("vision_comm_ratio_sp_tp") is not None:
        print(f"vision collective bytes, dhp (SP) / uniform_tp (TP): {results['vision_comm_ratio_sp_tp']:.3f}")


def plot_bench(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results["layouts"]
    names = list(res)
    modules = sorted({m for r in res.values() for m in r["groups"]})
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, [res[n]["tokens_per_s"] for n in names], color="#4C72B0")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput (warm-up excluded)")
    fig.tight_layout()
    fig.savefig(out / "bench_throughput.png", dpi=100)
    plt.close(fig)
    written.append(out / "bench_throughput.png")

    panels = [("busy", "busy fraction"), ("mfu", "MFU"), ("peak_memory_gb", "peak memory (GB)"), ("comm", "MB/step")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    width = 0.8 / max(1, len(modules))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, m in enumerate(modules):
            if key == "comm":
                values = [sum(res[n]["comm_bytes_per_step"].get(m, {}).values()) / 2**20 for n in names]
            else:
                values = [res[n]["groups"].get(m, {}).get(key, 0.0) for n in names]
            ax.bar([i + j * width for i in range(len(names))], values, width, label=m)
        ax.set_xticks([i + width * (len(modules) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names)
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_groups.png", dpi=100)
    plt.close(fig)
    written.append(out / "bench_groups.png")
    return written
