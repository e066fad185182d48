"""The step timeline as a Chrome trace (``output.dir/trace.json``), viewable in Perfetto or chrome://tracing.

One process row per module group (``pid``), one thread row per rank (``tid``); spans are
``forward``, ``emit``, ``forward_backward``, ``backward``, ``reduce`` (gradient reduction and
norm), ``optimizer``, and ``waiting`` (a rank's gaps inside the step). Each span's ``args``
hold its step and micro-batch round. The driver's row shows each step.

Times are wall-clock (``time.time()``) taken by each worker itself: every worker of a
machine reads the same clock, so spans of different groups line up (across machines they
are as aligned as the machines' clocks). With ``runtime.encoders_ahead`` > 0 in disaggregated
placement the vision forward of round k+1 is seen running under the text step of round k.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

# "load": an encoder rank's background loader decoding a round (dhp.data.loader); "router_wait": a rank waiting on
# the point-to-point data plane (a receive, or its sends' completion); "emit": handing pieces to Ray
PHASES = ("load", "forward", "emit", "router_wait", "forward_backward", "backward", "reduce", "optimizer",
          "waiting")


def traced_steps(setting: int | list[int]) -> set[int] | None:
    """The step numbers ``output.trace_steps`` asks for: N -> the N steps after the first (warm-up) step;
    a list -> those steps; 0 or [] -> None (no trace)."""
    if isinstance(setting, int):
        return set(range(2, 2 + setting)) if setting > 0 else None
    return set(setting) or None


class TraceWriter:
    """Collects the spans of the traced steps and rewrites ``path`` after each (valid JSON at any time)."""

    def __init__(self, path: Path, modules: list[str], steps: set[int]) -> None:
        self.path, self.modules, self.steps = Path(path), list(modules), steps
        self.events: list[dict[str, Any]] = []
        self.rows: set[tuple[str, int]] = set()
        self.t0: float | None = None

    def wants(self, step: int) -> bool:
        return step in self.steps

    def pid(self, module: str) -> int:
        if module == "driver":
            return 0
        if module not in self.modules:
            self.modules.append(module)
        return 1 + self.modules.index(module)

    def add_step(self, step: int, spans: list[dict[str, Any]]) -> None:
        if not spans:
            return
        driver = [s for s in spans if s["module"] == "driver"]
        start = min(s["start"] for s in (driver or spans))
        end = max(s["end"] for s in (driver or spans))
        if self.t0 is None:
            self.t0 = start
        per_rank: dict[tuple[str, int], list[dict]] = defaultdict(list)
        for s in spans:
            if s["module"] == "driver":
                self._event(f"step {step}", "driver", 0, s["start"], s["end"], {"step": step})
                continue
            per_rank[(s["module"], s["rank"])].append(s)
            self._event(s["phase"], s["module"], s["rank"], s["start"], s["end"],
                        {"step": step, "round": s.get("round")})
        for (module, rank), mine in per_rank.items():  # the gaps of a rank inside the step: waiting
            cursor = start
            for s in sorted(mine, key=lambda x: x["start"]):
                if s["start"] > cursor:
                    self._event("waiting", module, rank, cursor, s["start"], {"step": step})
                cursor = max(cursor, s["end"])
            if end > cursor:
                self._event("waiting", module, rank, cursor, end, {"step": step})
        self.write()

    def _event(self, name: str, module: str, rank: int, start: float, end: float, args: dict) -> None:
        self.rows.add((module, rank))
        self.events.append({"name": name, "cat": module, "ph": "X", "pid": self.pid(module), "tid": rank,
                            "ts": round((start - self.t0) * 1e6, 1), "dur": round(max(0.0, end - start) * 1e6, 1),
                            "args": args})

    def metadata(self) -> list[dict[str, Any]]:
        meta = []
        for module, rank in sorted(self.rows, key=lambda r: (self.pid(r[0]), r[1])):
            pid = self.pid(module)
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": module}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank,
                         "args": {"name": "driver" if module == "driver" else f"{module} rank {rank}"}})
        return meta

    def write(self) -> None:
        doc = {"traceEvents": self.metadata() + self.events, "displayTimeUnit": "ms",
               "otherData": {"producer": "dhp", "steps": sorted(self.steps), "clock": "wall (time.time), per worker"}}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.path)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The complete-duration events of a trace.json, with ``module`` (the process name) and ``rank`` (tid)."""
    doc = json.loads(Path(path).read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    return [{**e, "module": names.get(e["pid"], str(e["pid"])), "rank": e["tid"]} for e in events
            if e.get("ph") == "X"]
