"""Multi-process helpers for tests: see ``dhp.parallel.spawn``."""

from dhp.parallel.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
