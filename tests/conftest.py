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


# Modules whose module-scoped fixtures are cheap (a local reference run of a few steps, a list of overrides) and
# whose tests are each a Ray run of their own: their tests go to every pytest-xdist worker.
SPREAD = frozenset({"test_ray_parity.py", "test_durable.py", "test_data_plane.py", "test_lora_parity.py",
                    "test_omni_parity.py", "test_qwen3_vl_parity.py", "test_video_parity.py",
                    "test_family_parity.py"})


@pytest.hookimpl(wrapper=True)  # the marks before every other hook; the group ids after them all
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Under ``--dist loadgroup`` a module-scoped fixture is built once per pytest-xdist worker that runs one of
    its tests: a module whose tests share an expensive one (real gloo ranks measured by the planner, trained
    checkpoints, Hugging Face model pairs) built it up to four times. The tests that use a module-scoped fixture
    of their own module share one worker (``xdist_group`` named after the module), unless the module is in
    ``SPREAD``."""
    for item in items:
        module = getattr(item, "module", None)
        info = getattr(item, "_fixtureinfo", None)
        if module is None or info is None or item.get_closest_marker("xdist_group") is not None:
            continue
        if item.path.name in SPREAD:
            continue
        shared = any(d and d[-1].scope == "module" and getattr(d[-1].func, "__module__", None) == module.__name__
                     for d in (info.name2fixturedefs.get(n) for n in item.fixturenames))
        if shared:
            item.add_marker(pytest.mark.xdist_group(module.__name__))
    out = yield
    if getattr(config.option, "loadgroup", False):  # (a pytest-xdist worker under --dist loadgroup)
        _group_node_ids(items)
    return out


def _group_node_ids(items: list[pytest.Item]) -> None:
    """``NAME@GROUP`` node ids, which ``--dist loadgroup`` schedules by. pytest-xdist 3.8 writes them to
    ``item._nodeid``, which pytest 9 no longer reads (a node's id is ``item._id``): no test was grouped, and
    every grouped module's fixture was built on every worker."""
    try:
        from _pytest.nodes import coerce_node_id  # pytest 9 (``_id``)
    except ImportError:  # an older pytest: xdist's own renaming works
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid.rsplit("::", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


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
