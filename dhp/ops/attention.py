"""Attention over packed sequences, and the host metadata that keeps it free of device syncs.

``packed_attention`` runs attention over a packed sequence cut into independent
segments (images, attention windows, samples) without ever building a mask over
the whole sequence. On CUDA in bfloat16 it runs FlashAttention's variable-length
kernel over the whole sequence (no gather, no scatter); elsewhere (the CPU, the
reference) segments of equal length are gathered into one batch and sent
through ``F.scaled_dot_product_attention``. Windows of Qwen2.5-VL are mostly of
one size, so a window layer is a handful of batched SDPA calls and its memory
grows linearly with the number of tokens. The segments are host metadata
(``Segments``): no layer reads a boundary back from the device.

A leaf: the model families and the parallel layer (Ulysses runs it on its head slices) both import it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from dhp.errors import ConfigError


@contextmanager
def host_metadata() -> Iterator[None]:
    """Compute host-side metadata (segment boundaries, window permutations: small integer tensors derived from
    shapes, never from activations) on real CPU tensors, even inside a ``FakeTensorMode`` (the planner's
    shape-only run, ``dhp plan``). Outside such a mode it does nothing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from dhp.observe.syncs import host_region

    with unset_fake_temporarily(), host_region():  # (the sync audit counts no tensor made here as a device value)
        yield


def has_values(t: torch.Tensor) -> bool:
    """False for a tensor with a shape and no values (a fake or meta tensor): host reads of it are skipped."""
    from torch._subclasses.fake_tensor import is_fake

    return not (t.is_meta or is_fake(t))


class Segments:
    """Host metadata of a packed sequence: where its segments (samples, images, windows, chunks) start and end.

    Why: attention within segments needs their boundaries on the host (the SDPA path groups segments by length;
    varlen kernels take ``max_seqlen`` as an int) and on the device (index tensors, ``cu_seqlens``). Read from a
    device tensor in every layer, each of those is a device-to-host sync that stalls the stream. A ``Segments`` is
    built once per micro-batch from host integers (the batch plan's, or a layout's computed on the CPU) and makes
    each device tensor once, on first use, for all the layers that share it (and for their recomputation under
    activation checkpointing). ``kernel`` is the attention kernel asked for (``train.attention``:
    ``attention_kernel``)."""

    __slots__ = ("bounds", "kernel", "_cache")

    def __init__(self, bounds: Sequence[int], kernel: str = "auto") -> None:
        self.bounds = tuple(int(b) for b in bounds)
        if not self.bounds or self.bounds[0] != 0 or any(n < p for p, n in self._pairs()):
            raise ValueError(f"segment boundaries must start at 0 and never decrease, got {list(self.bounds)[:8]}")
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {kernel!r} is none of {ATTENTION_KERNELS}")
        self.kernel = kernel
        self._cache: dict[Any, Any] = {}

    @classmethod
    def of(cls, cu_seqlens: Segments | torch.Tensor | Sequence[int], kernel: str | None = None) -> Segments:
        """``cu_seqlens`` as ``Segments``: a ``Segments`` as it is (its kernel replaced where ``kernel`` is given),
        or boundaries from a host tensor or list. A device tensor is read back here (one sync): pass host
        metadata instead."""
        if isinstance(cu_seqlens, Segments):
            return cu_seqlens if kernel is None or kernel == cu_seqlens.kernel else cu_seqlens.with_kernel(kernel)
        if isinstance(cu_seqlens, torch.Tensor):
            with host_metadata():
                cu_seqlens = cu_seqlens.tolist()
        return cls(cu_seqlens, kernel or "auto")

    def _pairs(self) -> Iterator[tuple[int, int]]:
        return zip(self.bounds[:-1], self.bounds[1:], strict=True)

    def with_kernel(self, kernel: str) -> Segments:
        return self._memo(("kernel", kernel), lambda: Segments(self.bounds, kernel))

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def max_len(self) -> int:
        return max((b - a for a, b in self._pairs()), default=0)

    def padded(self, extra: int) -> Segments:
        """These segments and one more of ``extra`` tokens at the end (a padding segment no real token sees)."""
        if extra <= 0:
            return self
        return self._memo(("padded", extra), lambda: Segments((*self.bounds, self.total + extra), self.kernel))

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """``[n + 1]`` int32 boundaries on ``device`` (what varlen kernels take), made once per device."""
        return self._memo(("cu", str(device)), lambda: torch.tensor(self.bounds, dtype=torch.int32, device=device))

    def length_groups(self, device: torch.device) -> list[tuple[int, int, torch.Tensor | None]]:
        """(length, count, token rows ``[count * length]`` on ``device``) per distinct non-empty segment length,
        ascending, each group's segments in sequence order; rows None where one group tiles the whole sequence
        in order (no gather needed). Made once per device."""
        def build() -> list[tuple[int, int, torch.Tensor | None]]:
            by_length: dict[int, list[int]] = {}
            for start, end in self._pairs():
                if end > start:
                    by_length.setdefault(end - start, []).append(start)
            if len(by_length) == 1:
                ((length, starts),) = by_length.items()
                if len(starts) * length == self.total:  # equal segments end to end: a view, no gather
                    return [(length, len(starts), None)]
            groups = []
            for length in sorted(by_length):
                starts = torch.tensor(by_length[length], dtype=torch.long, device=device)
                rows = (starts[:, None] + torch.arange(length, device=device)).reshape(-1)
                groups.append((length, len(by_length[length]), rows))
            return groups

        return self._memo(("groups", str(device)), build)

    def _memo(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def __repr__(self) -> str:
        return f"Segments({len(self.bounds) - 1} segments, {self.total} tokens, kernel={self.kernel})"


ATTENTION_KERNELS = ("auto", "sdpa", "varlen")


def attention_kernel(choice: str, q: torch.Tensor) -> str:
    """The kernel ``packed_attention`` runs for ``choice`` (``train.attention``) on ``q``: ``sdpa`` or ``varlen``.

    ``auto``: varlen (FlashAttention's variable-length kernels, ``varlen_kernel``) for a CUDA tensor in half
    precision (bfloat16 or float16, what those kernels take) where one is installed, else the SDPA path (the CPU,
    float32, and the planner's shape-only runs, whose memory and FLOP counts follow the SDPA path). ``varlen``
    asks for it: an error where it cannot run, except in a shape-only run (which prices the SDPA path)."""
    if choice == "sdpa" or not has_values(q):
        return "sdpa"
    usable = varlen_unusable(q.device.type, q.dtype) is None
    if usable and varlen_kernel() is not None:
        return "varlen"
    if choice == "varlen":
        why = varlen_unusable(q.device.type, q.dtype) or \
            "no varlen kernel is installed (torch.nn.attention.varlen or flash_attn)"
        raise ConfigError(f"train.attention=varlen: {why}; use train.attention=auto or sdpa"
                          + ("" if usable else " (or train.dtype=bfloat16 on a GPU)"))
    return "sdpa"


def varlen_unusable(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the varlen kernels cannot run attention on ``device_type`` in ``dtype`` (they take CUDA tensors in
    bfloat16 or float16), or None where they can: checked by ``attention_kernel`` and, before any worker starts,
    by ``dhp train`` (``Run._check_attention``)."""
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return None
    return (f"its kernels run on CUDA in bfloat16/float16, this attention runs on {device_type} in "
            f"{str(dtype).removeprefix('torch.')}")


@functools.cache
def varlen_kernel() -> str | None:
    """Which variable-length attention is installed: ``torch`` (``torch.nn.attention.varlen``, torch >= 2.9),
    ``flash_attn`` (the FlashAttention package, optional), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        return "torch"
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401

        return "flash_attn"
    except ImportError:
        return None


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Segments | torch.Tensor, causal: bool
) -> torch.Tensor:
    """Attention within segments of a packed sequence.

    q: [S, Hq, D], k/v: [S, Hkv, D] (Hq a multiple of Hkv: grouped-query attention),
    cu_seqlens: the segments (``Segments``, host metadata; or a tensor of ``[n_segments + 1]`` cumulative
    boundaries, read on the host) with the last boundary == S.
    Returns [S, Hq, D]. Tokens attend only within their own segment (causally where ``causal``).
    """
    segments = Segments.of(cu_seqlens)
    seq = q.shape[0]
    if segments.total != seq:
        raise ValueError(f"cu_seqlens ends at {segments.total} but the sequence has {seq} tokens")
    if seq == 0:
        # Nothing to attend, but q, k and v stay in the graph: their projections then get a (zero) gradient
        # rather than none. Ranks with no tokens (an empty SP shard, a replica without images) must hand
        # FSDP2 the same gradients as their peers, or its reduce-scatters differ in size (gloo aborts, NCCL hangs).
        return q * 0 + (k.sum() + v.sum()) * 0
    if attention_kernel(segments.kernel, q) == "varlen":
        return varlen_attention(q, k, v, segments, causal)
    return sdpa_packed_attention(q, k, v, segments, causal)


def sdpa_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                          causal: bool) -> torch.Tensor:
    """The SDPA path (the CPU's, and the reference): segments of equal length batched into one
    ``F.scaled_dot_product_attention`` call each, gathered with ``index_select`` and written back with
    ``index_copy_``; equal segments that tile the sequence need neither. No mask over the whole sequence."""
    n_heads, head_dim = q.shape[1], q.shape[-1]
    gqa = k.shape[1] != n_heads
    groups = segments.length_groups(q.device)
    if groups[0][2] is None:  # one length, end to end
        length, n, _ = groups[0]
        qs, ks, vs = (t.reshape(n, length, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(q.shape)
    out = q.new_empty(q.shape)
    for length, n, rows in groups:
        qs, ks, vs = (t.index_select(0, rows).view(n, length, t.shape[1], head_dim).transpose(1, 2)
                      for t in (q, k, v))  # [n, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, n_heads, head_dim))
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     causal: bool) -> torch.Tensor:
    """FlashAttention's variable-length kernel over the whole packed sequence: no gather, no scatter, no padding;
    ``cu_seqlens`` (int32, on the device once per batch) and ``max_seqlen`` (a host int) from ``segments``.
    torch's ``varlen_attn`` where it exists, else the ``flash_attn`` package. CUDA, bfloat16/float16 only."""
    cu = segments.cu_seqlens(q.device)
    longest = segments.max_len
    if varlen_kernel() == "torch":
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        gqa = k.shape[1] != q.shape[1]
        if gqa and "enable_gqa" not in params:  # an older torch: whole heads for every query head
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        kwargs: dict[str, Any] = {"enable_gqa": True} if gqa and "enable_gqa" in params else {}
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
