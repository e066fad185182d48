"""Shared fixtures: a small demo data set made once per test session; one torch thread per pytest-xdist worker."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist several workers (and their Ray actors, gloo ranks and `dhp` subprocesses) share the
    machine's cores: each runs torch on one thread, its children too (OMP_NUM_THREADS, which Ray's actors keep).
    Oversubscribed OpenMP threads spin while they wait: two threads per worker on two cores cost about twice
    the CPU time for the same local-backend tests (measured on this project's 2-core machine)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from dhp.data.demo import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("demo"), seed=0, n_train=64, n_eval=16)


@pytest.fixture
def demo_overrides(demo_data, tmp_path):
    """Overrides that point a run at the small demo set, with a small batch."""
    return [
        f"data.path={demo_data.train}",
        f"data.eval_path={demo_data.eval}",
        f"data.tokenizer={demo_data.tokenizer}",
        "data.max_pixels=12544",  # 112 x 112: short vision sequences, fast tests
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.warmup_steps=1",
        f"output.dir={tmp_path / 'run'}",
        "runtime.backend=local",  # the embedded default runs on Ray; tests that want Ray say so
    ]


@pytest.fixture(scope="session")
def omni_demo_data(tmp_path_factory):
    """A small audio demo set (dial tones, digit pictures, Omni tokenizer), built once per session."""
    from dhp.data.omni_demo import make_omni_demo_dataset

    return make_omni_demo_dataset(tmp_path_factory.mktemp("omni_demo"), seed=0, n_train=48, n_eval=16)
