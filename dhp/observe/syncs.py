"""The sync audit: count the host reads of device values a step makes, per module, on any device (CPU included).

Why: on a GPU every host read of a value the device computed (``int(t)``, ``.item()``, ``.tolist()``,
``.cpu()``, ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``) waits for the stream to drain: the CPU stops queueing kernels until the GPU catches up. One in
every layer costs thousands per step at 64 layers and 65k patches. The hot path is written so that segment
boundaries, token counts and placeholder positions are host metadata (from the batch plan, or computed on the
CPU under ``dhp.ops.attention.host_metadata``), and this audit keeps it so, in the CPU tests.

On the CPU every tensor is a CPU tensor, so "device value" cannot mean "a tensor on the GPU". It means a value
the compute device would hold: a parameter or buffer, a tensor moved with ``.to(device)``, anything a tensor
factory (``arange``, ``zeros``, ...) makes outside a host region, and anything computed from one of those
outside a host region. Host metadata is what the data pipeline made before the step (tensors the audit never
saw, e.g. a loaded sample's grids), what ``torch.tensor(list)`` makes, what is computed only from host values,
and whatever is made inside ``host_region()`` (``host_metadata`` opens one). That is the rule a GPU follows,
and the rule the planner's shape-only run follows too (a value read there must be real, i.e. host metadata).

A ``TorchDispatchMode`` sees ``int(t)``/``.item()`` (``aten._local_scalar_dense``) and the data-dependent ops;
``Tensor.tolist``, ``numpy``, ``cpu`` and ``to`` do not dispatch (on the CPU ``.to("cpu")`` returns the tensor
itself), so they are patched inside the audit only. The mode puts every op through Python: it is a test and
benchmark tool, never on in training. A leaf: imports torch only.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_STATE = threading.local()

# ops whose result size (or value) depends on device values: the host must wait for them
_DATA_DEPENDENT = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
                   "equal")
_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")


@contextmanager
def host_region() -> Iterator[None]:
    """Tensors made inside are host metadata for the audit (``dhp.ops.attention.host_metadata`` opens one)."""
    depth = getattr(_STATE, "host", 0)
    _STATE.host = depth + 1
    try:
        yield
    finally:
        _STATE.host = depth


def in_host_region() -> bool:
    return getattr(_STATE, "host", 0) > 0


@dataclass(frozen=True)
class Read:
    """One host read of a device value: the scope (module) it happened in, what it was, and where (the innermost
    frames of dhp code)."""

    scope: str
    what: str
    where: str


class SyncAudit:
    """``with SyncAudit() as audit: ...`` then ``audit.counts`` ({scope: host reads}), ``audit.reads`` (each
    read, where it happened) and ``audit.ops`` ({scope: ops looked at}).

    ``device``: the compute device (``.to(device)`` makes a device value). Scopes name who reads: ``with
    audit.scope("vision"): ...``, or ``audit.scoped(engine, "vision", ["forward", ...])`` for an object's methods.
    Reads outside every scope count under ``"other"``. Modes are per thread: the audited code runs on this one."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()  # ops dispatched per scope (what the audit looked at)
        self.reads: list[Read] = []
        self._device_values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._scopes: list[str] = []
        self._undo: list[Callable[[], None]] = []
        self._mode = _AuditMode(self)

    # ---- what is a device value ---------------------------------------------------------------------------
    def is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or t in self._device_values)

    def mark(self, t: Any) -> None:
        """Count ``t`` (and a DTensor's local shard) as a device value from now on."""
        if isinstance(t, torch.Tensor):
            self._device_values[t] = True
            local = getattr(t, "_local_tensor", None)
            if isinstance(local, torch.Tensor):
                self._device_values[local] = True

    def watch(self, *modules: torch.nn.Module) -> None:
        """The modules' parameters and buffers are device values (parameters are anyway; buffers need this)."""
        for m in modules:
            for t in (*m.parameters(), *m.buffers()):
                self.mark(t)

    # ---- who reads ------------------------------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def scoped(self, obj: Any, name: str, methods: Iterable[str]) -> None:
        """Run ``obj``'s ``methods`` (those it has) under ``scope(name)`` until the audit exits."""
        for method in methods:
            bound = getattr(obj, method, None)
            if bound is None:
                continue

            def wrapper(*args: Any, _bound: Callable = bound, **kwargs: Any) -> Any:
                with self.scope(name):
                    return _bound(*args, **kwargs)

            setattr(obj, method, wrapper)
            self._undo.append(lambda obj=obj, method=method: obj.__dict__.pop(method, None))

    @property
    def current_scope(self) -> str:
        return self._scopes[-1] if self._scopes else "other"

    def record(self, what: str) -> None:
        scope = self.current_scope
        self.counts[scope] += 1
        self.reads.append(Read(scope, what, _where()))

    def reset(self) -> None:
        self.counts.clear()
        self.ops.clear()
        self.reads.clear()

    def summary(self, limit: int = 20) -> str:
        """The reads, one line each (``scope: what at where``), for an assertion's message."""
        lines = [f"{r.scope}: {r.what} at {r.where}" for r in self.reads[:limit]]
        more = len(self.reads) - limit
        return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))

    # ---- entering and leaving ---------------------------------------------------------------------------------
    def __enter__(self) -> SyncAudit:
        self._patch_tensor_methods()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        while self._undo:
            self._undo.pop()()

    def _patch_tensor_methods(self) -> None:
        """``tolist``, ``numpy`` and ``cpu`` of a device value are reads; ``.to(device)`` makes one."""
        audit, compute = self, self.device

        def reading(name: str) -> None:
            original = getattr(torch.Tensor, name)

            def method(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if audit.is_device(t):
                    audit.record(f"Tensor.{name}")
                return original(t, *args, **kwargs)

            self._replace(name, method)

        for name in ("tolist", "numpy", "cpu"):
            reading(name)
        original_to = torch.Tensor.to

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            out = original_to(t, *args, **kwargs)
            if device is None:
                return out
            if _same_device(device, compute):
                if out is t and not audit.is_device(t):  # the CPU's .to("cpu") is the tensor itself: an alias
                    out = t.view_as(t)
                audit.mark(out)
            elif audit.is_device(t):
                audit.record("Tensor.to(host)")
            return out

        self._replace("to", to)

    def _replace(self, name: str, method: Callable) -> None:
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, method)
        self._undo.append(lambda: setattr(torch.Tensor, name, original))


class _AuditMode(TorchDispatchMode):
    def __init__(self, audit: SyncAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        audit = self.audit
        audit.ops[audit.current_scope] += 1
        from_device = any(audit.is_device(t) for t in tensors)
        what = _read_kind(func, args, kwargs, audit) if from_device else None
        if what is not None:
            audit.record(what)
        out = func(*args, **kwargs)
        # a factory (no tensor input) makes a device value; so does anything computed from one; not in a host region
        if (from_device or not tensors) and not in_host_region():
            for o in tree_flatten(out)[0]:
                audit.mark(o)
        return out


def _read_kind(func: Any, args: tuple, kwargs: dict, audit: SyncAudit) -> str | None:
    """What host read this op on device values makes, or None."""
    name = func._schema.name.split("::")[-1]
    if name == "_local_scalar_dense":
        return "scalar read (int/float/bool/.item())"
    if name in _DATA_DEPENDENT:
        return name
    if name == "repeat_interleave" and kwargs.get("output_size") is None and audit.is_device(args[0]):
        return "repeat_interleave without output_size"
    if name in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        for ix in indices or ():
            if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8) and audit.is_device(ix):
                return f"boolean-mask {name}"
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _where() -> str:
    """The innermost frames of dhp code (file:line function), innermost last."""
    frames = [f for f in traceback.extract_stack()[:-3] if "/dhp/" in f.filename and "/observe/syncs.py" not in
              f.filename]
    return " <- ".join(f"{f.filename.split('/dhp/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


__all__ = ["Read", "SyncAudit", "host_region", "in_host_region"]
