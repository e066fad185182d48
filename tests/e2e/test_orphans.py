"""A `dhp plan` killed with SIGKILL (a CI timeout, the OOM killer) leaves no worker of its measuring pool behind:
each worker ends with its parent (``dhp.lifetime.exit_with_parent``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _children(pid: int) -> set[int]:
    """Every live process whose parent is ``pid`` (from /proc: no psutil needed)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_killed_plan_leaves_no_pool_worker(tmp_path):
    # tiny model, 8 GPUs, two sizes: more than a handful of distinct runs, so the plan measures in a pool
    cmd = [sys.executable, "-m", "dhp.cli", "plan", "tiny", "--gpus", "8", "--vision-tokens", "256,1024",
           "--text-tokens", "64", "--json", str(tmp_path / "plan.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, workers = time.monotonic() + 120, set()
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            workers |= _children(proc.pid)
            time.sleep(0.2)
        assert len(workers) >= 2, "the plan never started its pool (did it finish first?)"
        time.sleep(3)  # let the workers import and take jobs
        workers |= _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # a worker still importing when its parent dies arms its watch once its imports end (seconds, a minute
        # under the suite's load): it must end then, not run on
        assert _still_alive(workers, 90) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _children(proc.pid):
            os.kill(p, signal.SIGKILL)


def _still_alive(pids, seconds: float) -> list[int]:
    """Those of ``pids`` still alive after waiting up to ``seconds`` for all of them to end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _pid_from(marker) -> int:
    """The pid a child writes to ``marker`` once it has started the grandchild."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (marker.exists() and marker.read_text()):
        time.sleep(0.1)
    return int(marker.read_text())


def test_exit_with_parent_ends_a_child_whose_parent_is_killed(tmp_path):
    """The mechanism alone: a grandchild armed with it dies with the child that started it."""
    marker = tmp_path / "grandchild.pid"
    child = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "from dhp.lifetime import exit_with_parent; exit_with_parent(); "
                      "import time; time.sleep(120)"])
open({str(marker)!r}, "w").write(str(g.pid))
time.sleep(120)
"""])
    try:
        grandchild = _pid_from(marker)
        time.sleep(2)  # it armed itself (importing dhp takes a moment)
        assert _alive(grandchild)
        child.kill()
        child.wait()
        assert _still_alive([grandchild], 10) == []
    finally:
        child.kill()


def test_a_child_armed_after_its_parent_died_ends_too(tmp_path):
    """A pool worker still starting when its parent is killed arms itself with the parent's pid, given by the
    parent: it then finds a stranger's pid as its parent and ends at once. (Armed with the default, the parent
    it saw at that moment, init's, it stayed: the CI failure of `test_killed_plan_leaves_no_pool_worker`.)"""
    marker = tmp_path / "grandchild.pid"
    child = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3); from dhp.lifetime import exit_with_parent; "
                      "exit_with_parent({{}}); time.sleep(120)".format(os.getpid())])
open({str(marker)!r}, "w").write(str(g.pid))
time.sleep(120)
"""])
    try:
        grandchild = _pid_from(marker)
        child.kill()  # before the grandchild arms itself
        child.wait()
        assert _alive(grandchild)
        assert _still_alive([grandchild], 30) == []
    finally:
        child.kill()
