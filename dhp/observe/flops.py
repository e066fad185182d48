"""Model FLOPs and MFU, generic over model families.

*Model FLOPs* are the matmul FLOPs a step's forward and backward need, counted as
``torch.utils.flop_counter.FlopCounterMode`` counts them: ``2*m*n*k`` per matmul
(linear layers, attention's ``QK^T`` and ``AV``), attention over the full
``s x s`` square of each segment even when causal (as PaLM's and torchtitan's MFU
formulas do: the causal half that kernels skip is not subtracted), backward twice
the forward except for a weight whose input needs no gradient (only the weight
gradient is computed). Activation-checkpoint recomputation is not model work and
is not counted. Elementwise ops, norms and softmax are not counted.

A family gives a closed form per module (``Module.flops``: ``(SampleInfo,
model_cfg) -> (forward, backward)``); a test checks it against ``FlopCounterMode``
on the meta device (``count_forward_backward``), where nothing is allocated, so
the 7B preset is counted on a laptop.

MFU of a module group in a step::

    mfu = model FLOPs of the group's samples in the step / (step time * ranks of the group * peak FLOP/s per rank)

Peak: on a GPU the device table (``dhp.observe.devices``) or ``runtime.peak_tflops``;
on a CPU the measured float32 matmul throughput of this machine with the threads a
rank uses (``cpu_matmul_peak``), labelled as such: CPU MFU says how close the step
comes to what the machine's matmuls can do, not to a vendor figure.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# ---- counting on the meta device ------------------------------------------------------------------


def count_forward_backward(forward: Callable[[], torch.Tensor | dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(forward, backward) FLOPs of ``forward()`` and of backpropagating its (scalar or summed) result, or the
    sum of its named results (a mapping of tensors), as ``FlopCounterMode`` counts them. Run it on meta
    tensors: shapes only, no memory, no compute."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        out = forward()
    fwd = float(fc.get_total_flops())
    parts = out.values() if isinstance(out, dict) else (out,)  # a module of named outputs: every one of them
    loss = sum(p if p.dim() == 0 else p.float().sum() for p in parts)
    with FlopCounterMode(display=False) as fc:
        loss.backward()
    return fwd, float(fc.get_total_flops())


def shape_only_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                causal: bool) -> torch.Tensor:
    """``dhp.ops.attention.packed_attention`` with the segment bookkeeping in Python, so that it runs on the
    meta device (the original groups segments with ``torch.unique`` on q's device, which needs values).
    The same SDPA calls on the same shapes: the same FLOPs. ``cu_seqlens`` must be a CPU tensor, a list or
    ``Segments``."""
    if hasattr(cu_seqlens, "bounds"):  # dhp.ops.attention.Segments (host metadata)
        cu_seqlens = cu_seqlens.bounds
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    seq, n_heads, head_dim = q.shape
    if bounds[-1] != seq:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the sequence has {seq} tokens")
    if seq == 0:
        return q * 0 + (k.sum() + v.sum()) * 0
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            by_length[end - start].append(start)
    out = q.new_empty(q.shape)
    gqa = k.shape[1] != n_heads
    for length, starts in by_length.items():
        idx = (torch.tensor(starts, device="cpu")[:, None] + torch.arange(length)).reshape(-1).to(q.device)
        qs, ks, vs = (t.index_select(0, idx).view(len(starts), length, t.shape[1], -1).transpose(1, 2)
                      for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        out = out.index_copy(0, idx, o.transpose(1, 2).reshape(-1, n_heads, head_dim))
    return out


# ---- per step ----------------------------------------------------------------------------------------

FlopsFn = Callable[[Any, Any], tuple[float, float]]  # (SampleInfo, model_cfg) -> (forward, backward)


def sample_flops(family: Any, model_cfg: Any, infos: Sequence[Any], trains: dict[str, bool]) -> dict[str, list[float]]:
    """Per module of ``family`` (``Module.flops``: a closed form, or the 2-FLOPs-per-parameter default): each
    sample's model FLOPs, forward plus backward where the module runs a backward (``trains[module]``; the
    language model always does: it backpropagates to the encoders' embeddings)."""
    out: dict[str, list[float]] = {}
    for module in family.modules:
        backward = trains.get(module.name, True)
        values = []
        for info in infos:
            fwd, bwd = module.flops(info, model_cfg)
            values.append(fwd + (bwd if backward else 0.0))
        out[module.name] = values
    return out


def mfu(flops: float, seconds: float, ranks: int, peak_flops_per_rank: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the group's peak."""
    if seconds <= 0 or ranks <= 0 or peak_flops_per_rank <= 0:
        return 0.0
    return flops / (seconds * ranks * peak_flops_per_rank)


# ---- peak FLOP/s ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    flops: float  # per rank, FLOP/s
    label: str  # what the figure is: "H200 SXM 141GB bf16 (device table)", "measured CPU float32 matmul, 1 thread"


_CPU_PEAK: dict[int, float] = {}


def cpu_matmul_peak(threads: int | None = None, seconds: float = 1.0, n: int = 512) -> float:
    """This machine's float32 matmul FLOP/s with ``threads`` threads (default: torch's), measured once per
    thread count in this process: a ``seconds``-long loop of ``n x n`` matmuls, the best of its rounds."""
    threads = threads or torch.get_num_threads()
    if threads in _CPU_PEAK:
        return _CPU_PEAK[threads]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm up
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            dt = time.perf_counter() - t0
            best = max(best, 4 * 2 * n**3 / dt)
    finally:
        torch.set_num_threads(before)
    _CPU_PEAK[threads] = best
    return best


def device_peak(device_name: str | None, peak_tflops: float | None = None) -> Peak | None:
    """Peak bf16 FLOP/s of a GPU by its name (the device table, ``dhp.observe.devices``), or ``peak_tflops``
    where given; None for a GPU the table does not know and no override."""
    if peak_tflops:
        return Peak(peak_tflops * 1e12, f"runtime.peak_tflops={peak_tflops:g}")
    from dhp.observe.devices import DEVICES

    name = (device_name or "").lower()
    for key, dev in DEVICES.items():
        if key in name:
            return Peak(dev.peak_flops, f"{dev.name} bf16 dense peak (device table)")
    return None


def run_peak(gpu: bool, device_name: str | None, peak_tflops: float | None, cpu_threads: int = 1) -> Peak | None:
    """The peak per rank a run's MFU is measured against (see the module docstring)."""
    if gpu or peak_tflops:
        return device_peak(device_name, peak_tflops)
    flops = cpu_matmul_peak(cpu_threads)
    return Peak(flops, f"measured CPU float32 matmul peak, {cpu_threads} thread(s): {flops / 1e9:.1f} GFLOP/s")
