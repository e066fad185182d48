"""What one rank dispatches, op by op, tallied so that a device profile can price it (``dhp.plan.costs``).

The planner's fake run (``dhp.plan.measure``) already dispatches every op ``dhp train`` runs, at the rank's
local shapes. ``OpTally`` watches that stream (beside the memory tracker and the collective counter) and keeps,
per *region* between host syncs (an op whose output the host must read: ``.item()``, ``nonzero``...):

* ``gemm|M|N|K|dtype[|layout]``: how many matmuls of that shape (``mm``, ``addmm``, ``bmm`` with its batch
  folded into M, ``baddbmm``, each also in its ``out=`` and in-place forms; convolutions as their im2col
  GEMM) with their operands laid out so (``gemm_layout``: ``nt``, ``tn``, ``tt``; no suffix: ``nn``, both
  row-major). A linear's forward hands ``mm`` its weight transposed (``x @ w.t()``, DTensor's local shard as
  ``F.linear``'s), its weight gradient the output gradient transposed: a CPU GEMM's rate depends on it
  (``dhp plan calibrate`` measures every layout);
* ``attn|kernel|S|D|dtype``: FLOPs of attention calls by kernel, key length and head width;
* ``mem_bytes``: bytes read and written by every other op that moves data (elementwise, norms, RoPE, softmax,
  copies, the optimizer's foreach kernels): memory-bound work;
* ``ops``: ops dispatched (the CPU's launch work; views count, they cost the host, not the device);
* ``dtensor_ops``: ops dispatched on DTensors (TP, FSDP2's parameters): each pays DTensor's Python dispatch
  (sharding propagation's cache, redistribution, wrapping) on the host before its local ops;
* ``fcoll|kind`` and ``fcoll_calls|kind``: payload bytes and calls of the collectives dispatched through
  ``torch.distributed._functional_collectives`` (``_c10d_functional`` ops: DTensor's redistributions, i.e. TP),
  by ``CommCounter``'s kinds and payload rule. ``CommCounter`` counts every path together; the rest of its
  bytes and calls went through ``c10d`` (FSDP2, Ulysses, the gradient reduction), and ``dhp.plan.costs`` prices
  each part by its own path's fit.

Why a tally and not a trace: a 32B rank dispatches hundreds of thousands of ops, and the planner extends two
shallow runs along the depth (``measure.extrapolate``); a tally of counts per key is linear in the depth,
region by region. Collectives are left to ``dhp.parallel.comm.CommCounter`` (bytes and calls per kind).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_MM = {aten.mm.default, aten.mm.out}
_ADDMM = {aten.addmm.default, aten.addmm.out, aten.addmm_.default}  # (``out=``: the chunked loss's weight grad)
_BMM = {aten.bmm.default, aten.bmm.out}
_BADDBMM = {aten.baddbmm.default, aten.baddbmm.out, aten.baddbmm_.default}
_CONV = {aten.convolution.default, aten.convolution_backward.default}
_SYNC = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
         aten._unique2.default, aten.equal.default, aten.is_nonzero.default}
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
         aten.lift_fresh.default, aten.set_.source_Tensor}
_NAMESPACES_SKIPPED = ("c10d", "_c10d_functional", "_dtensor")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def gemm_key(m: int, n: int, k: int, dtype: str, layout: str = "nn") -> str:
    return f"gemm|{int(m)}|{int(n)}|{int(k)}|{dtype}" + (f"|{layout}" if layout != "nn" else "")


def parse_gemm_key(key: str) -> tuple[int, int, int, str, str]:
    """(M, N, K, dtype, layout) of a ``gemm_key`` (a key without a layout: ``nn``)."""
    _, m, n, k, dtype, *layout = key.split("|")
    return int(m), int(n), int(k), dtype, layout[0] if layout else "nn"


def _major(t: torch.Tensor) -> str:
    """``n`` for a matrix (the last two dims) stored row-major, ``t`` for one handed as a transposed view
    (column-major: unit stride along its rows); anything else ``mm`` copies first, priced as ``n``."""
    if t.dim() < 2 or t.stride(-1) == 1 or t.shape[-1] == 1:
        return "n"
    return "t" if t.stride(-2) == 1 else "n"


def gemm_layout(a: torch.Tensor, b: torch.Tensor) -> str:
    """The layout of ``a @ b`` as the GEMM table keys it: ``nn``, ``nt`` (``x @ w.t()``), ``tn``, ``tt``."""
    return _major(a) + _major(b)


FCOLL_BYTES, FCOLL_CALLS = "fcoll|", "fcoll_calls|"


def fcoll_key(kind: str) -> str:
    return FCOLL_BYTES + kind


def fcoll_calls_key(kind: str) -> str:
    return FCOLL_CALLS + kind


def functional_comm(regions: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """({kind: payload bytes}, {kind: calls}) of the functional collectives tallied over ``regions``."""
    total = merged(regions)
    return ({k.removeprefix(FCOLL_BYTES): v for k, v in total.items() if k.startswith(FCOLL_BYTES)},
            {k.removeprefix(FCOLL_CALLS): v for k, v in total.items() if k.startswith(FCOLL_CALLS)})


def attn_key(kernel: str, s: int, d: int, dtype: str) -> str:
    return f"attn|{kernel}|{int(s)}|{int(d)}|{dtype}"


def _gemm(func: Any, args: tuple) -> tuple[int, int, int, str, str] | None:
    """(M, N, K, dtype, layout) of a matmul op (batch folded into M)."""
    if func in _MM:
        a, b = args[0], args[1]
    elif func in _ADDMM:
        a, b = args[1], args[2]
    elif func in _BMM:
        a, b = args[0], args[1]
        return a.shape[0] * a.shape[1], b.shape[2], a.shape[2], _dtype(a), gemm_layout(a, b)
    elif func in _BADDBMM:
        a, b = args[1], args[2]
        return a.shape[0] * a.shape[1], b.shape[2], a.shape[2], _dtype(a), gemm_layout(a, b)
    else:
        return None
    return a.shape[0], b.shape[1], a.shape[1], _dtype(a), gemm_layout(a, b)


def _conv(func: Any, args: tuple, out: Any) -> tuple[tuple[int, int, int, str], int] | None:
    """The im2col GEMM of a convolution (forward: one; backward: input and weight gradients, two)."""
    if func is aten.convolution.default:
        x, w, y = args[0], args[1], out
    else:  # convolution_backward(grad_output, input, weight, ...)
        y, x, w = args[0], args[1], args[2]
    cout = w.shape[0]
    m = y.numel() // max(1, cout)
    k = w.numel() // max(1, cout)
    return (m, cout, k, _dtype(x)), (1 if func is aten.convolution.default else 2)


def _attention(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[str, int] | None:
    """(key, FLOPs) of an attention kernel call, from torch's own FLOP formulas where it has one."""
    name = func._schema.name.split("::")[-1]
    if "attention" not in name or not args:
        return None
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return None
    q = args[0] if "backward" not in name else args[1]
    k = args[1] if "backward" not in name else args[2]
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        return None
    try:
        flops = formula(*args, **kwargs, out_val=out)
    except Exception:  # a formula this torch cannot apply to these arguments: priced as memory-bound instead
        return None
    return attn_key(kernel_class(name), k.shape[-2], q.shape[-1], _dtype(q)), int(flops)


def kernel_class(op_name: str) -> str:
    """An attention op's kernel family, the same on CPU and CUDA (the fake run dispatches the CPU flash kernel
    where a GPU run takes the CUDA one): ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``varlen_flash``,
    ``varlen_efficient``, ``flex``."""
    name = op_name.split("::")[-1].removeprefix("_").replace("_backward", "").replace("_forward", "")
    if name.startswith("scaled_dot_product_"):
        for kind in ("flash", "efficient", "cudnn"):
            if kind in name:
                return f"sdpa_{kind}"
    if name in ("flash_attention", "efficient_attention"):
        return f"varlen_{name.split('_')[0]}"
    return name


class OpTally(TorchDispatchMode):
    """``with OpTally() as t: ...`` then ``t.regions``: one ``{key: count}`` per region between host syncs.

    Steps aside for DTensor (it sees the local ops DTensor runs, as the planner's FLOP counter does) and for
    the ops of DTensor's sharding propagation (``skip``: a callable saying when an op is not the rank's)."""

    def __init__(self, skip: Any = None) -> None:
        super().__init__()
        self.regions: list[Counter[str]] = [Counter()]
        self.skip = skip or (lambda: False)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            if not self.skip():
                self.regions[-1]["dtensor_ops"] += 1  # DTensor's Python dispatch: host work of its own
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.skip():
            return out
        if func.namespace == "_c10d_functional":
            self._functional_collective(func, args)
        elif func.namespace not in _NAMESPACES_SKIPPED:
            self._count(func, args, kwargs, out)
        return out

    def _functional_collective(self, func: Any, args: tuple) -> None:
        """A collective called through ``_functional_collectives``: its payload by ``CommCounter``'s rule (the
        first argument; its ``wait_tensor`` is the same call's, not counted again)."""
        from dhp.parallel.comm import collective_kind, payload_bytes

        kind = collective_kind(func)
        if kind is None:
            return
        cur = self.regions[-1]
        cur[fcoll_key(kind)] += payload_bytes(func, args)
        cur[fcoll_calls_key(kind)] += 1

    def _count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        cur = self.regions[-1]
        cur["ops"] += 1
        if func in _SYNC:
            self.regions.append(Counter())
            return
        if func.is_view or func in _FREE or not _tensors(out):  # views, allocations, metadata (``prim.device``)
            return
        g = _gemm(func, args)
        if g is not None:
            cur[gemm_key(*g)] += 1
            return
        if func in _CONV:
            shape, n = _conv(func, args, out)
            cur[gemm_key(*shape)] += n
            return
        a = _attention(func, args, kwargs, out)
        if a is not None:
            cur[a[0]] += a[1]
            return
        cur["mem_bytes"] += _bytes(args) + _bytes(out)

    def cut(self) -> int:
        """End the current region without a host sync (a phase boundary the runtime crosses between two calls:
        an encoder's forward and its backward); -> how many regions lie before the cut."""
        self.regions.append(Counter())
        return len(self.regions) - 1

    def tally(self) -> list[dict[str, int]]:
        return [dict(r) for r in self.regions]


def tally_flops(regions: list[dict[str, float]]) -> float:
    """FLOPs of a tally: ``2 M N K`` per matmul (convolutions as their GEMM) and the attention calls' own. The
    same count as ``torch.utils.flop_counter`` (``tests/unit/test_plan_profile.py``): the planner's fake runs
    take their FLOPs from here, without that counter's dispatch mode on every op."""
    total = 0.0
    for key, v in merged(regions).items():
        if key.startswith("gemm|"):
            m, n, k, _, _ = parse_gemm_key(key)
            total += 2.0 * m * n * k * v
        elif key.startswith("attn|"):
            total += v
    return total


def merged(regions: list[dict[str, float]]) -> dict[str, float]:
    """One tally of every region's keys summed."""
    out: Counter[str] = Counter()
    for r in regions:
        out.update(r)
    return dict(out)


def extrapolate_phases(a: list[dict[str, float]], b: list[dict[str, float]], cut_a: int, cut_b: int,
                       t: float) -> tuple[list[dict[str, float]], int]:
    """``extrapolate_regions`` of the regions before each run's cut and of those after it, apart (so the
    forward/backward boundary survives the depth extension) -> (regions, the cut in them)."""
    before = extrapolate_regions(a[:cut_a], b[:cut_b], t)
    return before + extrapolate_regions(a[cut_a:], b[cut_b:], t), len(before)


def extrapolate_regions(a: list[dict[str, float]], b: list[dict[str, float]], t: float) -> list[dict[str, float]]:
    """``a + t (b - a)`` key by key, region by region where both runs have the same regions (a deeper copy of a
    stack adds work inside regions, not syncs); else over one region each, their sums."""
    if len(a) != len(b):
        a, b = [merged(a)], [merged(b)]
    out = []
    for x, y in zip(a, b, strict=True):
        r = {k: x.get(k, 0) + t * (y.get(k, 0) - x.get(k, 0)) for k in {*x, *y}}
        out.append({k: max(0.0, v) for k, v in r.items() if v})
    return out
