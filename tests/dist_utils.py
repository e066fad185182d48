"""Multi-process helpers for tests: see ``tests/spawn.py``."""

from tests.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
