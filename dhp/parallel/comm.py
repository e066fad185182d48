"""Counting the bytes a rank hands to collectives, per kind, without touching the code that calls them.

Every collective in PyTorch — ``torch.distributed.all_reduce`` and friends
(``c10d`` ops) as well as DTensor's functional collectives (``_c10d_functional``
ops) — goes through the dispatcher, so one ``TorchDispatchMode`` sees them all:
Ulysses' all-to-alls, tensor parallelism's all-reduces and all-gathers, FSDP's
all-gathers and reduce-scatters, data-parallel gradient all-reduces.

Two figures per kind:

* ``bytes``: the payload this rank hands to the collective (the input tensor's
  bytes, whole buffers); it is what closed-form estimates of a layout's traffic
  are written in.
* ``sent``: the bytes this rank sends to OTHER ranks, where that is fixed by the
  call itself rather than by the backend's algorithm: an all-to-all sends its
  input less the chunk it keeps (its own rank's split, so uneven
  ``input_split_sizes`` count exactly), a ``send`` its whole payload. All-reduce,
  all-gather, reduce-scatter and broadcast move what their ring or tree decides,
  so they are not recorded there.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
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


def collective_kind(func) -> str | None:
    """The kind (``all_reduce``, ``all_gather``...) of a collective op of either path (``c10d``,
    ``_c10d_functional``), None for any other op (``wait_tensor`` included)."""
    if func.namespace not in _NAMESPACES:
        return None
    return _KINDS.get(func._schema.name.split("::")[-1])


def payload_bytes(func, args: tuple) -> int:
    """The payload a rank hands to collective ``func`` called with ``args`` (whole buffers)."""
    name = func._schema.name.split("::")[-1]
    return _nbytes(args[_PAYLOAD_ARG.get(name, 0)]) if args else 0


def _dtype_name(x) -> str:
    """A payload's dtype (``bfloat16``, ``float32``): the first tensor's, for a list of them."""
    if isinstance(x, (list, tuple)):
        return _dtype_name(x[0]) if x else "none"
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else "none"


def _process_group(group) -> dist.ProcessGroup:
    """A collective's group as the dispatcher hands it: boxed (c10d ops) or by name (functional ops)."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    return group


def _all_to_all_kept(inp: torch.Tensor, split_sizes, group) -> int:
    """Bytes of ``inp`` (split along dim 0, in equal chunks when ``split_sizes`` is empty) this rank keeps."""
    pg = _process_group(group)
    rows = int(split_sizes[pg.rank()]) if len(split_sizes) else inp.shape[0] // pg.size()
    return rows * (inp.numel() // inp.shape[0] if inp.shape[0] else 0) * inp.element_size()


def _sent_to_others(name: str, func, args: tuple, kwargs: dict) -> int | None:
    """Bytes this rank sends to other ranks, or None where the backend's algorithm decides that."""
    a = dict(zip((x.name for x in func._schema.arguments), args, strict=False)) | kwargs
    if name == "alltoall_base_":
        return _nbytes(a["input"]) - _all_to_all_kept(a["input"], a["input_split_sizes"], a["process_group"])
    if name == "all_to_all_single":
        return _nbytes(a["input"]) - _all_to_all_kept(a["input"], a["input_split_sizes"], a["group_name"])
    if name == "alltoall_":
        inputs = a["input_tensors"]
        return _nbytes(inputs) - _nbytes(inputs[_process_group(a["process_group"]).rank()])
    if name == "send":
        return _nbytes(a["tensors"])
    return None


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: ...`` then ``c.bytes`` ({kind: payload bytes}), ``c.sent`` ({kind: bytes sent
    to other ranks}, all-to-all and send only), ``c.calls`` ({kind: count}) and ``c.dtypes`` ({(kind, payload
    dtype): count}).

    Collectives run in backward are counted too when backward runs inside the block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.dtypes: Counter[tuple[str, str]] = Counter()  # (kind, payload dtype) -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = collective_kind(func)
        if kind is not None:
            name = func._schema.name.split("::")[-1]
            arg = args[_PAYLOAD_ARG.get(name, 0)] if args else None
            self.bytes[kind] += payload_bytes(func, args)
            self.calls[kind] += 1
            self.dtypes[(kind, _dtype_name(arg))] += 1
            sent = _sent_to_others(name, func, args, kwargs)
            if sent is not None:
                self.sent[kind] += sent
        return func(*args, **kwargs)

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.sent.clear()
        self.calls.clear()
        self.dtypes.clear()
