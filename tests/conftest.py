"""Shared fixtures: a small demo data set made once per test session."""

from __future__ import annotations

import pytest


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
