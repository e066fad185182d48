"""Gradient reduction as DDP does it: buckets, started from the backward, in one order on every rank.

Why: summing each replicated parameter's gradient with its own all-reduce once
every micro-batch is done makes hundreds of small collectives after the
backward, with the devices idle. Here the gradients of the ranks that hold
partial sums (data-parallel replicas, sequence-parallel ranks) are summed in
buckets of about 25 MiB (torch DDP's default), flattened into one buffer each.
During the step's last backward (``arm``), a post-accumulate-grad hook on every
parameter counts its bucket down; a bucket whose gradients are all final starts
its all-reduce at once, while the backward goes on through earlier layers.

Buckets are cut from the parameters in reverse (the order the backward makes
their gradients) and always start in bucket order, on every rank: a bucket
that is ready waits for the ones before it. A rank whose last backward had
nothing to do (no samples of its modality) is then still in step with its
peers: ``finish`` starts what is left, in order, and waits for all.
Collectives that start in a different order on different ranks would sum the
wrong buffers. A parameter that got no gradient in the last armed backward is
not waited for the next time; should it get one after its bucket left, a
one-integer-per-bucket all-reduce in ``finish`` has every rank sum that bucket
again.

The reduce dtype is the gradients' own: float32 under float32 master weights
(``train.precision=fp32_master``), bfloat16 where the parameters are bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

REDUCE_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket size


def _local(t: torch.Tensor) -> torch.Tensor:
    from dhp.parallel.tensor import local_tensor

    return local_tensor(t)


def cut_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` in consecutive buckets of one dtype and device and at most ``bucket_bytes`` (a
    larger tensor is a bucket of its own)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        first = tensors[buckets[-1][0]] if buckets else None
        if first is None or first.dtype != t.dtype or first.device != t.device or size + nbytes > bucket_bytes:
            buckets.append([i])
            size = nbytes
        else:
            buckets[-1].append(i)
            size += nbytes
    return buckets


class _Launched:
    def __init__(self, grads: list[torch.Tensor], group: Any) -> None:
        self.grads = grads
        self.flat = torch.cat([g.reshape(-1) for g in grads])  # a copy: the gradients stay this rank's own
        self.work = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        offset = 0
        for g in self.grads:
            g.copy_(self.flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def reduce_in_buckets(grads: list[torch.Tensor], group: Any, bucket_bytes: int = REDUCE_BUCKET_BYTES) -> None:
    """Sum ``grads`` over ``group`` in place, in buckets: every bucket's all-reduce started, then all waited for."""
    launched = [_Launched([grads[i] for i in b], group) for b in cut_buckets(grads, bucket_bytes)]
    for x in launched:
        x.finish()


class GradientReducer:
    """Sums ``params``' gradients over ``group`` in buckets; started from the armed backward's hooks."""

    def __init__(self, params: list[nn.Parameter], group: Any, bucket_bytes: int = REDUCE_BUCKET_BYTES) -> None:
        self.params = list(reversed(params))  # the backward makes the last layers' gradients first
        self.group = group
        self.buckets = cut_buckets([_local(p) for p in self.params], bucket_bytes)
        self.bucket_of = {id(self.params[i]): b for b, idx in enumerate(self.buckets) for i in idx}
        self.armed = False
        self._expected: set[int] | None = None  # parameters the last armed backward gave gradients (None: all)
        self._left: list[int] = []
        self._ready: list[bool] = []
        self._late: list[bool] = []
        self._launched: list[_Launched] = []
        self._fired: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def arm(self) -> None:
        """The next backward is the step's last: its hooks start the buckets. A bucket waits for the parameters
        that got gradients in the last armed backward (all of them, the first time)."""
        self.armed = True
        expected = self._expected
        self._left = [sum(1 for i in b if expected is None or id(self.params[i]) in expected) for b in self.buckets]
        self._ready = [n == 0 for n in self._left]
        self._late = [False] * len(self.buckets)
        self._launched = []
        self._fired = set()
        self._launch_in_order()

    def _hook(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if id(p) in self._fired:  # counting on one accumulation per backward would start a bucket too early
            raise RuntimeError("a parameter's gradient accumulated twice in one backward (a reentrant checkpoint "
                               "around a shared weight?): bucketed gradient reduction cannot start from the "
                               "backward; use non-reentrant activation checkpointing")
        self._fired.add(id(p))
        b = self.bucket_of[id(p)]
        if b < len(self._launched):  # its bucket left without it (it had no gradient last time): redone in finish
            self._late[b] = True
            return
        if self._expected is not None and id(p) not in self._expected:
            return  # not counted: the bucket was not waiting for it
        self._left[b] -= 1
        if self._left[b] == 0:
            self._ready[b] = True
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while len(self._launched) < len(self.buckets) and self._ready[len(self._launched)]:
            self._launch(len(self._launched))

    def _launch(self, b: int) -> None:
        grads = []
        for i in self.buckets[b]:
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        self._launched.append(_Launched(grads, self.group))

    def finish(self) -> None:
        """Start the buckets the backward did not (in order), wait for every one; the gradients are sums.

        A bucket that left before one of its parameters got its gradient (that parameter had none in the
        previous step) is summed again, on every rank alike: one small all-reduce says which."""
        if not self.armed:
            self.arm()
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        device = self._launched[0].flat.device if self._launched else torch.device("cpu")
        late = torch.tensor(self._late, dtype=torch.int32, device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX, group=self.group)
        # host flags made on the host: no device value is waited for but this one (the planner's shape-only run
        # has no values: there every rank's flags are its own)
        redo = self._late if is_fake(late) else late.tolist()
        for b, x in enumerate(self._launched):
            if redo[b]:
                x.work.wait()  # its sum misses a late gradient: start again from this rank's own gradients
                _Launched(x.grads, self.group).finish()
            else:
                x.finish()
        if self._fired:  # a rank whose last backward had nothing to do keeps what it learnt
            self._expected = set(self._fired)
        self.armed = False
        self._launched = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


__all__ = ["REDUCE_BUCKET_BYTES", "GradientReducer", "cut_buckets", "reduce_in_buckets"]
