"""Layouts the Ray backend refuses before any actor starts, each with the key and the reason; plans for N groups."""

from __future__ import annotations

import pytest

from dhp.config import ConfigError, load_config
from dhp.runtime import plan_placement
from dhp.runtime.mesh import ModuleLayout, all_mesh_groups
from dhp.runtime.placement import ActorResources


def layouts(*overrides: str):
    """The Ray backend's layouts of the tiny Qwen2.5-VL (4 vision heads, 2 key/value heads)."""
    from dhp.backends.ray_backend import module_layouts  # here, not at the top: the N-group tests need no model code
    from dhp.models.qwen2_5_vl.config import tiny
    from dhp.models.registry import get_family

    cfg = load_config(None, ["runtime.backend=ray", *overrides])
    return module_layouts(cfg, get_family("qwen2_5_vl"), tiny())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["vision.parallel.sp=2", "vision.parallel.tp=2"], r"vision.parallel: choose sp \(Ulysses\) or tp"),
        (["text.parallel.sp=2"], r"text.parallel.sp: the text module supports dp or tp only"),
        (["vision.parallel.sequence_parallel=true", "vision.parallel.tp=2"],
         r"vision.parallel.sequence_parallel: .* use vision.parallel.sp"),
        (["vision.parallel.sp=3"], r"vision.parallel.sp=3 must divide the vision heads \(4\)"),
        (["vision.parallel.tp=3"], r"vision.parallel.tp=3 must divide the vision heads \(4\)"),
        (["text.parallel.tp=4"], r"text.parallel.tp=4 must divide the key/value heads \(2\)"),
    ],
)
def test_refused_layouts_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        layouts(*overrides)


def test_accepted_layouts_are_dp_by_inner_meshes() -> None:
    vision, text = layouts("vision.parallel.sp=2", "vision.parallel.dp=2", "vision.parallel.zero=1",
                           "text.parallel.tp=2")
    assert (vision.dp, vision.inner, vision.inner_name, vision.size) == (2, 2, "sp", 4)
    assert (text.dp, text.inner, text.inner_name, text.size) == (1, 2, "tp", 2)
    _, text = layouts("text.parallel.tp=2", "text.parallel.dp=2", "text.parallel.zero=3")  # 2D FSDP x TP
    assert (text.dp, text.inner, text.size) == (2, 2, 4)
    vision_tp, text = layouts("vision.parallel.tp=2", "vision.parallel.dp=2", "vision.parallel.zero=1",
                              "text.parallel.tp=2", "text.parallel.dp=2", "text.parallel.zero=1")  # ZeRO-1 x TP
    assert (vision_tp.inner_name, vision_tp.size, text.size) == ("tp", 4, 4)
    vision, _ = layouts("vision.parallel.sp=2", "vision.parallel.dp=2", "vision.parallel.zero=3")  # FSDP2 x SP
    assert (vision.inner_name, vision.size) == ("sp", 4)
    assert vision.ranks_of_replica(1) == [2, 3] and vision.replica_of(3) == 1 and vision.inner_rank(3) == 1
    assert vision.groups(offset=4) == {"dp": [[4, 6], [5, 7]], "sp": [[4, 5], [6, 7]]}


THREE = {"vision": 4, "audio": 2, "text": 2}  # three groups of unequal sizes


def test_three_unequal_groups_collocated() -> None:
    plan = plan_placement("collocated", THREE, 1.0, 1.0)
    assert plan.sizes == THREE
    # bundle i holds rank i of every group that has one: 3 workers in bundles 0-1, vision alone in 2-3
    assert plan.bundles == [{"CPU": 3.0, "GPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}] * 2
    pairs = {(m, i): i for m in ("audio", "text") for i in (0, 1)}
    assert plan.bundle_of == {("vision", i): i for i in range(4)} | pairs
    assert plan.actor_resources[("audio", 1)] == ActorResources(1.0, 1.0 / 3)
    assert plan.actor_resources[("vision", 3)] == ActorResources(1.0, 1.0)
    assert (plan.total("CPU"), plan.total("GPU")) == (8.0, 4.0)


def test_three_unequal_groups_disaggregated() -> None:
    plan = plan_placement("disaggregated", THREE, 0.5, 1.0)
    assert plan.bundles == [{"CPU": 0.5, "GPU": 1.0}] * 8
    order = [("vision", r) for r in range(4)] + [("audio", 0), ("audio", 1), ("text", 0), ("text", 1)]
    assert plan.bundle_of == {slot: i for i, slot in enumerate(order)}  # one bundle per (module, rank), in order
    assert set(plan.actor_resources.values()) == {ActorResources(0.5, 1.0)}


def test_three_groups_mesh_subgroups_are_disjoint_and_in_one_order() -> None:
    layouts3 = [ModuleLayout("vision", dp=2, inner=2, inner_name="sp"), ModuleLayout("audio", dp=2),
                ModuleLayout("text", dp=1, inner=2)]
    groups = all_mesh_groups(layouts3)
    assert groups == [
        ("vision", "dp", [0, 2]), ("vision", "dp", [1, 3]), ("vision", "sp", [0, 1]), ("vision", "sp", [2, 3]),
        ("audio", "dp", [4, 5]), ("audio", "tp", [4]), ("audio", "tp", [5]),
        ("text", "dp", [6]), ("text", "dp", [7]), ("text", "tp", [6, 7]),
    ]
    for module, size, offset in (("vision", 4, 0), ("audio", 2, 4), ("text", 2, 6)):
        for dim in {d for m, d, _ in groups if m == module}:  # every dim partitions the module's global ranks
            ranks = sorted(r for m, d, rs in groups if m == module and d == dim for r in rs)
            assert ranks == list(range(offset, offset + size))
