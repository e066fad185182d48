"""Counting the bytes a rank hands to collectives, per kind, without touching the code that calls them.

Every collective in PyTorch — ``torch.distributed.all_reduce`` and friends
(``c10d`` ops) as well as DTensor's functional collectives (``_c10d_functional``
ops) — goes through the dispatcher, so one ``TorchDispatchMode`` sees them all:
Ulysses' all-to-alls, tensor parallelism's all-reduces and all-gathers, FSDP's
all-gathers and reduce-scatters, data-parallel gradient all-reduces.

The figure per call is the payload this rank contributes (the input tensor's
bytes); it is what closed-form estimates of a layout's traffic are written in.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without namespace and overload) -> kind
_KINDS = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "send": "send",
    "recv_": "recv",
}
_NAMESPACES = ("c10d", "_c10d_functional")
# positional argument holding the payload, where it is not the first
_PAYLOAD_ARG = {"alltoall_base_": 1, "alltoall_": 1, "allgather_": 1, "_allgather_base_": 1, "reduce_scatter_": 1,
                "_reduce_scatter_base_": 1, "allgather_into_tensor_coalesced_": 1,
                "reduce_scatter_tensor_coalesced_": 1}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: ...`` then ``c.bytes`` ({kind: bytes}) and ``c.calls`` ({kind: count}).

    Collectives run in backward are counted too when backward runs inside the block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES:
            name = func._schema.name.split("::")[-1]
            kind = _KINDS.get(name)
            if kind is not None:
                arg = args[_PAYLOAD_ARG.get(name, 0)] if args else None
                self.bytes[kind] += _nbytes(arg)
                self.calls[kind] += 1
        return func(*args, **kwargs)

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
