"""Layouts the Ray backend refuses before any actor starts, each with the key and the reason."""

from __future__ import annotations

import pytest

from dhp.config import ConfigError, load_config
from dhp.runtime.backend import module_layouts

HEADS, KV_HEADS = 4, 2


def layouts(*overrides: str):
    return module_layouts(load_config(None, list(overrides)), HEADS, KV_HEADS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["vision.parallel.sp=2", "vision.parallel.tp=2"], r"vision.parallel: choose sp \(Ulysses\) or tp"),
        (["text.parallel.sp=2"], r"text.parallel.sp: the language model uses tp"),
        (["vision.parallel.sequence_parallel=true"], r"vision.parallel.sequence_parallel: use vision.parallel.sp"),
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
                           "text.parallel.tp=2", "text.parallel.zero=3")
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
