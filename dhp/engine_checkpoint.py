"""Worker side of checkpoints: one module engine's shards, written and read with torch.distributed.checkpoint.

Each module group writes its own directory (``checkpoints/step_N/<module>/``) over
its own process group; every rank writes only what it holds. The state is keyed by
parameter name, in the canonical (global) layout, so any layout and either backend
can read it (DCP reshards DTensors on load):

    model.<param>                     the weight: a DTensor as sharded (TP, FSDP2), or a plain tensor
    optim.<param>.<state>             the optimizer state of that parameter (exp_avg, momentum_buffer, step)
    rng.<rank>                        this rank's torch RNG state (uint8); restored when the layout is the same

``path`` may be an fsspec URL (``s3://bucket/run/...``): DCP's fsspec writer and reader then write and read
the object store directly from every rank. Only tensors are stored, so reading a checkpoint unpickles
nothing of ours (DCP's own ``.metadata`` file is torch's pickle of the tensors' layout). The LR schedule is a function
of the step, which the driver's record holds. ZeRO-1: each rank writes the optimizer state of
the parameters it owns; a TP rank's ZeRO-1 state is a local shard, saved as a slice of a
DTensor laid out like its parameter. Parameters whose global layout is not canonical under a
layout (the family's ``layout_transforms``) are stored whole and canonical.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dhp.errors import CheckpointError

__all__ = ["load_engine", "quiet_single_process", "save_engine"]


def _named_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n.replace("._checkpoint_wrapped_module", ""): p for n, p in module.named_parameters()}


def _optimizer_states(engine: Any) -> dict[str, tuple[nn.Parameter, torch.Tensor | None, dict[str, Any]]]:
    """{param name: (parameter, the tensor the optimizer steps (its local stand-in under ZeRO-1 x TP), state)}
    for the parameters whose optimizer state lives on this rank."""
    opt = engine.optimizer
    if opt is None:
        return {}
    from torch.distributed.optim import ZeroRedundancyOptimizer

    name_of = {id(p): n for n, p in _named_params(engine.module).items()}
    out: dict[str, tuple[nn.Parameter, torch.Tensor | None, dict[str, Any]]] = {}
    if isinstance(opt, ZeroRedundancyOptimizer):
        param_of = {id(local): p for p, local in getattr(opt, "_pairs", [])}  # ZeRO-1 x TP: stand-in -> param
        local_opt = opt.optim
        for group in local_opt.param_groups:
            for stepped in group["params"]:
                param = param_of.get(id(stepped), stepped)
                out[name_of[id(param)]] = (param, stepped, local_opt.state.setdefault(stepped, {}))
        return out
    for group in opt.param_groups:
        for p in group["params"]:
            out[name_of[id(p)]] = (p, p, opt.state.setdefault(p, {}))
    return out


def _state_keys(engine: Any) -> tuple[str, ...]:
    """The per-parameter state the trainer's optimizers keep once they have stepped."""
    return ("momentum_buffer",) if engine.cfg.train.optimizer == "sgd" else ("step", "exp_avg", "exp_avg_sq")


def _as_global(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A state tensor in its parameter's global layout (a ZeRO-1 x TP state is the local shard of a DTensor)."""
    if isinstance(param, DTensor) and not isinstance(t, DTensor) and t.shape == param.to_local().shape:
        return DTensor.from_local(t, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return t


def _canonical(t: torch.Tensor, transform: Any) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return transform.to_canonical(full.detach())


def engine_state(engine: Any, rank: int) -> dict[str, Any]:
    """What this rank writes for its engine (tensors only, keyed by parameter name)."""
    transforms = engine.layout_transforms()
    model = {}
    for name, t in engine.module.state_dict().items():
        name = name.replace("._checkpoint_wrapped_module", "")
        model[name] = _canonical(t, transforms[name]) if name in transforms else t
    optim: dict[str, torch.Tensor] = {}
    for name, (param, _, state) in _optimizer_states(engine).items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim():
                value = _as_global(value, param)
                value = _canonical(value, transforms[name]) if name in transforms else value
            optim[f"{name}.{key}"] = value
    return {"model": model, "optim": optim, "rng": {str(rank): torch.get_rng_state()}}


def save_engine(engine: Any, path: str | Path, group: Any, rank: int) -> None:
    """Write this rank's shards of the engine to ``path`` (collective over ``group``: every rank calls it)."""
    state = engine_state(engine, rank)
    with quiet_single_process():
        dcp.save(state, checkpoint_id=str(path), process_group=group, no_dist=group is None, **_storage(path, "w"))


def load_engine(engine: Any, path: str | Path, group: Any, rank: int, step: int, same_layout: bool) -> None:
    """Read the engine's weights and optimizer state from ``path`` into this rank's shards (collective).

    The template is this layout's own state, so DCP reads exactly this rank's slices; parameters the
    family stores canonically are read whole and laid out here. The RNG state is restored only when the
    checkpoint was written by the same layout (``same_layout``): a rank of another layout has no own state.
    The LR schedule is set to where it was after ``step`` optimizer steps."""
    transforms = engine.layout_transforms()
    model_t: dict[str, torch.Tensor] = {}
    for name, t in engine.module.state_dict().items():
        name = name.replace("._checkpoint_wrapped_module", "")
        model_t[name] = _full_like(t, transforms[name]) if name in transforms else t
    optim_t: dict[str, torch.Tensor] = {}
    targets: dict[str, tuple[torch.Tensor, torch.Tensor, dict, str]] = {}
    for name, (param, stepped, state) in _optimizer_states(engine).items():
        for key in _state_keys(engine):
            if key == "step":
                value = torch.zeros((), dtype=torch.float32)
            else:
                value = torch.zeros_like(param) if name not in transforms else _full_like(param, transforms[name])
            optim_t[f"{name}.{key}"] = value
            targets[f"{name}.{key}"] = (param, stepped, state, key)
    template: dict[str, Any] = {"model": model_t, "optim": optim_t}
    if same_layout:
        template["rng"] = {str(rank): torch.get_rng_state()}
    try:
        with quiet_single_process():
            dcp.load(template, checkpoint_id=str(path), process_group=group, no_dist=group is None,
                     **_storage(path, "r"))
    except Exception as e:  # noqa: BLE001 - DCP wraps a bad file in several exception types
        raise CheckpointError(f"{path}: cannot load this module's shards ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e
    params = _named_params(engine.module)
    with torch.no_grad():
        for name, t in model_t.items():
            if name in transforms:
                _copy_canonical(params[name], t, transforms[name])
        for key, value in optim_t.items():
            param, stepped, state, skey = targets[key]
            name = key[: -len(skey) - 1]
            if value.dim() and name in transforms:
                value = _layout_like(transforms[name].from_canonical(value), param)
            if isinstance(value, DTensor) and not isinstance(stepped, DTensor):
                value = value.to_local()  # ZeRO-1 x TP steps the local stand-in
            state[skey] = value
    if same_layout:
        torch.set_rng_state(template["rng"][str(rank)])
    engine.restore_schedule(step)


def _storage(path: str | Path, mode: str) -> dict[str, Any]:
    """DCP's fsspec writer/reader where ``path`` is a URL (``s3://...``: each rank writes its shards to the object
    store itself); nothing for a local path (DCP's file writer, as always)."""
    from dhp.storage import dcp_reader, dcp_writer, is_url

    if not is_url(str(path)):
        return {}
    return {"storage_writer": dcp_writer(path)} if mode == "w" else {"storage_reader": dcp_reader(path)}


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' when one process saves or reads: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _full_like(t: torch.Tensor, transform: Any) -> torch.Tensor:
    """A whole canonical tensor to read ``t`` into (canonical shape: a padded layout's is smaller)."""
    from dhp.parallel.materialize import canonical_shape

    return torch.zeros(canonical_shape(transform, t.shape), dtype=t.dtype,
                       device=t.to_local().device if isinstance(t, DTensor) else t.device)


def _layout_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` (global, canonical order already undone) laid out as ``param``: this rank's slice, no communication."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def _copy_canonical(param: torch.Tensor, canonical: torch.Tensor, transform: Any) -> None:
    laid = _layout_like(transform.from_canonical(canonical), param)
    target = param.to_local() if isinstance(param, DTensor) else param
    target.copy_(laid.to_local() if isinstance(laid, DTensor) else laid)
