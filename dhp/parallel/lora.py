"""LoRA adapters on a module's ``nn.Linear`` layers: PEFT's math and names, under every layout dhp has.

Why our own and not ``peft`` itself: a module here is built on the meta device, laid out (TP, Ulysses SP,
activation checkpointing, FSDP2) and only then given storage, shard by shard; PEFT wraps a materialised
``nn.Module`` and renames its base weights (``base_layer``). ``LoRALinear`` keeps the base weight where it was
(``...qkv_proj.weight``: checkpoints, HF loading and the families' plans see the same names) and adds
``...qkv_proj.lora_A.weight`` / ``lora_B.weight``, PEFT's names less the adapter's name.

The math is PEFT's (``peft.tuners.lora.Linear``): ``y = base(x) + lora_B(lora_A(dropout(x))) * alpha / r``,
``lora_A`` kaiming-uniform (a = sqrt(5)), ``lora_B`` zeros. A *fused* base (dhp's ``qkv_proj`` is a checkpoint's
``q_proj``, ``k_proj`` and ``v_proj``; ``gate_up_proj`` its ``gate_proj`` and ``up_proj``) holds one adapter per
part, as PEFT on the checkpoint's model does: ``lora_A`` is the parts' A's stacked ``[P * r, in]``, ``lora_B``
their B's stacked ``[sum of the parts' rows, r]`` (rows in the base's order), part ``i``'s output rows
``h_i @ B_i^T`` with ``h_i`` its ``r`` columns of ``x @ A^T``. Parts the targets leave out (``q_proj`` and
``v_proj`` only, PEFT's classic choice) contribute nothing; their rows of A and B get zero gradients and keep
their init (a little optimizer state spent on them; they are left out of the PEFT export).

Tensor parallelism is Megatron's: on a column-parallel base A is replicated and B split like the base's rows
(``lora_plan`` wraps the family's ``ParallelStyle``; B goes through the base style's own partition, so a fused
base's rank-order re-ordering applies to B too), on a row-parallel base A is split like the base's columns and
B replicated (the partial sums ride on the base's all-reduce or reduce-scatter: no extra collective). Replicated
adapters whose gradients come out as partial sums are summed over the TP ranks by a hook, once per backward.

A generic leaf: it imports no model family (names and fused parts come in as functions from the engine).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ADAPTER_KEYS", "LoRALinear", "LoRATarget", "apply_lora", "detached_adapters", "export_targets",
           "fold", "init_adapters", "is_adapter", "linear_parts", "load_adapters", "lora_plan", "memory_names",
           "merge_adapters", "parts_by_weights", "peft_config", "peft_tensors", "targeted"]

ADAPTER_KEYS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoRATarget:
    """One fused or plain base, as a checkpoint names it: ``names[i]`` (HF module names) has ``rows[i]`` output
    rows of the base; ``active[i]``: the targets chose that part."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    active: tuple[bool, ...]


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``....lora_A.weight`` / ``....lora_B.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_KEYS


def targeted(hf_module: str, targets: str | Sequence[str]) -> bool:
    """PEFT's rule: a string is a regex the whole module name must match; a list names modules by their last
    components (``q_proj`` matches ``model.layers.0.self_attn.q_proj``). ``"all-linear"``: every Linear but the
    output layer (``lm_head``)."""
    if targets == "all-linear":
        return hf_module.rsplit(".", 1)[-1] != "lm_head"
    if isinstance(targets, str):
        return re.fullmatch(targets, hf_module) is not None
    return any(hf_module == t or hf_module.endswith("." + t) for t in targets)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (the frozen base, its parameters where they were) with PEFT's LoRA branch beside it."""

    r: int
    scaling: float
    target: LoRATarget

    @classmethod
    def wrap(cls, linear: nn.Linear, r: int, alpha: float, dropout: float, target: LoRATarget,
             dtype: torch.dtype = torch.float32) -> LoRALinear:
        """Turn ``linear`` into a ``LoRALinear`` in place (on its own device: the meta device before a layout),
        its adapters in ``dtype`` (the policy's parameter dtype: float32 master weights, or pure bf16)."""
        if sum(target.rows) != linear.out_features:
            raise ValueError(f"LoRA target {target.names}: parts of {list(target.rows)} rows do not make the "
                             f"{linear.out_features} output rows of the Linear")
        device = linear.weight.device
        linear.__class__ = cls
        linear.r, linear.scaling, linear.target = r, alpha / r, target
        parts = len(target.rows)
        linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        linear.lora_A = nn.Linear(linear.in_features, parts * r, bias=False, device=device, dtype=dtype)
        linear.lora_B = nn.Linear(r, linear.out_features, bias=False, device=device, dtype=dtype)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 (the class says it)
        out = F.linear(x, self.weight, self.bias)
        h = F.linear(self.lora_dropout(x).to(_dtype(self.lora_A.weight, x)), self.lora_A.weight)
        delta = _up(h, self.lora_B.weight, self.target, self.r)
        return out + (delta * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora r={self.r}, scaling={self.scaling:g}, parts={self.target.names}"


def _dtype(weight: torch.Tensor, x: torch.Tensor) -> torch.dtype:
    """The adapters' input dtype: the compute dtype under autocast (it casts itself), else the adapter's own."""
    return x.dtype if torch.is_autocast_enabled(x.device.type) else weight.dtype


def _up(h: torch.Tensor, b: torch.Tensor, target: LoRATarget, r: int) -> torch.Tensor:
    """``h_i @ B_i^T`` per part, concatenated on the last dimension (on the local shard under column-parallel
    TP, where B's rows and the base's are the rank's own rows of every part, in part order)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    if isinstance(b, DTensor) and any(isinstance(p, Shard) for p in b.placements):  # column-parallel base
        mesh = b.device_mesh
        local = _up_local(h.to_local(grad_placements=[Partial()]), b.to_local(), target, r)
        shape = (*h.shape[:-1], b.shape[0])  # global: the base's rows (an uneven last shard allowed)
        return DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))
    if len(target.rows) == 1:
        return F.linear(h, b)
    return _up_local(h, b, target, r)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


def _up_local(h: torch.Tensor, b: torch.Tensor, target: LoRATarget, r: int) -> torch.Tensor:
    total = sum(target.rows)
    rows = [n * b.shape[0] // total for n in target.rows]  # each part's rows here (all of them, or 1/tp)
    if sum(rows) != b.shape[0]:
        raise RuntimeError(f"LoRA {target.names}: {b.shape[0]} rows of B here do not split as the parts "
                           f"{list(target.rows)}")
    outs = []
    for hi, bi, on in zip(h.split(r, dim=-1), b.split(rows), target.active, strict=True):
        outs.append(F.linear(hi, bi) if on else hi.new_zeros(*hi.shape[:-1], bi.shape[0]))
    return torch.cat(outs, dim=-1)


# ---- applying -----------------------------------------------------------------------------------------------
def apply_lora(module: nn.Module, r: int, alpha: float, dropout: float, targets: str | Sequence[str],
               parts_of: Callable[[str], tuple[tuple[str, ...], tuple[int, ...]]],
               skip: Sequence[str] = (), dtype: torch.dtype = torch.float32) -> list[str]:
    """Wrap every ``nn.Linear`` of ``module`` that ``targets`` choose; returns their (module-local) names.

    ``parts_of(local name)``: the checkpoint's module names the Linear is made of and their rows (one name for a
    plain Linear). ``skip``: prefixes of Linears left alone (a projector trained whole). ``dtype``: the adapters'
    (the parameters' under the precision policy: one dtype for all that trains, as ZeRO-1's optimizer needs).
    Raises ``ValueError`` when the targets choose nothing (a misspelt name would otherwise train nothing)."""
    chosen = []
    for name, sub in list(module.named_modules()):
        if type(sub) is not nn.Linear or name.startswith(tuple(skip)):
            continue
        names, rows = parts_of(name)
        active = tuple(targeted(n, targets) for n in names)
        if any(active):
            LoRALinear.wrap(sub, r, alpha, dropout, LoRATarget(names, rows, active), dtype)
            chosen.append(name)
    if not chosen:
        raise ValueError(f"LoRA target_modules {targets!r} match no Linear of the {type(module).__name__} (names "
                         f"are the checkpoint's, e.g. {', '.join(_examples(module, parts_of))})")
    return chosen


def parts_by_weights(weights: Any, prefix: str, module: nn.Module,
                     model_cfg: Any) -> Callable[[str], tuple[tuple[str, ...], tuple[int, ...]]]:
    """``apply_lora``'s ``parts_of`` from a family's weight adapter (``hf_names``, ``part_rows``): the checkpoint's
    module names of one of ``module``'s Linears (its whole-model keys start with ``prefix``) and their rows."""
    return lambda name: linear_parts(weights, f"{prefix}.{name}", module.get_submodule(name).out_features,
                                     model_cfg)


def linear_parts(weights: Any, key: str, out_features: int,
                 model_cfg: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(checkpoint module names, their rows) of the Linear at whole-model ``key``: several for a fused one."""
    try:
        names = weights.hf_names(f"{key}.weight")
    except Exception:  # noqa: BLE001 - a family without HF names (ConfigError, KeyError): our own names
        names = (f"{key}.weight",)
    rows = weights.part_rows(f"{key}.weight", model_cfg) or (out_features // len(names),) * len(names)
    return tuple(n.removesuffix(".weight") for n in names), tuple(rows)


def _examples(module: nn.Module, parts_of: Callable[[str], tuple[tuple[str, ...], tuple[int, ...]]]) -> list[str]:
    seen: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            for n in parts_of(name)[0]:
                last = n.rsplit(".", 1)[-1]
                if last not in seen:
                    seen.append(last)
    return seen[:8]


def lora_modules(module: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, sub in module.named_modules():
        if isinstance(sub, LoRALinear):
            yield name.replace("._checkpoint_wrapped_module", ""), sub


@contextmanager
def detached_adapters(module: nn.Module) -> Iterator[dict[str, nn.Parameter]]:
    """The module without its adapters inside the block (the family's init and HF loading see the base alone);
    yields ``{parameter name: adapter parameter}``."""
    held = []
    found: dict[str, nn.Parameter] = {}
    for name, sub in lora_modules(module):
        for key in ADAPTER_KEYS:
            child = sub._modules.pop(key)
            held.append((sub, key, child))
            found[f"{name}.{key}.weight"] = child.weight
    try:
        yield found
    finally:
        for sub, key, child in held:
            sub._modules[key] = child


def init_adapters(params: dict[str, nn.Parameter], seed: int) -> None:
    """PEFT's init, the same values in every layout: ``lora_A`` kaiming-uniform (a = sqrt(5): uniform on
    +-1/sqrt(in)) drawn whole from ``(seed, its name)`` and sliced to this rank's part, ``lora_B`` zeros."""
    from dhp.parallel.materialize import chunk_seed

    with torch.no_grad():
        for name, p in params.items():
            local = _local(p)
            if name.endswith("lora_B.weight"):
                local.zero_()
                continue
            g = torch.Generator().manual_seed(chunk_seed(seed, name, 0))
            bound = 1.0 / math.sqrt(p.shape[1])
            full = torch.empty(tuple(p.shape)).uniform_(-bound, bound, generator=g)
            local.copy_(local_part(full, p))


def load_adapters(params: dict[str, nn.Parameter], state: dict[str, torch.Tensor], transforms: dict) -> None:
    """This rank's part of every adapter from full tensors ``state`` (module-local names, canonical layout;
    ``transforms``: the layout's non-canonical parameters, a fused base's B under TP)."""
    from dhp.parallel.materialize import canonical_shape

    missing = sorted(set(params) - set(state))
    if missing:
        raise KeyError(f"LoRA adapters missing from the given state: {missing[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            full = state[name].float()
            want = canonical_shape(transforms[name], p.shape) if name in transforms else tuple(p.shape)
            if tuple(full.shape) != want:
                raise ValueError(f"LoRA adapter {name}: shape {list(full.shape)} where the module has "
                                 f"{list(want)} (another lora.r or target_modules?)")
            if name in transforms:
                full = transforms[name].from_canonical(full)
            _local(p).copy_(local_part(full, p))


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p.data


def local_part(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p`` (plain, TP or FSDP2 DTensor), cut from its whole value ``full``."""
    from dhp.parallel.materialize import local_index

    out = full
    for d, ix in enumerate(local_index(p)):
        out = out[(slice(None),) * d + (ix,)] if isinstance(ix, slice) else out.index_select(d, ix)
    return out


# ---- tensor parallelism ---------------------------------------------------------------------------------------
def lora_plan(root: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """A family's TP plan (``{module path: ParallelStyle}`` under ``root``) with the styles of LoRA-wrapped
    Linears wrapped in ``LoRAParallel``; the plan itself where nothing is wrapped."""
    out = {}
    for path, style in plan.items():
        try:
            sub = root.get_submodule(path)
        except AttributeError:
            sub = None
        out[path] = LoRAParallel(style) if isinstance(sub, LoRALinear) else style
    return out


class LoRAParallel(ParallelStyle):
    """A ``ColwiseParallel`` / ``RowwiseParallel`` (or subclass: a fused column-parallel style) of a
    ``LoRALinear``'s base, and Megatron's layout of its adapters (column-parallel: A replicated, B split as the
    base's rows; row-parallel: A split as the base's columns, B replicated)."""

    def __init__(self, base: Any) -> None:
        super().__init__()
        self.base = base

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if not isinstance(module, LoRALinear):
            raise TypeError(f"LoRAParallel lays out a LoRALinear, got {type(module).__name__}")
        children = dict(module._modules)  # the adapters and the dropout: the base style sees the Linear alone
        adapters = {k: children[k] for k in ADAPTER_KEYS}
        module._modules.clear()
        try:
            self.base._apply(module, device_mesh)  # the base weight, bias and the input/output hooks
        finally:
            module._modules.update(children)
        if isinstance(self.base, ColwiseParallel):
            split, whole = "lora_B", "lora_A"
        elif isinstance(self.base, RowwiseParallel):
            split, whole = "lora_A", "lora_B"
        else:
            raise NotImplementedError(f"LoRA under tensor parallelism: a {type(self.base).__name__} base")
        self.base._partition_linear_fn(split, adapters[split], device_mesh)  # as the base's rows / columns
        _replicate(adapters[whole], device_mesh, [Replicate()])
        return module


def _replicate(linear: nn.Linear, mesh: Any, placements: list) -> None:
    from torch.distributed.tensor import distribute_tensor

    w = linear.weight
    param = nn.Parameter(distribute_tensor(w.detach(), mesh, placements), requires_grad=w.requires_grad)
    linear.register_parameter("weight", param)
    param.register_post_accumulate_grad_hook(_sum_partial_grad)


def _sum_partial_grad(param: torch.Tensor) -> None:
    """A replicated adapter's gradient is a partial sum on each TP rank (its other factor is split): sum it
    once per backward, so optimizers, clipping and checkpoints see an ordinary replicated gradient."""
    from torch.distributed.tensor import DTensor, Replicate

    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))


# ---- export -----------------------------------------------------------------------------------------------------
Targets = dict  # {Linear name: (scale, LoRATarget, r)}


def fold(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, target: LoRATarget,
         r: int) -> torch.Tensor:
    """``W + scale * B_i @ A_i`` on each active part's rows (float32 sums, ``weight``'s dtype out)."""
    a, b = a.float(), b.float()
    deltas = [bi @ ai if on else bi.new_zeros(bi.shape[0], a.shape[1])
              for ai, bi, on in zip(a.split(r), b.split(list(target.rows)), target.active, strict=True)]
    return (weight.float() + scale * torch.cat(deltas)).to(weight.dtype)


def merge_adapters(state: dict[str, torch.Tensor], targets: Targets) -> dict[str, torch.Tensor]:
    """A full state dict (canonical layout) with every adapter folded into its base and dropped; ``targets``
    names the LoRA Linears as ``state`` does."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name, (scale, target, r) in targets.items():
        out[f"{name}.weight"] = fold(out[f"{name}.weight"], state[f"{name}.lora_A.weight"],
                                     state[f"{name}.lora_B.weight"], scale, target, r)
    return out


def export_targets(adapter_keys: dict[str, tuple[int, ...]], base_rows: dict[str, int], prefix: str,
                   weights: Any, model_cfg: Any, lora: Any) -> Targets:
    """The LoRA Linears of a saved module (``adapter_keys``: its ``....lora_A.weight`` keys and shapes;
    ``base_rows``: each base's output rows), as ``apply_lora`` made them under ``lora`` (a ``LoRAConfig``);
    names are whole-model keys (``prefix`` + the module's)."""
    out = {}
    for key, shape in adapter_keys.items():
        if not key.endswith(".lora_A.weight"):
            continue
        linear = key.removesuffix(".lora_A.weight")
        names, rows = linear_parts(weights, f"{prefix}.{linear}", base_rows[linear], model_cfg)
        r = shape[0] // len(names)
        out[f"{prefix}.{linear}"] = (lora.alpha / r, LoRATarget(names, rows, tuple(
            targeted(n, lora.target_modules) for n in names)), r)
    return out


def part_keys(linear: str, target: LoRATarget) -> list[str]:
    """Our whole-model names of a LoRA Linear's parts (``language.layers.0.self_attn.q_proj`` for a fused
    ``qkv_proj``): the Linear itself when it is not fused."""
    if len(target.names) == 1:
        return [linear]
    owner = linear.rsplit(".", 1)[0]
    return [f"{owner}.{n.rsplit('.', 1)[-1]}" for n in target.names]


def memory_names(weights: Any) -> Callable[[str], str]:
    """Our whole-model module name -> the transformers model's module path (what PEFT's adapter keys use):
    the spelling the family's ``from_hf_rules`` read first for that prefix (a ``RuleAdapter`` lists the
    in-memory one first: ``model.language_model.``), the longest matching prefix winning (``language.lm_head.``
    over ``language.``); the checkpoint's name where a family has no rules."""
    rules = [(pattern, repl) for pattern, repl in getattr(weights, "from_hf_rules", ())
             if re.fullmatch(r"\^[\w\\.]+", pattern)]  # plain prefixes: ^model\.language_model\.

    def name(ours: str) -> str:
        dotted, best = ours + ".", None
        for pattern, repl in rules:
            if dotted.startswith(repl) and (best is None or len(repl) > len(best[1])):
                best = (pattern, repl)
        if best is None:
            return weights.hf_names(f"{ours}.weight")[0].removesuffix(".weight")
        return (best[0][1:].replace("\\.", ".") + dotted[len(best[1]):]).removesuffix(".")

    return name


def peft_tensors(state: dict[str, torch.Tensor], targets: Targets,
                 module_name: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """The adapters of ``state`` under PEFT's names, ``base_model.model.<module path>.lora_A.weight`` per active
    part (``module_name``: our whole-model part name -> the transformers model's module path)."""
    out = {}
    for name, (_, target, r) in targets.items():
        a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        for part, ai, bi, on in zip(part_keys(name, target), a.split(r), b.split(list(target.rows)), target.active,
                                    strict=True):
            if on:
                where = f"base_model.model.{module_name(part)}"
                out[f"{where}.lora_A.weight"] = ai.contiguous()
                out[f"{where}.lora_B.weight"] = bi.contiguous()
    return out


def peft_config(ranks: dict[str, tuple[int, float]], dropout: float, base: str) -> dict[str, Any]:
    """``adapter_config.json`` for PEFT's ``LoraConfig``: ``ranks`` {module path: (r, alpha)}; the exact module
    paths as targets, the ranks and alphas that differ from the first module's in ``rank_pattern`` /
    ``alpha_pattern`` (a text r=16 beside a vision r=8)."""
    modules = sorted(ranks)
    rank, alpha = ranks[modules[0]]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "rank_pattern": {m: r for m, (r, _) in ranks.items() if r != rank},
        "alpha_pattern": {m: a for m, (_, a) in ranks.items() if a != alpha},
    }
