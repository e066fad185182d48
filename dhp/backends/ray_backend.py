"""Driver side of the Ray backend: one worker group per module of the family, the router, the step schedule.

Each module group is a (dp, inner) mesh of ranks: encoder replicas of ``sp``
(Ulysses) or ``tp`` (the uniform-TP baseline) ranks, language-model replicas of
``tp`` ranks. Any number of encoder groups feed the one language-model group.
One step, per micro-batch round k (``StepPlan.rounds``), for every encoder e:

    e rank a of replica q:   forward(k, ids_q)                       its slice of the replica's samples
    e rank a -> text replica r:  emit(k, ids_q ∩ ids_r)              router: (token index, named outputs) pieces
    text rank b of replica r:  forward_backward(k, ids_r, sources, *pieces)   every TP rank gets every piece
                               (p2p under Megatron SP: each TP rank the rows of its sequence slice only)
    text head of r -> e replica q:  emit_grads(k, e, ids_r ∩ ids_q)  router: whole per-sample gradients, by name
    e rank a:                backward(k, *grads)                     takes the rows of its own slice

then ``finish_gradients(1 / N)`` on every rank (N = supervised tokens of the whole
global batch), one global norm from all groups (rank 0 of each module speaks for
its module, each shard counted once), ``step(clip_coef)``.

Ray runs an actor's calls in submission order, so the schedule is the
submission order: in ``disaggregated`` placement the encoder forwards of the
next ``runtime.encoders_ahead`` rounds are submitted before the current round's
text step and encoder backwards, and the encoder groups work on them while the
text group computes; in ``collocated`` placement the encoders encode a whole
encoder window of rounds (``runtime.encoder_window``, ``StepPlan.window``) before
its first text round, each replica its own samples, so every encoder replica
works at once. The order is data: ``dhp.data.sampler.schedule_turns``. The
driver holds ObjectRefs; tensors go worker to worker.

The driver hands a tensor ref on only once the call that made it has finished
(``WorkerGroup.wait_tensors``): each round it waits for the round's encoder
forwards, then (object-store router) for the text step, before submitting what
consumes their tensors. A failed producer is reported at once, by module and rank.
On the p2p data plane the tensors travel inside the calls, so the driver submits
a round's text step and encoder backwards together and takes the losses at the
step's end: the text group starts its next round as soon as it ends the last one,
not a driver round trip later. Its waits on encoder calls watch the text rounds
(``get_watching``): a failed text round raises at once, rather than leaving the
driver waiting on an encoder call queued behind a backward that will never
receive its gradients.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from dhp.backends.base import StepStats, clip_coefficient, global_norm, imbalance, no_supervised_tokens
from dhp.backends.ray_workers import EncoderWorker, LanguageWorker
from dhp.config import Config, ConfigError
from dhp.data.sampler import Round, StepPlan, schedule_turns
from dhp.engine import encoder_trains
from dhp.inputs import DatasetSpec, EngineInit, RunInputs
from dhp.models.spec import Family
from dhp.runtime import Broadcast, GroupSpec, LayoutError, Pending, Runtime, WorkerGroup, get_watching
from dhp.runtime.data_plane import Incoming
from dhp.runtime.mesh import ModuleLayout
from dhp.runtime.placement import GroupResources, lost_nodes
from dhp.storage import check_shared_output

COMPUTE_PHASES = ("forward", "backward", "forward_backward")  # what a replica's busy time counts


class Emitted(NamedTuple):
    """A tensor-producing call's result, still on the worker: its module, the producing rank and its ObjectRef."""

    module: str
    rank: int
    ref: Any


def module_layouts(cfg: Config, family: Family, model_cfg: Any) -> list[ModuleLayout]:
    """The (dp, inner) layout of each group, encoders first; rejects what cannot work, before any actor starts."""
    out = []
    for spec in family.modules:
        p = cfg.module(spec.name).parallel
        problem = spec.check_layout(model_cfg, p.sp, p.tp)
        if problem:
            raise ConfigError(problem)
        if p.sp > 1:
            out.append(ModuleLayout(spec.name, p.dp, p.sp, "sp"))
        else:
            out.append(ModuleLayout(spec.name, p.dp, p.tp, "tp"))
    return out


def resolve_worker_gpus(inputs: RunInputs) -> RunInputs:
    """``inputs`` with ``runtime.gpus_per_worker`` a number: ``auto`` becomes what the cluster holds (one GPU per
    worker where there are GPUs, CPU where there are none; ``dhp.runtime.placement.decide_gpus_per_worker``).
    A layout the cluster's GPUs cannot hold is a ConfigError naming the fixes."""
    from dataclasses import replace

    from dhp.runtime.cluster import cluster_gpus
    from dhp.runtime.placement import decide_gpus_per_worker

    cfg = inputs.cfg
    rt = cfg.runtime
    if rt.gpus_per_worker != "auto":
        return inputs
    sizes = {x.module: x.size for x in module_layouts(cfg, inputs.family, inputs.model_cfg)}
    try:
        gpus = decide_gpus_per_worker("auto", rt.placement, sizes, cluster_gpus(rt.ray_address))
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return replace(inputs, cfg=replace(cfg, runtime=replace(rt, gpus_per_worker=gpus)))


def group_resources(cfg: Config, modules: list[str]) -> dict[str, GroupResources]:
    """Each group's reservation and node pool (``<module>.resources``; unset numbers: the runtime's defaults,
    ``runtime.gpus_per_worker`` already a number). The groups must agree on CPU or GPU: the data plane's
    process groups span them all, with one collective backend."""
    rt = cfg.runtime
    out = {}
    for m in modules:
        r = cfg.module(m).resources
        out[m] = GroupResources(
            float(rt.cpus_per_worker if r.num_cpus is None else r.num_cpus),
            float(rt.gpus_per_worker if r.num_gpus is None else r.num_gpus),
            r.accelerator_type, dict(r.label_selector), dict(r.custom), r.strategy)
    on_gpu = {m: g.num_gpus > 0 for m, g in out.items()}
    if len(set(on_gpu.values())) > 1:
        raise ConfigError(f"<module>.resources.num_gpus: some groups train on GPUs and some on CPUs ({on_gpu}); "
                          "the groups share one collective backend (NCCL or gloo): give every group GPUs or none")
    return out


def worker_gpus(resources: dict[str, GroupResources]) -> float:
    """The GPUs of a worker as the backend choice sees them (every group's are > 0, or all 0)."""
    return max(g.num_gpus for g in resources.values())


def check_local_budget(cfg: Config, sizes: dict[str, int]) -> None:
    """Before a local Ray starts: does the layout fit this machine's CPUs and GPUs? (Ray would say so only
    after starting; a run that joins a cluster, or a Ray already running here, is checked against it later.)"""
    import os

    import ray

    rt = cfg.runtime
    if rt.ray_address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        return
    import torch

    from dhp.runtime import plan_placement
    from dhp.runtime.placement import check_fits

    machine = {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
    try:
        plan = plan_placement(rt.placement, sizes, rt.cpus_per_worker, rt.gpus_per_worker,
                              group_resources(cfg, list(sizes)))
        check_fits(plan, machine, [machine])
    except LayoutError as e:
        raise ConfigError(f"runtime: {e} (this machine: {machine['CPU']:g} CPUs, {machine['GPU']:g} GPUs)") from None


def resume_hint() -> str:
    """On a cluster that lost nodes: the command that resumes the run once capacity is back."""
    if not lost_nodes():
        return ""
    import shlex
    import sys

    cmd = " ".join(shlex.quote(a) for a in ["dhp", *sys.argv[1:]]) if sys.argv[0].endswith("dhp") else \
        "dhp train ... (the same config and overrides)"
    return (f". The cluster has lost {lost_nodes()} node(s); the newest complete checkpoint in output.dir is kept: "
            f"once the nodes are back, resume with the same command (train.resume=auto): {cmd}")


def check_encoders_fed(cfg: Config, encoders: list[str]) -> None:
    """An encoder replica that can never get a sample cannot be kept busy: more replicas than samples per step
    is refused, naming the fix."""
    batch = cfg.train.global_batch_size
    for e in encoders:
        dp = cfg.module(e).parallel.dp
        if dp > batch:
            raise ConfigError(f"{e}.parallel.dp={dp} exceeds train.global_batch_size={batch}: at most {batch} of "
                              f"its replicas get a sample in a step and the others would only wait; lower "
                              f"{e}.parallel.dp or raise train.global_batch_size")


class RayBackend:
    def __init__(self, inputs: RunInputs, dataset_spec: DatasetSpec) -> None:
        inputs = resolve_worker_gpus(inputs)  # runtime.gpus_per_worker=auto: what the cluster holds
        cfg, family = inputs.cfg, inputs.family
        rt = cfg.runtime
        self.cfg, self.family = cfg, family
        self.layouts = module_layouts(cfg, family, inputs.model_cfg)
        self.layout = {x.module: x for x in self.layouts}
        self.encoders = [e.name for e in family.encoders]
        self.lang = family.language.name
        self.modules = [*self.encoders, self.lang]
        self.ahead = rt.encoders_ahead if rt.placement == "disaggregated" else 0
        self.trains = {e.name: encoder_trains(cfg, e) for e in family.encoders}  # frozen: no backward at all
        worker = {**{e: EncoderWorker for e in self.encoders}, self.lang: LanguageWorker}
        check_encoders_fed(cfg, self.encoders)
        check_local_budget(cfg, {m: self.layout[m].size for m in self.modules})
        resources = group_resources(cfg, self.modules)
        try:
            self.runtime = Runtime(
                {m: GroupSpec(worker[m], self.layout[m].size,
                              kwargs={"collective_timeout_s": rt.collective_timeout_s},
                              replica_size=self.layout[m].inner) for m in self.modules},
                placement=rt.placement,
                cpus_per_worker=rt.cpus_per_worker,
                gpus_per_worker=worker_gpus(resources),
                transport=rt.transport,
                address=rt.ray_address,
                resources=resources,
                capacity_wait_s=rt.capacity_wait_s,
            )
        except LayoutError as e:
            raise ConfigError(f"runtime: {e}") from None
        try:
            self.runtime.start()
            check_shared_output(cfg.output.dir, self.runtime.actor_per_node())  # one output.dir, seen by all nodes
            backend = self.runtime.backend
            pending = [self.group(m).setup_parallel.submit(self.layouts, backend, cfg.module(m).parallel)
                       for m in self.modules]
            for p in pending:
                p.get()
            device = "cuda" if worker_gpus(resources) > 0 else "cpu"
            self.data_plane = self.runtime.setup.data_plane
            init = EngineInit(family, inputs.model_cfg, cfg, device, self.data_plane, dataset_spec)
            pending = [self.group(m).init_engine.submit(init) for m in self.modules]
            for p in pending:
                p.get()
        except LayoutError as e:
            self.runtime.shutdown()
            raise ConfigError(f"runtime: {e}{resume_hint()}") from None
        except BaseException:
            self.runtime.shutdown()
            raise

    def group(self, module: str) -> WorkerGroup:
        return self.runtime[module]

    @property
    def text(self) -> WorkerGroup:
        return self.runtime[self.lang]

    # ---- one step ------------------------------------------------------------------------------
    def run_step(self, plan: StepPlan, upcoming: StepPlan | None = None) -> StepStats:
        """One step of ``plan``; ``upcoming``: the next step's plan, whose first rounds each group's loaders start
        on once it has taken this step's last samples: an encoder's behind its last forward, the text's behind its
        last forward_backward (so the next step's first forward finds its samples decoded)."""
        t_start, wall_start = time.perf_counter(), time.time()
        rounds = plan.rounds
        forwards: list[dict[str, Any]] = []  # [round] -> encoder -> Pending forward
        pieces: list[list[list[Emitted]]] = []  # [round][text replica] -> the pieces it needs, from every encoder
        texts: list[Pending] = []  # p2p: [round] -> the text group's forward_backward, its losses not yet taken
        losses: list[list[tuple[float, int]]] = []  # [round] -> per text replica (head): (loss sum, tokens)
        backwards: list[tuple[str, list[Any]]] = []  # encoder backward refs, to surface errors
        p2p = self.data_plane == "p2p"
        for turn in schedule_turns(len(rounds), plan.window, self.ahead):  # the schedule, as data
            if turn.kind == "encode":  # every encoder replica encodes its samples of round j
                j = turn.round
                for n in ((0, 1) if j == 0 else (j + 1,)):  # the loaders decode a round ahead of the forwards
                    self._prefetch(n, rounds)
                forwards.append({e: self.group(e).forward.submit(Broadcast(j), list(rounds[j].replicas(e)),
                                                                 *([self._targets(e, rounds[j])] if p2p else []))
                                 for e in self.encoders})
                pieces.append([] if p2p else self._pieces_for(j, rounds[j]))
                if j == len(rounds) - 1 and upcoming is not None:  # the encoders have all of this step's samples
                    for n in (0, 1):  # their loaders decode the next step's first rounds behind the last forward
                        self._prefetch(n, upcoming.rounds, self.encoders)
                continue
            k = turn.round
            # a failed forward is the root cause; a failed text round too, whose backward an encoder waits in
            metas = {e: get_watching(forwards[k][e], texts) for e in self.encoders}
            if p2p:  # what each text rank receives from which encoder rank: host metadata, no tensors
                pieces[k] = self._incoming(rounds[k], metas)
            else:
                self._wait_emitted([x for per_replica in pieces[k] for x in per_replica])
            last = k == len(rounds) - 1  # the step's last backward starts the gradient all-reduces
            if last:
                self.text.submit("arm_gradient_reduction")
            text_refs = self._submit_text(k, rounds[k], pieces[k])
            grads = {e: self._grads_for(k, rounds[k], e) for e in self.encoders if self.trains[e] and not p2p}
            if p2p:
                texts.append(self.text.pending("forward_backward", text_refs))
            else:  # the router's gradients are the text step's output: the driver waits for them anyway
                losses.append(self.text.pending("forward_backward", text_refs).get())
            for e in self.encoders:
                if last and self.trains[e]:
                    self.group(e).submit("arm_gradient_reduction")
                if p2p and self.trains[e]:  # the text heads send each encoder rank the gradients of its rows
                    backwards.append((e, self.group(e).submit("backward", k)))
                elif e in grads:
                    self._wait_emitted([x for xs in grads[e] for x in xs])
                    backwards.append((e, self._submit_backward(e, k, grads[e])))
        if upcoming is not None:  # the text loaders: behind its last forward_backward, which takes its samples
            for n in (0, 1):
                self._prefetch(n, upcoming.rounds, [self.lang])
        losses += [t.get() for t in texts]
        for e, refs in backwards:
            self.group(e).get("backward", refs)
        loss_sum = sum(loss for per_round in losses for loss, _ in per_round)
        n_sup = sum(n for per_round in losses for _, n in per_round)
        if n_sup == 0:
            raise no_supervised_tokens()
        norm_sq = self._call_all("finish_gradients", 1.0 / n_sup)
        grad_norm = global_norm(list(norm_sq.values()))
        coef = clip_coefficient(grad_norm, self.cfg.train.clip_grad_norm)
        reports = self._call_all("step", coef)
        stats = self._stats(loss_sum / n_sup, n_sup, grad_norm, reports, time.perf_counter() - t_start)
        stats.spans.append({"module": "driver", "rank": 0, "phase": "step", "round": None, "start": wall_start,
                            "end": time.time()})
        return stats

    def _pieces_for(self, k: int, rnd: Round) -> list[list[Emitted]]:
        """[text replica r] -> the pieces it needs: one per encoder rank whose replica holds some of its samples."""
        text = rnd.replicas(self.lang)
        out: list[list[Emitted]] = [[] for _ in text]
        for e, q, enc_ids, r, shared in self._shared(rnd):
            last = not any(set(text[s]).intersection(enc_ids) for s in range(r + 1, len(text)))
            for a in self._emitting_ranks(e, q):
                out[r].append(Emitted(e, a, self.group(e).submit_rank(a, "emit", k, shared, last)))
        return out

    def _shared(self, rnd: Round) -> Iterator[tuple[str, int, list[int], int, list[int]]]:
        """(encoder, its replica q, q's samples, text replica r, the samples of r that q encodes), for each pair
        (q, r) that shares some samples."""
        text = rnd.replicas(self.lang)
        for e in self.encoders:
            for q, enc_ids in enumerate(rnd.replicas(e)):
                for r, text_ids in enumerate(text):
                    shared = sorted(set(text_ids).intersection(enc_ids))
                    if shared:
                        yield e, q, list(enc_ids), r, shared

    def _prefetch(self, k: int, rounds: tuple[Round, ...], modules: list[str] | None = None) -> None:
        """Let every rank's loader (of ``modules``, default all) start on round ``k``'s samples (nothing waits on
        it: a load's error surfaces in the call that takes the sample). The prefetch is a call on the ranks'
        actors: it starts once the calls submitted before it have run."""
        if k >= len(rounds) or self.cfg.data.loader_workers == 0:
            return
        for m in modules or self.modules:
            self.group(m).prefetch.submit(Broadcast(k), list(rounds[k].replicas(m)))

    def _global_rank(self, module: str, rank: int) -> int:
        """A module rank's rank in the world the p2p data plane's process groups span."""
        return self.runtime.setup.coordinates[module][rank]["global_rank"]

    def _targets(self, e: str, rnd: Round) -> list[list[tuple[list[int], list[int], list[int]]]]:
        """[encoder replica q] -> (global ranks of text replica r, the samples of r that q encodes, all of r's
        samples in packing order), for each r that needs some (p2p data plane: the encoder ranks send to these
        ranks as soon as they have encoded; under text Megatron SP each rank the rows of its sequence slice)."""
        text, lang = rnd.replicas(self.lang), self.layout[self.lang]
        out: list[list[tuple[list[int], list[int], list[int]]]] = []
        for enc_ids in rnd.replicas(e):
            mine = []
            for r, text_ids in enumerate(text):
                shared = sorted(set(text_ids).intersection(enc_ids))
                if shared:
                    ranks = [self._global_rank(self.lang, b) for b in lang.ranks_of_replica(r)]
                    mine.append((ranks, shared, list(text_ids)))
            out.append(mine)
        return out

    def _incoming(self, rnd: Round, metas: dict[str, list[dict[str, Any]]]) -> list[list[Emitted]]:
        """[text replica r] -> what its ranks receive, one ``Incoming`` per encoder rank that holds rows of its
        samples (rows per sample from that rank's forward, in the order it packs them: ``_targets``)."""
        out: list[list[Emitted]] = [[] for _ in rnd.replicas(self.lang)]
        for e, q, _, r, shared in self._shared(rnd):
            for a in self._emitting_ranks(e, q):
                meta = metas[e][a]
                rows = tuple((i, meta["rows"][i]) for i in shared if meta["rows"].get(i, 0))
                if rows:
                    reply = tuple(self._global_rank(e, b) for b in self._gradient_ranks(e, q, a))
                    inc = Incoming(e, self._global_rank(e, a), rows, meta["outputs"], reply,
                                   self._parts(meta, r, shared))
                    out[r].append(Emitted(e, a, inc))
        return out

    def _parts(self, meta: dict[str, Any], r: int, shared: list[int]) -> tuple:
        """Each rank of text replica r's own rows of ``shared``, where the encoder rank sent each its sequence
        slice (``meta["to"]``: text Megatron SP); () where every rank got them all."""
        if "to" not in meta:
            return ()
        ranks = [self._global_rank(self.lang, b) for b in self.layout[self.lang].ranks_of_replica(r)]
        return tuple((g, tuple((i, meta["to"][g][i]) for i in shared if i in meta["to"][g]))
                     for g in ranks if g in meta["to"])

    def _gradient_ranks(self, module: str, q: int, a: int) -> list[int]:
        """The ranks that take the gradients of the rows rank ``a`` of replica ``q`` sent: ``a`` itself under SP
        (its own rows only); under TP every rank of the replica (they hold the same rows)."""
        layout = self.layout[module]
        return [a] if layout.inner_name == "sp" else layout.ranks_of_replica(q)

    def _emitting_ranks(self, module: str, q: int) -> list[int]:
        """Ranks of replica q that hold distinct pieces: every SP rank; one TP rank (they agree)."""
        layout = self.layout[module]
        ranks = layout.ranks_of_replica(q)
        return ranks if layout.inner_name == "sp" else ranks[:1]

    def _submit_text(self, k: int, rnd: Round, pieces: list[list[Emitted]]) -> list[Any]:
        text = rnd.replicas(self.lang)
        refs = []
        for b in range(self.layout[self.lang].size):
            r = self.layout[self.lang].replica_of(b)  # every TP rank of replica r gets all of r's pieces
            refs.append(self.text.submit_rank(b, "forward_backward", k, list(text[r]),
                                              [x.module for x in pieces[r]], *(x.ref for x in pieces[r])))
        return refs

    def _grads_for(self, k: int, rnd: Round, e: str) -> list[list[Emitted]]:
        """[encoder replica q] -> the gradients it gets back, one from the head of each text replica it fed."""
        text, enc = rnd.replicas(self.lang), rnd.replicas(e)
        heads = self.text.replica_heads()
        out: list[list[Emitted]] = [[] for _ in enc]
        for q, enc_ids in enumerate(enc):
            for r, text_ids in enumerate(text):
                shared = sorted(set(text_ids).intersection(enc_ids))
                if not shared:
                    continue
                last = not any(set(enc[p]).intersection(text_ids) for p in range(q + 1, len(enc)))
                out[q].append(Emitted(self.lang, heads[r],
                                      self.text.submit_rank(heads[r], "emit_grads", k, e, shared, last)))
        return out

    def _submit_backward(self, e: str, k: int, grads: list[list[Emitted]]) -> list[Any]:
        layout = self.layout[e]
        return [self.group(e).submit_rank(a, "backward", k, *(x.ref for x in grads[layout.replica_of(a)]))
                for a in range(layout.size)]

    def _wait_emitted(self, emitted: list[Emitted]) -> None:
        for m in {x.module for x in emitted}:
            mine = [x for x in emitted if x.module == m]
            self.group(m).wait_tensors("emit" if m != self.lang else "emit_grads", [x.ref for x in mine],
                                       [x.rank for x in mine])

    def _call_all(self, method: str, *args: Any) -> dict[str, Any]:
        """Start ``method`` on every group, then collect each by its declared mode (groups run concurrently)."""
        pending = {m: getattr(self.group(m), method).submit(*args) for m in self.modules}
        return {m: p.get() for m, p in pending.items()}

    def _stats(self, loss: float, n_sup: int, grad_norm: float, reports: dict[str, list[dict]],
               wall: float) -> StepStats:
        timings: dict[str, float] = {}
        balance: dict[str, float] = {}
        for name, per_rank in reports.items():
            busy: dict[str, float] = {}
            for rep in per_rank:
                for phase, sec in rep["busy"].items():
                    busy[phase] = max(busy.get(phase, 0.0), sec)
            for phase, sec in busy.items():
                timings[f"{name}_{phase}"] = sec
            timings[f"{name}_idle"] = max(0.0, wall - sum(busy.values()))
            for what in sorted({w for rep in per_rank for w in rep.get("waiting", {})}):  # waiting for the router
                timings[f"{name}_{what}_wait"] = max(rep.get("waiting", {}).get(what, 0.0) for rep in per_rank)
            layout = self.layout[name]
            per_replica = [max(sum(per_rank[a]["busy"].get(p, 0.0) for p in COMPUTE_PHASES)
                               for a in layout.ranks_of_replica(q)) for q in range(layout.dp)]
            balance[name] = imbalance(per_replica)
        router = sum(rep["bytes_in"] for per_rank in reports.values() for rep in per_rank)
        by_direction = {  # what the language model receives is embeddings; what the encoders receive, gradients
            "forward": sum(rep["bytes_in"] for rep in reports[self.lang]),
            "backward": sum(rep["bytes_in"] for m in self.encoders for rep in reports[m]),
        }
        lr = max(rep["lr"] for per_rank in reports.values() for rep in per_rank)
        memory = max(rep["memory_gb"] for per_rank in reports.values() for rep in per_rank)
        comm = {f"{name}_{kind}": sum(rep["comm"].get(kind, 0) for rep in per_rank)
                for name, per_rank in reports.items() for kind in sorted({k for r in per_rank for k in r["comm"]})}
        by_module = {name: max(rep["memory_gb"] for rep in per_rank) for name, per_rank in reports.items()}
        # the timeline: every rank's spans (wall clock), and each group's busy fraction of the step
        spans = [{"module": name, "rank": rank, **span} for name, per_rank in reports.items()
                 for rank, rep in enumerate(per_rank) for span in rep.get("spans", ())]
        busy_fraction = {name: sum(sum(rep["busy"].values()) for rep in per_rank) / len(per_rank) / wall
                         if wall > 0 else 0.0 for name, per_rank in reports.items()}
        devices = {name: {"device_name": per_rank[0].get("device_name", "cpu"),
                          "threads": per_rank[0].get("threads", 1), "ranks": len(per_rank)}
                   for name, per_rank in reports.items()}
        return StepStats(loss, n_sup, grad_norm, lr, timings, router_bytes=router, worker_memory_gb=memory,
                         router_bytes_by_direction=by_direction,
                         comm_bytes=comm, imbalance=balance, memory_gb_by_module=by_module, spans=spans,
                         busy_fraction=busy_fraction, devices=devices)

    # ---- end -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        states = self._call_all("state_dict")
        out = {}
        for spec in self.family.modules:
            out.update({f"{spec.weight_prefix}.{k}": v for k, v in states[spec.name].items()})
        return out

    def rank_state_dicts(self) -> dict[str, list[dict[str, Any]]]:
        return self._call_all("rank_state_dict")

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> dict[str, float]:
        """Every group writes its own shards under ``path/<module>``, in parallel; seconds per group."""
        pending = {m: self.group(m).save_checkpoint.submit(str(path / m)) for m in self.modules}
        return {m: p.get() for m, p in pending.items()}

    def load_checkpoint(self, path: Path, step: int, same_layout: bool) -> None:
        pending = [self.group(m).load_checkpoint.submit(str(path / m), step, same_layout) for m in self.modules]
        for p in pending:
            p.get()

    def workers(self) -> list[dict[str, Any]]:
        return [w for m in self.modules for w in self.group(m).identity()]

    def shutdown(self) -> None:
        self.runtime.shutdown()
