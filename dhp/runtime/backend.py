"""The Ray backend: a vision group and a text group, the router between them, the step schedule.

Each module group is a (dp, inner) mesh of ranks: vision replicas of ``sp``
(Ulysses) or ``tp`` (uniform-TP baseline) ranks, text replicas of ``tp`` ranks.
One step, per micro-batch round k (``StepPlan.rounds``):

    vision rank a of replica q:  forward(k, ids_q)                   its slice of the replica's images
    vision rank a -> text replica r:  emit(k, ids_q ∩ ids_r)         router: (token index, embeddings) pieces
    text rank b of replica r:    forward_backward(k, ids_r, *pieces) every TP rank gets every piece
    text head of r -> vision replica q:  emit_grads(k, ids_r ∩ ids_q)  router: whole per-sample gradients
    vision rank a:               backward(k, *grads)                 takes the rows of its own slice

then ``finish_gradients(1 / N)`` on every rank (N = supervised tokens of the whole
global batch), one global norm from both groups (rank 0 of each module speaks
for its module, each shard counted once), ``step(clip_coef)``.

Ray runs an actor's calls in submission order, so the schedule is the
submission order: in ``disaggregated`` placement the vision forwards of the
next ``runtime.vision_ahead`` rounds are submitted before the current round's
text step and vision backward, and the vision group works on them while the
text group computes; ``collocated`` groups share devices and take turns
(ahead = 0). The driver holds ObjectRefs; tensors go worker to worker.

The driver hands a tensor ref on only once the call that made it has finished
(``WorkerGroup.wait_tensors``): each round it waits for the round's vision
forward, then for the text step, before submitting what consumes their
tensors. The groups still overlap (the vision forwards ahead are already
queued); a failed producer is reported at once, by rank; and with Ray Direct
Transport every send/recv pair is started by the driver thread itself, in one
order (``wait_tensors``).
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

from dhp.config import Config, ConfigError
from dhp.data.sampler import Round, StepPlan
from dhp.runtime.group import ModuleSpec, Runtime, WorkerGroup
from dhp.runtime.mesh import ModuleLayout
from dhp.runtime.placement import LayoutError
from dhp.runtime.worker import TextWorker, VisionWorker
from dhp.train import RunInputs, StepStats, clip_coefficient, module_state


class Emitted(NamedTuple):
    """A tensor-producing call's result, still on the worker: the producing rank and its ObjectRef."""

    rank: int
    ref: Any


def module_layouts(cfg: Config, heads: int, kv_heads: int) -> list[ModuleLayout]:
    """The (dp, inner) layout of each group; rejects what cannot work, before any actor starts."""
    v, t = cfg.vision.parallel, cfg.text.parallel
    if v.sp > 1 and v.tp > 1:
        raise ConfigError("vision.parallel: choose sp (Ulysses) or tp (uniform-TP baseline), not both")
    if t.sp > 1:
        raise ConfigError("text.parallel.sp: the language model uses tp (and text.parallel.sequence_parallel)")
    if v.sequence_parallel:
        raise ConfigError("vision.parallel.sequence_parallel: use vision.parallel.sp (Ulysses) for the encoder")
    if v.sp > 1 and heads % v.sp:
        raise ConfigError(f"vision.parallel.sp={v.sp} must divide the vision heads ({heads})")
    if v.tp > 1 and heads % v.tp:
        raise ConfigError(f"vision.parallel.tp={v.tp} must divide the vision heads ({heads})")
    if t.tp > 1 and kv_heads % t.tp:
        raise ConfigError(f"text.parallel.tp={t.tp} must divide the key/value heads ({kv_heads})")
    vision = ModuleLayout("vision", v.dp, v.sp, "sp") if v.sp > 1 else ModuleLayout("vision", v.dp, v.tp, "tp")
    return [vision, ModuleLayout("text", t.dp, t.tp, "tp")]


class RayBackend:
    def __init__(self, inputs: RunInputs, dataset_spec: dict[str, Any]) -> None:
        cfg = inputs.cfg
        rt = cfg.runtime
        self.cfg = cfg
        mcfg = inputs.model_cfg
        self.layouts = module_layouts(cfg, mcfg.vision.num_heads, mcfg.text.num_key_value_heads)
        self.vl, self.tl = self.layouts
        self.ahead = rt.vision_ahead if rt.placement == "disaggregated" else 0
        self.vision_trains = cfg.vision.trainable or cfg.merger.trainable  # frozen: no backward at all
        self.runtime = Runtime(
            {"vision": ModuleSpec(VisionWorker, self.vl.size), "text": ModuleSpec(TextWorker, self.tl.size)},
            placement=rt.placement,
            cpus_per_worker=rt.cpus_per_worker,
            gpus_per_worker=rt.gpus_per_worker,
            transport=rt.transport,
            address=rt.ray_address,
        )
        try:
            self.runtime.start()
            backend = self.runtime.backend
            refs = [g.submit("setup_parallel", self.layouts, backend, getattr(cfg, name).parallel)
                    for name, g in (("vision", self.vision), ("text", self.text))]
            self.vision.get("setup_parallel", refs[0])
            self.text.get("setup_parallel", refs[1])
            device = "cuda" if rt.gpus_per_worker > 0 else "cpu"
            base = {"model_cfg": mcfg, "cfg": cfg, "device": device, **dataset_spec}
            refs = [self.vision.submit("init_engine", base | {"state": module_state(inputs.init_state, "visual")}),
                    self.text.submit("init_engine", base | {"state": module_state(inputs.init_state, "language")})]
            self.vision.get("init_engine", refs[0])
            self.text.get("init_engine", refs[1])
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
        forward_refs: list[list[Any]] = []
        pieces: list[list[list[Emitted]]] = []  # [round][text replica] -> the pieces it needs
        losses: list[list[tuple[float, int]]] = []
        vision_refs: list[list[Any]] = []  # vision backward refs, to surface errors
        for k in range(len(rounds)):
            while len(pieces) < len(rounds) and len(pieces) <= k + self.ahead:  # the vision group runs ahead
                j = len(pieces)
                forward_refs.append(self._submit_vision_forward(j, rounds[j]))
                pieces.append([self._pieces_for(j, rounds[j], r) for r in range(self.tl.dp)])
            self.vision.get("forward", forward_refs[k])  # a failed forward is the root cause of what follows
            self._wait_emitted(self.vision, "emit", [e for per_replica in pieces[k] for e in per_replica])
            loss_refs = self._submit_text(k, rounds[k], pieces[k])
            grads = self._grads_for(k, rounds[k]) if self.vision_trains else []  # frozen: no backward at all
            losses.append(self.text.get("forward_backward", loss_refs))
            if self.vision_trains:
                self._wait_emitted(self.text, "emit_grads", [e for per_replica in grads for e in per_replica])
                vision_refs.append(self._submit_vision_backward(k, grads))
        for refs in vision_refs:
            self.vision.get("backward", refs)
        heads = [self.tl.ranks_of_replica(r)[0] for r in range(self.tl.dp)]  # one loss per text replica
        loss_sum = sum(per_round[b][0] for per_round in losses for b in heads)
        n_sup = sum(per_round[b][1] for per_round in losses for b in heads)
        if n_sup == 0:
            raise RuntimeError("a global batch with no supervised token: check the data's assistant replies")
        norm_sq = self._call_both("finish_gradients", 1.0 / n_sup)
        grad_norm = math.sqrt(norm_sq["vision"][0] + norm_sq["text"][0])  # rank 0 speaks for its module
        coef = clip_coefficient(grad_norm, self.cfg.train.clip_grad_norm)
        reports = self._call_both("step", coef)
        return self._stats(loss_sum / n_sup, n_sup, grad_norm, reports, time.perf_counter() - t_start)

    def _submit_vision_forward(self, k: int, rnd: Round) -> list[Any]:
        return [a.forward.remote(k, list(rnd.vision[self.vl.replica_of(i)]))
                for i, a in enumerate(self.vision.actors)]

    def _pieces_for(self, k: int, rnd: Round, r: int) -> list[Emitted]:
        """The pieces text replica r needs: one per vision rank whose replica holds some of its samples."""
        out = []
        for q, vision_ids in enumerate(rnd.vision):
            shared = sorted(set(rnd.text[r]).intersection(vision_ids))
            if not shared:
                continue
            last = not any(set(rnd.text[s]).intersection(vision_ids) for s in range(r + 1, len(rnd.text)))
            for a in self._emitting_ranks(q):
                out.append(Emitted(a, self.vision.submit_rank(a, "emit", k, shared, last)))
        return out

    def _emitting_ranks(self, q: int) -> list[int]:
        """Vision ranks of replica q that hold distinct pieces: every SP rank; one TP rank (they agree)."""
        ranks = self.vl.ranks_of_replica(q)
        return ranks if self.vl.inner_name == "sp" else ranks[:1]

    def _submit_text(self, k: int, rnd: Round, pieces: list[list[Emitted]]) -> list[Any]:
        refs = []
        for b, actor in enumerate(self.text.actors):
            r = self.tl.replica_of(b)  # every TP rank of replica r gets all of r's pieces
            refs.append(actor.forward_backward.remote(k, list(rnd.text[r]), *(e.ref for e in pieces[r])))
        return refs

    def _grads_for(self, k: int, rnd: Round) -> list[list[Emitted]]:
        """[vision replica] -> the gradients it gets back, one from the head of each text replica it fed."""
        out: list[list[Emitted]] = [[] for _ in rnd.vision]
        for q, vision_ids in enumerate(rnd.vision):
            holders = [r for r in range(len(rnd.text)) if set(rnd.text[r]).intersection(vision_ids)]
            for r in holders:
                shared = sorted(set(rnd.text[r]).intersection(vision_ids))
                last = not any(set(rnd.vision[p]).intersection(rnd.text[r]) for p in range(q + 1, len(rnd.vision)))
                head = self.tl.ranks_of_replica(r)[0]
                out[q].append(Emitted(head, self.text.submit_rank(head, "emit_grads", k, shared, last)))
        return out

    def _submit_vision_backward(self, k: int, grads: list[list[Emitted]]) -> list[Any]:
        return [a.backward.remote(k, *(e.ref for e in grads[self.vl.replica_of(i)]))
                for i, a in enumerate(self.vision.actors)]

    @staticmethod
    def _wait_emitted(group: WorkerGroup, method: str, emitted: list[Emitted]) -> None:
        if emitted:
            group.wait_tensors(method, [e.ref for e in emitted], [e.rank for e in emitted])

    def _call_both(self, method: str, *args: Any) -> dict[str, list[Any]]:
        refs = {name: self.runtime[name].submit(method, *args) for name in ("vision", "text")}
        return {name: self.runtime[name].get(method, r) for name, r in refs.items()}

    def _stats(self, loss: float, n_sup: int, grad_norm: float, reports: dict[str, list[dict]],
               wall: float) -> StepStats:
        timings: dict[str, float] = {}
        for name, per_rank in reports.items():
            busy: dict[str, float] = {}
            for rep in per_rank:
                for phase, sec in rep["busy"].items():
                    busy[phase] = max(busy.get(phase, 0.0), sec)
            for phase, sec in busy.items():
                timings[f"{name}_{phase}"] = sec
            timings[f"{name}_idle"] = max(0.0, wall - sum(busy.values()))
        router = sum(rep["bytes_in"] for per_rank in reports.values() for rep in per_rank)
        lr = max(rep["lr"] for per_rank in reports.values() for rep in per_rank)
        memory = max(rep["memory_gb"] for per_rank in reports.values() for rep in per_rank)
        comm = {f"{name}_{kind}": sum(rep["comm"].get(kind, 0) for rep in per_rank)
                for name, per_rank in reports.items() for kind in sorted({k for r in per_rank for k in r["comm"]})}
        return StepStats(loss, n_sup, grad_norm, lr, timings, router_bytes=router, worker_memory_gb=memory,
                         comm_bytes=comm)

    # ---- end -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        refs = {name: self.runtime[name].submit("state_dict") for name in ("vision", "text")}
        vision = self.vision.get("state_dict", refs["vision"])[0]
        text = self.text.get("state_dict", refs["text"])[0]
        out = {f"visual.{k}": v for k, v in vision.items()}
        out.update({f"language.{k}": v for k, v in text.items()})
        return out

    def shutdown(self) -> None:
        self.runtime.shutdown()
