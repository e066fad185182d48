"""The Ray backend: a vision group and a text group, the router between them, the step schedule.

One step, per micro-batch round k (``StepPlan.rounds``):

    vision[q].forward(k, ids_q)                      every vision replica encodes its share
    vision[q].emit(k, ids_q ∩ ids_r) -> text[r]      router: embeddings to the text replica that needs them
    text[r].forward_backward(k, ids_r, *embeds)      summed loss of the replica's micro-batch
    text[r].emit_grads(k, ids_r ∩ ids_q) -> vision[q] router: gradients back to their producer
    vision[q].backward(k, ids_q, *grads)

then ``finish_gradients(1 / N)`` on every rank (N = supervised tokens of the whole
global batch), one global norm from both groups, ``step(clip_coef)``.

Every call is submitted without waiting; Ray runs an actor's calls in
submission order, each as soon as its arguments exist. So the schedule is the
submission order: in ``disaggregated`` placement the vision forwards of the
next ``runtime.vision_ahead`` rounds are submitted before the current round's
backward, and the vision group works on them while the text group computes;
``collocated`` groups share devices and take turns (ahead = 0). The driver holds
ObjectRefs; tensors go worker to worker.
"""

from __future__ import annotations

import math
import time
from typing import Any

from dhp.config import ConfigError
from dhp.data.sampler import Round, StepPlan
from dhp.runtime.group import ModuleSpec, Runtime, WorkerGroup
from dhp.runtime.placement import LayoutError
from dhp.runtime.worker import TextWorker, VisionWorker
from dhp.train import RunInputs, StepStats, clip_coefficient, module_state


def group_sizes(inputs: RunInputs) -> dict[str, int]:
    """Ranks per module; rejects layouts this runtime cannot run, before any actor starts."""
    cfg = inputs.cfg
    sizes = {}
    for name in ("vision", "text"):
        p = getattr(cfg, name).parallel
        if (p.sp, p.tp, p.zero) != (1, 1, 0) or p.sequence_parallel:
            raise ConfigError(f"{name}.parallel: sp/tp/zero are not available in this runtime yet; use dp")
        sizes[name] = p.dp
    return sizes


class RayBackend:
    def __init__(self, inputs: RunInputs, dataset_spec: dict[str, Any]) -> None:
        cfg = inputs.cfg
        rt = cfg.runtime
        self.cfg = cfg
        sizes = group_sizes(inputs)
        self.ahead = rt.vision_ahead if rt.placement == "disaggregated" else 0
        self.vision_trains = cfg.vision.trainable or cfg.merger.trainable  # frozen: no backward at all
        self.runtime = Runtime(
            {"vision": ModuleSpec(VisionWorker, sizes["vision"]), "text": ModuleSpec(TextWorker, sizes["text"])},
            placement=rt.placement,
            cpus_per_worker=rt.cpus_per_worker,
            gpus_per_worker=rt.gpus_per_worker,
            transport=rt.transport,
            address=rt.ray_address,
        )
        try:
            self.runtime.start()
            base = {"model_cfg": inputs.model_cfg, "cfg": cfg, **dataset_spec}
            self.vision.call("init_engine", base | {"state": module_state(inputs.init_state, "visual")})
            self.text.call("init_engine", base | {"state": module_state(inputs.init_state, "language")})
        except LayoutError as e:
            self.runtime.shutdown()
            raise ConfigError(f"runtime: {e}") from None
        except BaseException:
            self.runtime.shutdown()
            raise

    @property
    def vision(self) -> WorkerGroup:
        return self.runtime["vision"]

    @property
    def text(self) -> WorkerGroup:
        return self.runtime["text"]

    # ---- one step ------------------------------------------------------------------------------
    def run_step(self, plan: StepPlan) -> StepStats:
        t_start = time.perf_counter()
        rounds = plan.rounds
        vision_refs: list[list[Any]] = []  # vision forward/backward refs, to surface errors
        loss_refs: list[list[Any]] = []
        embeds: list[list[list[Any]]] = []  # [round][text replica] -> refs of its embeddings
        for k in range(len(rounds)):
            while len(embeds) < len(rounds) and len(embeds) <= k + self.ahead:
                j = len(embeds)
                vision_refs.append(self._submit_vision_forward(j, rounds[j]))
                embeds.append([self._embeds_for(j, rounds[j], r) for r in range(len(rounds[j].text))])
            loss_refs.append(self._submit_text(k, rounds[k], embeds[k]))
            if self.vision_trains:
                vision_refs.append(self._submit_vision_backward(k, rounds[k]))
        losses = [self.text.get("forward_backward", refs) for refs in loss_refs]
        for refs in vision_refs:
            self.vision.get("forward/backward", refs)
        loss_sum = sum(loss for per_round in losses for loss, _ in per_round)
        n_sup = sum(n for per_round in losses for _, n in per_round)
        if n_sup == 0:
            raise RuntimeError("a global batch with no supervised token: check the data's assistant replies")
        norm_sq = self._call_both("finish_gradients", 1.0 / n_sup)
        grad_norm = math.sqrt(sum(sum(v) for v in norm_sq.values()))
        coef = clip_coefficient(grad_norm, self.cfg.train.clip_grad_norm)
        reports = self._call_both("step", coef)
        return self._stats(loss_sum / n_sup, n_sup, grad_norm, reports, time.perf_counter() - t_start)

    def _submit_vision_forward(self, k: int, rnd: Round) -> list[Any]:
        return [a.forward.remote(k, list(ids)) for a, ids in zip(self.vision.actors, rnd.vision, strict=True)]

    def _embeds_for(self, k: int, rnd: Round, r: int) -> list[Any]:
        """Refs of the embeddings text replica r needs, one per vision replica holding some of its samples."""
        refs = []
        text_ids = set(rnd.text[r])
        for q, vision_ids in enumerate(rnd.vision):
            shared = sorted(text_ids.intersection(vision_ids))
            if shared:
                last = not any(set(rnd.text[s]).intersection(vision_ids) for s in range(r + 1, len(rnd.text)))
                refs.append(self._tensor_call(self.vision, q, "emit", k, shared, last))
        return refs

    def _submit_text(self, k: int, rnd: Round, embeds: list[list[Any]]) -> list[Any]:
        return [
            a.forward_backward.remote(k, list(ids), *refs)
            for a, ids, refs in zip(self.text.actors, rnd.text, embeds, strict=True)
        ]

    def _submit_vision_backward(self, k: int, rnd: Round) -> list[Any]:
        refs = []
        for q, (actor, vision_ids) in enumerate(zip(self.vision.actors, rnd.vision, strict=True)):
            grads = []
            holders = [r for r in range(len(rnd.text)) if set(rnd.text[r]).intersection(vision_ids)]
            for r in holders:
                shared = sorted(set(rnd.text[r]).intersection(vision_ids))
                last = not any(set(rnd.vision[p]).intersection(rnd.text[r]) for p in range(q + 1, len(rnd.vision)))
                grads.append(self._tensor_call(self.text, r, "emit_grads", k, shared, last))
            refs.append(actor.backward.remote(k, list(vision_ids), *grads))
        return refs

    @staticmethod
    def _tensor_call(group: WorkerGroup, rank: int, method: str, *args: Any) -> Any:
        fn = getattr(group.actors[rank], method)
        if group.tensor_transport is not None:
            fn = fn.options(tensor_transport=group.tensor_transport)
        return fn.remote(*args)

    def _call_both(self, method: str, *args: Any) -> dict[str, list[Any]]:
        refs = {name: self.runtime[name].submit(method, *args) for name in ("vision", "text")}
        return {name: self.runtime[name].get(method, r) for name, r in refs.items()}

    def _stats(self, loss: float, n_sup: int, grad_norm: float, reports: dict[str, list[dict]],
               wall: float) -> StepStats:
        timings: dict[str, float] = {}
        for name, per_rank in reports.items():
            busy = {}
            for rep in per_rank:
                for phase, sec in rep["busy"].items():
                    busy[phase] = max(busy.get(phase, 0.0), sec)
            for phase, sec in busy.items():
                timings[f"{name}_{phase}"] = sec
            timings[f"{name}_idle"] = max(0.0, wall - sum(busy.values()))
        router = sum(rep["bytes_in"] for per_rank in reports.values() for rep in per_rank)
        lr = max(rep["lr"] for per_rank in reports.values() for rep in per_rank)
        memory = max(rep["memory_gb"] for per_rank in reports.values() for rep in per_rank)
        return StepStats(loss, n_sup, grad_norm, lr, timings, router_bytes=router, worker_memory_gb=memory)

    # ---- end -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out = {f"visual.{k}": v for k, v in self.vision.call("state_dict").items()}
        out.update({f"language.{k}": v for k, v in self.text.call("state_dict").items()})
        return out

    def shutdown(self) -> None:
        self.runtime.shutdown()
