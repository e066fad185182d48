"""The single-process reference: every module's engine in this process, run one after another.

Every layout of the Ray backend is checked against this (same losses, same weights).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch

from dhp.backends.base import StepStats, clip_coefficient, global_norm, no_supervised_tokens, process_memory_gb
from dhp.config import ConfigError
from dhp.data.llava import SFTDataset
from dhp.data.sampler import StepPlan
from dhp.engine import EncoderEngine, LanguageEngine
from dhp.inputs import RunInputs


class LocalBackend:
    def __init__(self, inputs: RunInputs, dataset: SFTDataset) -> None:
        cfg, mcfg, family = inputs.cfg, inputs.model_cfg, inputs.family
        self.cfg, self.family = cfg, family
        device = local_device(cfg.train.device)
        self.encoders = [EncoderEngine(e, family, mcfg, cfg, dataset.get, device=device) for e in family.encoders]
        self.language = LanguageEngine(family, mcfg, cfg, dataset.get, device=device)
        self.engines = [*self.encoders, self.language]
        self.modules = [e.name for e in self.engines]

    def run_step(self, plan: StepPlan, upcoming: StepPlan | None = None) -> StepStats:
        """One step of ``plan`` (``upcoming``, the next step's plan, is not used: this backend loads each sample
        when it takes it)."""
        t: dict[str, float] = defaultdict(float)
        spans: list[dict] = []
        wall_start, t_start = time.time(), time.perf_counter()

        def timed(module: str, phase: str, t0: float, key: int | None) -> None:
            dur = time.perf_counter() - t0
            t[f"{module}_{phase}"] += dur
            end = time.time()
            spans.append({"module": module, "rank": 0, "phase": phase, "round": key, "start": end - dur, "end": end})
        loss_sum, n_sup = 0.0, 0
        lang = self.language.name
        for k, rnd in enumerate(plan.rounds):
            ids = rnd.sample_ids
            pieces = {}
            for enc in self.encoders:
                t0 = time.perf_counter()
                got = enc.forward(k, list(rnd.replicas(enc.name)[0]))
                pieces[enc.name] = {i: [p] for i, p in got.items()}
                timed(enc.name, "forward", t0, k)
            t0 = time.perf_counter()
            loss, n, grads = self.language.forward_backward(ids, pieces)
            timed(lang, "forward_backward", t0, k)
            for enc in self.encoders:
                if enc.needs_backward and enc.name in grads:
                    t0 = time.perf_counter()
                    enc.backward(k, grads[enc.name])
                    timed(enc.name, "backward", t0, k)
            loss_sum += loss
            n_sup += n
        if n_sup == 0:
            raise no_supervised_tokens()
        norms = []
        for e in self.engines:
            t0 = time.perf_counter()
            e.finish_gradients(1.0 / n_sup)
            norms.append(e.grad_norm_sq())
            timed(e.name, "reduce", t0, None)
        grad_norm = global_norm(norms)
        coef = clip_coefficient(grad_norm, self.cfg.train.clip_grad_norm)
        lr = max(e.lr() for e in self.engines)
        for e in self.engines:
            t0 = time.perf_counter()
            e.step(coef)
            timed(e.name, "optimizer", t0, None)
        memory = process_memory_gb()  # every module lives in this process
        wall = time.perf_counter() - t_start
        spans.append({"module": "driver", "rank": 0, "phase": "step", "round": None, "start": wall_start,
                      "end": time.time()})
        busy = {name: sum(v for k, v in t.items() if k.startswith(f"{name}_")) / wall for name in self.modules}
        device = {"device_name": torch.cuda.get_device_name() if self.language.device.type == "cuda" else "cpu",
                  "threads": torch.get_num_threads(), "ranks": 1}
        return StepStats(float(loss_sum) / n_sup, n_sup, grad_norm, lr, dict(t),  # the loss: read once per step
                         imbalance={name: 1.0 for name in self.modules},
                         memory_gb_by_module={name: memory for name in self.modules}, spans=spans,
                         busy_fraction=busy, devices={name: device for name in self.modules})

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.engines:
            out.update({f"{e.definition.weight_prefix}.{k}": v for k, v in e.state_dict().items()})
        return out

    def rank_state_dicts(self) -> dict[str, list[dict[str, torch.Tensor]]]:
        return {e.name: [e.state_dict()] for e in self.engines}

    # ---- checkpoints (the same files a Ray layout writes: DCP, keyed by parameter name) ----------------
    def save_checkpoint(self, path: Path) -> dict[str, float]:
        from dhp.engine_checkpoint import save_engine

        seconds = {}
        for e in self.engines:
            t0 = time.perf_counter()
            save_engine(e, path / e.name, None, 0)
            seconds[e.name] = time.perf_counter() - t0
        return seconds

    def load_checkpoint(self, path: Path, step: int, same_layout: bool) -> None:
        from dhp.engine_checkpoint import load_engine

        for e in self.engines:
            load_engine(e, path / e.name, None, 0, step, same_layout)

    def workers(self) -> list[dict]:
        import os
        import socket

        return [{"module": e.name, "rank": 0, "node": "local", "hostname": socket.gethostname(), "pid": os.getpid()}
                for e in self.engines]

    def shutdown(self) -> None:
        pass


def local_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device; use train.device=cpu")
    return choice
