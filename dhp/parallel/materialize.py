"""Shard-local weights: deterministic random init and Hugging Face safetensors loading, per rank, per shard.

A module is built on the meta device and parallelized there (TP, SP, activation
checkpointing, FSDP2); ``to_empty`` then gives every parameter its local storage
(a plain tensor, or a DTensor's local shard). This file fills that storage
without any rank ever holding the whole module:

``init_by_name(module, seed, rule)``
    Each parameter's values are a function of ``(seed, parameter name)`` only. A
    parameter is cut into fixed row chunks (``rows_per_chunk`` depends on its
    *global* shape alone); chunk ``c`` is drawn from a generator seeded by
    ``(seed, name, c)``. A rank draws only the chunks that cover its rows and keeps
    its slice, so the values are bit-identical in every layout (plain, TP
    ``Shard(0)``/``Shard(1)``, FSDP2 ``Shard(0)``, FSDP over TP ``_StridedShard``,
    uneven shards) and the largest temporary is one chunk.
``load_by_name(module, source, ...)``
    Each rank reads only its slice of each tensor (``safe_open(...).get_slice(key)[...]``)
    from the files an index names; a dict of full tensors works the same way (tests). A parameter that the
    source stores as several tensors (a fused q/k/v or gate/up: ``key_of`` gives their names) reads as their
    concatenation on dim 0, each part's rows read only where the shard needs them.

Which global indices a rank holds comes from the DTensor's own placements:
every placement that shards a dimension splits that dimension's index list
exactly as it splits the tensor (``Placement._split_tensor``), in mesh order,
as ``distribute_tensor`` does. The local shard is then the Cartesian product of
the per-dimension index lists (each a contiguous range except under
``_StridedShard``, where it is ascending but may have gaps).

Parameters whose global layout is not the canonical one (``transforms``, e.g. a
fused qkv whose rows a TP plan groups by rank) are made whole in the canonical
order, passed through ``from_canonical``, then sliced.

Generic: nothing here knows a model family. Names are the module's own parameter
names (activation-checkpoint wrapper prefixes removed).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dhp.errors import CheckpointError  # (a checkpoint that does not fit: the message names tensor and file)

__all__ = [
    "CHUNK_ELEMS",
    "DictSource",
    "SafetensorsSource",
    "canonical_shape",
    "fused_shape",
    "init_by_name",
    "load_by_name",
    "local_index",
    "read_fused",
    "to_empty",
    "track_materialized",
]

Init = tuple  # ("normal", std) | ("zeros",) | ("ones",)
Rule = Callable[[str, torch.Tensor], Init]  # (parameter name, parameter) -> how to initialise it
CHUNK_ELEMS = 1 << 20  # elements per init chunk (rows of a parameter, at least one row); part of the init's definition

INDEX_FILE = "model.safetensors.index.json"


# ---- what a rank materialises (tests and benchmarks count it) ---------------------------------------------------
_observers: list[Callable[[str, int], None]] = []


def _observe(name: str, t: torch.Tensor) -> None:
    for fn in _observers:
        fn(name, t.numel())


@contextmanager
def track_materialized() -> Iterator[dict[str, int]]:
    """``{parameter name: largest temporary tensor (elements)}`` created by init/load inside the block
    (generated chunks, whole canonical tensors, slices read from a checkpoint)."""
    seen: dict[str, int] = {}

    def record(name: str, numel: int) -> None:
        seen[name] = max(seen.get(name, 0), numel)

    _observers.append(record)
    try:
        yield seen
    finally:
        _observers.remove(record)


# ---- which global indices this rank holds -------------------------------------------------------------------------
Index = list  # per dimension: a slice (contiguous range) or a 1-D LongTensor of ascending global indices


def local_index(param: torch.Tensor) -> Index:
    """Per dimension, the global indices of ``param``'s local part (everything for a plain tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return [slice(0, n) for n in shape]
    mesh = param.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # not part of the mesh: holds nothing
        return [slice(0, 0) for _ in shape]
    idx: list[torch.Tensor | None] = [None] * len(shape)
    for mesh_dim, pl in enumerate(param.placements):
        if not isinstance(pl, (Shard, _StridedShard)):
            continue  # Replicate / Partial: the whole dimension
        d = pl.dim % len(shape)
        cur = idx[d] if idx[d] is not None else torch.arange(shape[d])
        # the same split on the (1-D) list of dimension d's indices
        on_list = _StridedShard(0, split_factor=pl.split_factor) if isinstance(pl, _StridedShard) else Shard(0)
        pieces, _ = on_list._split_tensor(cur, mesh.size(mesh_dim), with_padding=False, contiguous=True)
        i = coord[mesh_dim]
        idx[d] = pieces[i] if i < len(pieces) else cur[:0]
    return [slice(0, n) if ix is None else _as_slice(ix) for ix, n in zip(idx, shape, strict=True)]


def _as_slice(ix: torch.Tensor) -> slice | torch.Tensor:
    if ix.numel() == 0:
        return slice(0, 0)
    start = int(ix[0])
    if torch.equal(ix, torch.arange(start, start + ix.numel())):
        return slice(start, start + ix.numel())
    return ix


def _bounds(ix: slice | torch.Tensor) -> tuple[int, int]:
    if isinstance(ix, slice):
        return ix.start, ix.stop
    return int(ix[0]), int(ix[-1]) + 1


def _select(t: torch.Tensor, index: Index, offsets: list[int] | None = None) -> torch.Tensor:
    """``t[index]`` (per dimension), ``t`` holding the global region that starts at ``offsets``."""
    for d, ix in enumerate(index):
        off = offsets[d] if offsets else 0
        if isinstance(ix, slice):
            if ix.start - off != 0 or ix.stop - off != t.shape[d]:
                t = t.narrow(d, ix.start - off, ix.stop - ix.start)
        else:
            t = t.index_select(d, ix - off)
    return t


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param.data


def _unwrapped(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "")


def _unique_params(module: nn.Module) -> list[tuple[str, list[str], torch.Tensor]]:
    """(first name, every name, parameter) per distinct parameter: tied weights once, under their first name."""
    out: dict[int, tuple[str, list[str], torch.Tensor]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name = _unwrapped(name)
        if id(p) in out:
            out[id(p)][1].append(name)
        else:
            out[id(p)] = (name, [name], p)
    return list(out.values())


def to_empty(module: nn.Module, device: str | torch.device) -> nn.Module:
    """``module.to_empty(device=device)`` keeping shared (tied) parameters shared.

    For plain meta parameters ``nn.Module._apply`` makes a new Parameter per occurrence, so a tied lm_head and
    embedding would come out as two tensors (DTensor parameters are swapped in place and stay shared)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((m, n))
    module.to_empty(device=device)
    for where in places.values():
        first = where[0][0]._parameters[where[0][1]]
        for m, n in where[1:]:
            if m._parameters[n] is not first:
                m._parameters[n] = first
    return module


# ---- deterministic init -------------------------------------------------------------------------------------------
def chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_chunk(shape: tuple[int, ...], chunk_elems: int = CHUNK_ELEMS) -> int:
    row = 1
    for n in shape[1:]:
        row *= n
    return max(1, chunk_elems // max(row, 1))


def _check_rule(name: str, how: Any) -> None:
    ok = isinstance(how, tuple) and (how[:1] in (("zeros",), ("ones",)) or (how[:1] == ("normal",) and len(how) == 2))
    if not ok:
        raise ValueError(f"init rule gave {how!r} for parameter {name}: expected ('normal', std), ('zeros',) "
                         "or ('ones',)")


def _chunk(name: str, seed: int, shape: tuple[int, ...], how: Init, c: int, rows: int, k: int) -> torch.Tensor:
    """Rows [c*k, c*k + rows) of the parameter, in float32."""
    g = torch.Generator().manual_seed(chunk_seed(seed, name, c))
    block = torch.empty((rows, *shape[1:]), dtype=torch.float32).normal_(0.0, float(how[1]), generator=g)
    _observe(name, block)
    return block


def canonical_shape(transform: Any, shape: Sequence[int]) -> tuple[int, ...]:
    """The canonical (checkpoint, HF) shape of a global tensor of ``shape`` in a layout whose ``transform`` is not
    canonical: the same shape, or a smaller one where the layout pads (an uneven fused gate/up under TP)."""
    return tuple(transform.to_canonical(torch.empty(tuple(shape), device="meta")).shape)


def generate_full(name: str, shape: tuple[int, ...], seed: int, how: Init,
                  chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """The whole parameter, as every rank's slices of it assemble (float32): the reference's values."""
    if how[0] != "normal":
        return (torch.zeros if how[0] == "zeros" else torch.ones)(shape)
    flat = shape if shape else (1,)
    k = rows_per_chunk(flat, chunk_elems)
    rows = flat[0]
    parts = [_chunk(name, seed, flat, how, c, min(k, rows - c * k), k) for c in range(-(-rows // k))]
    out = torch.cat(parts) if parts else torch.empty(flat)
    _observe(name, out)
    return out.reshape(shape)


def _init_local(name: str, param: torch.Tensor, seed: int, how: Init, chunk_elems: int) -> None:
    local = _local(param)
    if local.numel() == 0:
        return
    if how[0] in ("zeros", "ones"):
        local.fill_(0.0 if how[0] == "zeros" else 1.0)
        return
    shape = tuple(param.shape)
    if not shape:  # a scalar parameter: one row
        local.copy_(generate_full(name, shape, seed, how, chunk_elems))
        return
    index = local_index(param)
    k = rows_per_chunk(shape, chunk_elems)
    rows_ix = index[0]
    rows = torch.arange(rows_ix.start, rows_ix.stop) if isinstance(rows_ix, slice) else rows_ix
    chunk_of = rows // k
    pos = 0  # local rows are ascending global rows: each chunk's rows are a contiguous run of local rows
    for c in torch.unique_consecutive(chunk_of).tolist():
        mine = rows[chunk_of == c]
        n_rows = min(k, shape[0] - c * k)
        block = _chunk(name, seed, shape, how, c, n_rows, k)
        part = _select(block, [_as_slice(mine - c * k), *index[1:]])
        local[pos:pos + len(mine)].copy_(part)
        pos += len(mine)


def init_by_name(module: nn.Module, seed: int, rule: Rule, *,
                 transforms: Mapping[str, Any] | None = None, chunk_elems: int = CHUNK_ELEMS) -> None:
    """Initialise every parameter of ``module`` (plain or DTensor, materialised) from ``(seed, its name)``.

    ``rule(name, param)`` says how: ``("normal", std)``, ``("zeros",)`` or ``("ones",)``. Tied parameters are
    initialised once, under their first name. ``transforms``: ``{name: LayoutTransform}`` for parameters whose
    global layout is not the canonical one (made whole in canonical order, ``from_canonical``, then sliced)."""
    transforms = transforms or {}
    with torch.no_grad():
        for name, _, p in _unique_params(module):
            how = rule(name, p)
            _check_rule(name, how)
            if name in transforms:
                whole = generate_full(name, canonical_shape(transforms[name], p.shape), seed, how, chunk_elems)
                full = transforms[name].from_canonical(whole)
                _local(p).copy_(_select(full, local_index(p)))
            else:
                _init_local(name, p, seed, how, chunk_elems)


# ---- sources of full tensors --------------------------------------------------------------------------------------
class TensorSource(Protocol):
    def has(self, key: str) -> bool: ...
    def where(self, key: str | None = None) -> str: ...  # the file (or what) a key lives in, for messages
    def shape(self, key: str) -> tuple[int, ...]: ...
    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor: ...  # the global region ``box``


class DictSource:
    """Full tensors in memory (an explicit state dict)."""

    def __init__(self, state: Mapping[str, torch.Tensor], what: str = "the given state dict") -> None:
        self.state, self.what = state, what

    def has(self, key: str) -> bool:
        return key in self.state

    def where(self, key: str | None = None) -> str:
        return self.what

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self.state[key][box]

    def keys(self) -> set[str]:
        return set(self.state)


@lru_cache(maxsize=8)
def _weight_map(directory: str) -> tuple[dict[str, str], str]:
    """{tensor name: file} of a checkpoint directory (read once per process), and what it was read from."""
    path = Path(directory)
    index = path / INDEX_FILE
    if index.exists():
        try:
            return dict(json.loads(index.read_text())["weight_map"]), str(index)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (expected model.safetensors or {INDEX_FILE})")
    out: dict[str, str] = {}
    for f in files:
        for key in _header(f):
            out[key] = f.name
    return out, str(path)


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets), without reading any tensor."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header


class SafetensorsSource:
    """A Hugging Face checkpoint directory: ``model.safetensors``, or shards named by the index.

    Each read opens the tensor's file, reads the requested region (``safe_open(...).get_slice(key)[box]``) and
    closes it again, so no more of the file stays mapped than the read touched."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.map, self.index = _weight_map(str(self.dir))
        self._shapes: dict[str, tuple[int, ...]] = {}

    def has(self, key: str) -> bool:
        return key in self.map

    def where(self, key: str | None = None) -> str:
        return str(self.dir / self.map[key]) if key is not None and key in self.map else self.index

    def _file(self, key: str) -> Path:
        file = self.dir / self.map[key]
        if not file.exists():
            raise CheckpointError(f"{self.index} puts tensor {key} in {file}, which does not exist")
        return file

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            file = self._file(key)
            header = _header(file)
            if key not in header:
                raise CheckpointError(f"tensor {key} is not in {file} (where {self.index} puts it)")
            for k, v in header.items():
                if self.map.get(k) == file.name:
                    self._shapes[k] = tuple(v["shape"])
        return self._shapes[key]

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._file(key)), framework="pt") as f:
            sl = f.get_slice(key)
            return sl[box] if box else sl[:]


# ---- a tensor stored as several (a fused projection): its parts concatenated on dim 0 ----------------------------
Names = tuple  # the source keys one parameter is made of, in dim-0 order (one, or the parts of a fused one)


def _names(key: str | tuple[str, ...]) -> Names:
    return (key,) if isinstance(key, str) else tuple(key)


def _label(names: Names) -> str:
    return " + ".join(names)


def fused_shape(source: TensorSource, names: Names) -> tuple[int, ...]:
    shapes = [source.shape(k) for k in names]
    if len(shapes) > 1 and len({s[1:] for s in shapes}) != 1:
        raise CheckpointError(f"tensors {list(names)} in {source.where(names[0])} have shapes {shapes}: they do not "
                              "concatenate on dim 0")
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def read_fused(source: TensorSource, names: Names, box: tuple[slice, ...]) -> torch.Tensor:
    """The global region ``box`` of the parts concatenated on dim 0, each part's rows read only where needed."""
    if len(names) == 1:
        return source.read(names[0], box)
    rows = box[0] if box else slice(None)
    start, stop, step = rows.indices(fused_shape(source, names)[0])
    if step != 1:
        raise CheckpointError(f"strided read of fused tensor {_label(names)}")
    pieces, offset = [], 0
    for part in names:
        n = source.shape(part)[0]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            pieces.append(source.read(part, (slice(lo - offset, hi - offset), *box[1:])))
        offset += n
    return torch.cat(pieces)


# ---- shard-local loading ------------------------------------------------------------------------------------------
def load_by_name(module: nn.Module, source: TensorSource, *,
                 key_of: Callable[[str], str | tuple[str, ...]] = lambda n: n,
                 tied: Mapping[str, str] | None = None, transforms: Mapping[str, Any] | None = None,
                 what: str | None = None, strict_unused: bool = False) -> None:
    """Copy this rank's part of every parameter (and persistent buffer) of ``module`` from ``source``.

    ``key_of(name)`` maps a module parameter name to its key in ``source`` (e.g. prefix and HF renaming), or to
    the keys of the tensors it is made of, in dim-0 order (a fused projection: a family's
    ``WeightAdapter.hf_names``), read as their concatenation on dim 0.
    A tied parameter is read once, from the first of its names the source has; ``tied`` ({name: the name it
    shares storage with}, module names) adds partners the module itself does not show.
    ``transforms``: as in ``init_by_name`` (the source holds canonical tensors). Raises ``CheckpointError``
    naming the tensor and the file for a missing tensor or a wrong shape; ``strict_unused`` also for source
    keys no parameter used (a ``DictSource`` only)."""
    what = what or type(module).__name__
    transforms = transforms or {}
    tied = dict(tied or {})
    partner = {**tied, **{v: k for k, v in tied.items()}}
    entries: list[tuple[str, list[str], torch.Tensor]] = _unique_params(module)
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if leaf not in sub._non_persistent_buffers_set:
            entries.append((_unwrapped(name), [_unwrapped(name)], buf))
    used: set[str] = set()
    with torch.no_grad():
        for name, names, p in entries:
            names = names + [partner[n] for n in names if n in partner and partner[n] not in names]
            keys = [_names(key_of(n)) for n in names]
            key = next((k for k in keys if all(source.has(part) for part in k)), None)
            if key is None:
                missing = [part for part in keys[0] if not source.has(part)]
                fused = f", made of {list(keys[0])}" if len(keys[0]) > 1 else ""
                raise CheckpointError(f"tensor {', '.join(missing)} (parameter {name} of the {what}{fused}) "
                                      f"is not in {source.where()}")
            used.update(part for k in keys for part in k if source.has(part))
            want = canonical_shape(transforms[name], p.shape) if name in transforms else tuple(p.shape)
            got = fused_shape(source, key)
            if got != want:
                raise CheckpointError(f"tensor {_label(key)} in {source.where(key[0])} has shape {list(got)}, but "
                                      f"parameter {name} of the {what} has shape {list(want)}")
            local = _local(p)
            index = local_index(p)
            if name in transforms:
                full = read_fused(source, key, tuple(slice(0, n) for n in want))
                _observe(name, full)
                try:
                    full = transforms[name].from_canonical(full)
                except RuntimeError as e:
                    raise CheckpointError(f"tensor {_label(key)} in {source.where(key[0])}: its layout does not fit "
                                          f"this parallel layout ({e})") from None
                local.copy_(_select(full, index))
                continue
            if local.numel() == 0:
                continue
            bounds = [_bounds(ix) for ix in index]
            box = tuple(slice(a, b) for a, b in bounds)
            part = read_fused(source, key, box)
            _observe(name, part)
            local.copy_(_select(part, index, [a for a, _ in bounds]))
    if strict_unused and hasattr(source, "keys"):
        unused = sorted(set(source.keys()) - used)
        if unused:
            raise CheckpointError(f"{source.where()}: tensors that are not part of the {what}: {unused}")
