"""Helper processes that end with the process that started them.

Why: ``dhp plan`` and ``dhp bench`` measure in pools of spawned processes. A pool's workers are not told when
their parent is killed (SIGKILL, a CI timeout, the OOM killer): they block on a queue or keep measuring, as
orphans at full CPU. ``exit_with_parent`` (a pool's initializer, or the first call of a spawned rank) makes a
process end when its parent does: on Linux the kernel sends it SIGKILL (``PR_SET_PDEATHSIG``); everywhere a
daemon thread also watches the parent's pid and exits the process when it changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 1.0


def exit_with_parent(parent: int | None = None) -> None:
    """End this process when ``parent`` is gone. Idempotent and cheap. Give the starting process's pid: the
    default, the current parent, is already init (or a subreaper) when the starter died while this process was
    still starting up (a spawned interpreter takes seconds to reach its initializer under load)."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass  # no libc to ask: the watcher below still works
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="dhp-exit-with-parent", daemon=True).start()


def _watch(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(POLL_S)
