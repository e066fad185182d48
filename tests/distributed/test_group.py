"""The Ray mechanics with real actors on CPU/gloo: groups, process groups, dispatch, binding, transfer, failures.

One Ray instance (4 CPUs) for the file (conftest); the disaggregated 2+1 runtime
is shared by the tests that only read it; workers ask for half a CPU so that it
and the collocated 2+2 runtime fit side by side (the three-group runtime asks
for a quarter CPU per worker, for the same reason).
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError
from torch import nn

from dhp.runtime import (
    BoundMethod,
    Broadcast,
    Collect,
    DispatchError,
    GroupSpec,
    LayoutError,
    Mode,
    Pending,
    Runtime,
    Split,
    WorkerBase,
    WorkerError,
    dispatch,
    get_watching,
    plan_placement,
    produces_tensors,
    resolve_transport,
    start_ray,
)
from dhp.runtime.placement import check_fits

DIM = 5


class ToyWorker(WorkerBase):
    """A worker holding an nn.Linear, the same weights on every rank."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = nn.Linear(DIM, 1)

    @dispatch(Mode.SCATTER)
    def dp_grads(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """Data parallel: a summed loss on this rank's shard, gradients summed over the module group."""
        self.model.zero_grad()
        ((self.model(x).squeeze(-1) - y) ** 2).sum().backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.pg)
        return {n: p.grad.clone() for n, p in self.model.named_parameters()}

    @dispatch(Mode.RANK_ZERO)
    def coordinates(self) -> dict:
        return self.dhp_coordinates()

    def all_coordinates(self) -> dict:
        return self.dhp_coordinates()

    @produces_tensors
    @dispatch(Mode.SCATTER)
    def produce(self, seed: int, numel: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(seed))

    @produces_tensors
    def produce_or_fail(self, rank: int) -> torch.Tensor:
        if self.rank == rank:
            raise ValueError(f"toy failure while producing, rank {self.rank}")
        return torch.ones(3)

    @produces_tensors
    def produce_slowly(self, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        return torch.ones(3)

    @dispatch(Mode.SCATTER)
    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"toy failure on purpose, rank {self.rank}")
        return self.rank

    def fail_during_collective(self, rank: int) -> None:
        """Rank ``rank`` raises while the others wait in an all-reduce that can never finish."""
        if self.rank == rank:
            raise ValueError("toy failure inside a collective step")
        dist.all_reduce(torch.ones(1), group=self.pg)

    @dispatch(split=Split.REPLICA)
    def take(self, item: object) -> tuple[int, object]:
        return self.rank, item

    @dispatch(split=Split.REPLICA, collect=Collect.REPLICA_HEADS)
    def take_heads(self, item: object) -> tuple[int, object]:
        return self.rank, item

    @dispatch(split=Split.RANK, collect=Collect.RANK_ZERO)
    def first(self, item: object) -> tuple[int, object]:
        return self.rank, item

    @produces_tensors
    @dispatch(split=Split.REPLICA, collect=Collect.REPLICA_HEADS)
    def produce_replica(self, seed: int, numel: int) -> torch.Tensor:
        """Every rank of a replica makes the same tensor (same seed): the replica's head speaks for it."""
        return torch.randn(numel, generator=torch.Generator().manual_seed(seed))

    def group_sum(self) -> float:
        """The sum of (rank + 1) over the module group: the module's own process group, not the world."""
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t, group=self.pg)
        return t.item()


def _spec(n: int, replica_size: int = 1) -> GroupSpec:
    return GroupSpec(ToyWorker, n, {"seed": 0}, replica_size=replica_size)


@pytest.fixture(scope="module")
def disagg(ray_cluster: dict) -> Runtime:
    with Runtime({"vision": _spec(2), "text": _spec(1)}, placement="disaggregated", transport="direct",
                 cpus_per_worker=0.5) as rt:
        yield rt


def _reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(DIM, 1)
    ((model(x).squeeze(-1) - y) ** 2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _check_dp_grads(rt: Runtime) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, DIM, generator=g), torch.randn(6, generator=g)
    per_rank = rt["vision"].call("dp_grads", [x[:3], x[3:]], [y[:3], y[3:]])
    ref = _reference_grads(x, y)
    for grads in per_rank:
        for name, value in ref.items():
            torch.testing.assert_close(grads[name], value)


def test_disaggregated_coordinates_and_dp_grads(disagg: Runtime) -> None:
    vision = disagg["vision"].call("all_coordinates")
    assert [(c["rank"], c["world_size"], c["global_rank"], c["global_world_size"]) for c in vision] == [
        (0, 2, 0, 3),
        (1, 2, 1, 3),
    ]
    text = disagg["text"].call("coordinates")  # RANK_ZERO: one dict, not a list
    assert (text["module"], text["rank"], text["world_size"], text["global_rank"]) == ("text", 0, 1, 2)
    _check_dp_grads(disagg)


@pytest.mark.parametrize("transport", ["GLOO", None], ids=["direct", "object_store"])
def test_tensor_moves_vision_to_text(disagg: Runtime, transport: str | None) -> None:
    vision, text = disagg["vision"], disagg["text"]
    assert vision.tensor_transport == "GLOO"
    vision.tensor_transport = transport
    try:
        ref = vision.call("produce", [7, 8], [1000, 1000])[1]  # refs, never tensors, in the driver
        assert isinstance(ref, ray.ObjectRef)
        # handed back only once finished, with its tensors' metadata here: the driver thread starts the transfer
        meta = ray._private.worker.global_worker.rdt_manager.get_rdt_metadata(ref.hex())
        assert (meta is not None and meta.tensor_transport_meta is not None) == (transport is not None)
        (got,) = text.call("consume", [ref])
    finally:
        vision.tensor_transport = "GLOO"
    expected = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    assert torch.equal(got, expected)


def test_failed_tensor_producer_names_its_rank(disagg: Runtime) -> None:
    with pytest.raises(WorkerError, match="vision rank 1 failed in produce_or_fail") as e:
        disagg["vision"].call("produce_or_fail", 1)
    assert "toy failure while producing, rank 1" in str(e.value)


def test_scatter_with_wrong_count_is_refused(disagg: Runtime) -> None:
    with pytest.raises(DispatchError, match="3 items but the group has 2 ranks"):
        disagg["vision"].call("dp_grads", [1, 2, 3], Broadcast(0))
    with pytest.raises(DispatchError, match="must be a list with one item per rank"):
        disagg["vision"].call("consume", torch.zeros(2))


def _alive(run_id: str) -> list[str]:
    """Names of live dhp actors of a run, from the GCS actor table (the state API needs the dashboard)."""
    table = ray._private.state.actors().values()
    return sorted(a["Name"] for a in table if a["State"] == "ALIVE" and a["Name"].startswith(f"dhp-{run_id}"))


def test_layout_too_big_fails_before_any_actor(ray_cluster: dict) -> None:
    before = _alive("")
    rt = Runtime({"vision": _spec(2), "text": _spec(6)}, placement="disaggregated", cpus_per_worker=1.0)
    with pytest.raises(LayoutError, match=r"asks for 8 CPUs in all but the Ray cluster has 4"):
        rt.start()
    assert rt.groups == {}
    assert _alive("") == before


def test_collocated_grads_errors_and_shutdown(ray_cluster: dict) -> None:
    rt = Runtime({"vision": _spec(2), "text": _spec(2)}, placement="collocated", cpus_per_worker=0.5)
    assert rt.plan.bundles == [{"CPU": 1.0}] * 2  # rank i of both modules in bundle i
    try:
        rt.start()
        _check_dp_grads(rt)
        with pytest.raises(WorkerError) as info:
            rt["text"].call("fail_on", 1)
        msg = str(info.value)
        assert "text rank 1" in msg and "fail_on" in msg and "toy failure on purpose, rank 1" in msg
        assert "worker traceback" in msg and 'raise ValueError(f"toy failure' in msg, msg
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"vision rank 0 failed in fail_during_collective[\s\S]*inside a coll"):
            rt["vision"].call("fail_during_collective", 0)  # rank 1 stays stuck in all_reduce: must not hang
        assert time.monotonic() - start < 20
    finally:
        actors = rt.actors()
        rt.shutdown()
    assert len(actors) == 4
    for a in actors:
        with pytest.raises(RayActorError):
            ray.get(a.dhp_ping.remote(), timeout=30)
    deadline = time.monotonic() + 10
    while _alive(rt.run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(rt.run_id) == []


def test_a_consumer_names_the_producer_whose_failure_it_inherits(ray_cluster: dict) -> None:
    """A text call handed a vision output that could not be made fails at the text ref's ``ray.get``; the
    error names the vision rank (and its method where Ray says it), not the text rank that only inherited it."""
    with Runtime({"vision": _spec(1), "text": _spec(1)}, placement="collocated", transport="object_store",
                 cpus_per_worker=0.5) as rt:
        vision, text = rt["vision"], rt["text"]
        raised = vision.submit_rank(0, "produce_or_fail", 0)  # not awaited: text gets the failed ref
        with pytest.raises(WorkerError) as e:
            text.get("consume", text.submit("consume", [raised]))
        assert (e.value.module, e.value.rank, e.value.method) == ("vision", 0, "produce_or_fail")
        assert "making an input of text rank 0's consume()" in str(e.value)
        assert "toy failure while producing, rank 0" in str(e.value)

        slow = vision.submit_rank(0, "produce_slowly", 60.0)
        consumer = text.submit("consume", [slow])
        time.sleep(1.0)
        ray.kill(vision.actors[0], no_restart=True)  # the producer dies mid-call
        with pytest.raises(WorkerError) as e:
            text.get("consume", consumer, timeout_s=60)
        assert (e.value.module, e.value.rank) == ("vision", 0)
        assert str(e.value).startswith("vision rank 0 died while making an input of text rank 0's consume()")
        assert text.call("fail_on", 1) == [0]  # the consumer itself is fine


def test_a_wait_that_watches_submitted_calls_ends_with_their_failure(ray_cluster: dict) -> None:
    """The driver submits a text round before it takes the last one's losses (p2p plane). A failed text round
    leaves an encoder call queued behind a call that waits for its output forever (a backward in its receive);
    ``get_watching`` on the queued call raises the text rank's error as soon as it fails, while the failing
    rank's peer still waits in its collective, and the queued call is still queued; a failed rank of the target
    itself raises as soon, though its peer never answers. Watched calls that succeed change nothing: the target's
    value, collected by its method's dispatch."""
    with Runtime({"vision": _spec(1), "text": _spec(2)}, placement="disaggregated", transport="object_store",
                 cpus_per_worker=0.5) as rt:
        vision, text = rt["vision"], rt["text"]
        fine = text.fail_on.submit(-1)
        assert get_watching(vision.fail_on.submit(-1), [fine]) == [0]
        assert fine.get() == [0, 1]
        failing = text.fail_during_collective.submit(1)  # rank 1 raises, rank 0 waits in its all-reduce
        vision.submit_rank(0, "produce_slowly", 600.0)  # an encoder backward that never gets its gradients
        queued = vision.fail_on.submit(-1)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"text rank 1 failed in fail_during_collective"):
            get_watching(queued, [fine, failing])
        assert time.monotonic() - start < 60  # not the 600 s the blocked call would take
        assert ray.wait(queued.refs, timeout=0)[0] == []  # a plain get would have waited on it
        # the target's own failed rank raises at once too, while its peer never answers (text rank 0 is still in
        # the all-reduce above) and the watched call is still queued
        with pytest.raises(WorkerError, match=r"text rank 1 failed in fail_on"):
            get_watching(text.fail_on.submit(1), [queued])


def test_plans_and_fit_checks_without_actors(ray_cluster: dict) -> None:
    assert start_ray(None, None) is False  # already initialized: joins nothing, starts nothing
    plan = plan_placement("disaggregated", {"vision": 2, "text": 6}, 1.0, 1.0)
    assert len(plan.bundles) == 8 and plan.bundle_of[("text", 0)] == 2
    assert plan.bundles[0] == {"CPU": 1.0, "GPU": 1.0}
    col = plan_placement("collocated", {"vision": 2, "text": 1}, 1.0, 1.0)
    assert col.bundles == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert col.actor_resources[("vision", 0)].num_gpus == 0.5 and col.actor_resources[("vision", 1)].num_gpus == 1.0
    with pytest.raises(LayoutError, match="asks for 8 GPUs in all but the Ray cluster has 0"):
        check_fits(plan, {"CPU": 64.0}, [])
    with pytest.raises(LayoutError, match="does not fit on any single node"):
        check_fits(col, {"CPU": 4.0, "GPU": 2.0}, [{"CPU": 1.5, "GPU": 1.0}, {"CPU": 2.5}])
    with pytest.raises(LayoutError, match="at least one rank"):
        plan_placement("disaggregated", {"vision": 0}, 1.0, 0.0)
    assert resolve_transport("auto", "gloo", 0.0) is None  # CPU: object store (RDT over gloo can lose a transfer)
    assert resolve_transport("direct", "gloo", 0.0) == "GLOO"
    assert resolve_transport("auto", "nccl", 1.0) == "NCCL"
    assert resolve_transport("auto", "nccl", 0.5) is None  # shared GPU: object store
    assert resolve_transport("object_store", "nccl", 1.0) is None


def test_bound_methods_match_call_and_submit(disagg: Runtime) -> None:
    vision, text = disagg["vision"], disagg["text"]
    bound = vision.all_coordinates
    assert isinstance(bound, BoundMethod) and bound.__doc__ is None and "split ALL" in repr(bound)
    assert bound() == bound.submit().get() == vision.call("all_coordinates")
    assert [c["rank"] for c in bound()] == [0, 1]
    pending = text.coordinates.submit()  # RANK_ZERO: one dict, whether bound or called by name
    assert isinstance(pending, Pending) and pending.ranks == [0] and len(pending.refs) == 1
    assert isinstance(pending.refs[0], ray.ObjectRef)
    assert pending.get() == text.coordinates() == text.call("coordinates")
    assert text.coordinates()["module"] == "text"
    assert vision.first(["a", "b"]) == (0, "a")  # split RANK, collect RANK_ZERO
    # a bound call runs the declared split: rank r gets item r, like call("dp_grads", ...)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, DIM, generator=g), torch.randn(6, generator=g)
    ref = _reference_grads(x, y)
    for grads in vision.dp_grads([x[:3], x[3:]], [y[:3], y[3:]]):
        torch.testing.assert_close(grads["weight"], ref["weight"])


def test_bound_method_errors(disagg: Runtime) -> None:
    vision = disagg["vision"]
    with pytest.raises(AttributeError, match="ToyWorker has no method 'dp_gards'"):
        vision.dp_gards  # noqa: B018 - the attribute access is what is tested
    with pytest.raises(AttributeError):
        vision._init_subgroups  # noqa: B018 - private worker methods are not bound
    assert not isinstance(vision.submit, BoundMethod) and not isinstance(vision.n_ranks, BoundMethod)
    with pytest.raises(DispatchError, match=r"dp_grads \(split RANK\): argument 0 has 3 items but the group has 2"):
        vision.dp_grads([1, 2, 3], Broadcast(0))
    with pytest.raises(DispatchError, match=r"dp_grads .*argument 'y' has 1 items"):
        vision.dp_grads.submit([1, 2], y=[0])
    with pytest.raises(WorkerError, match="vision rank 1 failed in fail_on") as e:
        vision.fail_on.submit(1).get()
    assert "toy failure on purpose, rank 1" in str(e.value)
    with pytest.raises(WorkerError, match="vision rank 0 failed in produce_or_fail"):
        vision.produce_or_fail.submit(0).get()  # a producer's failure too, though its get() pulls no tensors


def test_three_groups_replicas_split_and_collect(ray_cluster: dict) -> None:
    modules = {"vision": _spec(4, replica_size=2), "audio": _spec(1), "text": _spec(2)}
    with Runtime(modules, placement="collocated", cpus_per_worker=0.25) as rt:
        vision, audio, text = rt["vision"], rt["audio"], rt["text"]
        assert [g.n_ranks for g in (vision, audio, text)] == [4, 1, 2]
        assert (vision.replica_size, vision.n_replicas, vision.replica_heads()) == (2, 2, [0, 2])
        assert vision.ranks_of_replica(1) == [2, 3] and text.replica_heads() == [0, 1]
        # every group has its own process group inside one world of 7, groups laid end to end
        coords = {m: rt[m].all_coordinates() for m in modules}
        assert [c["global_rank"] for m in modules for c in coords[m]] == list(range(7))
        assert {c["global_world_size"] for m in modules for c in coords[m]} == {7}
        assert vision.group_sum() == [10.0] * 4 and audio.group_sum() == [1.0] and text.group_sum() == [3.0] * 2
        # REPLICA split: both ranks of replica r get item r; Collect.ALL keeps every rank
        assert vision.take(["a", "b"]) == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]
        assert vision.take(Broadcast("z")) == [(r, "z") for r in range(4)]
        # REPLICA_HEADS: one result per replica, from ranks 0 and 2
        assert vision.take_heads(["a", "b"]) == [(0, "a"), (2, "b")]
        assert vision.take_heads.submit(["a", "b"]).get() == vision.call("take_heads", ["a", "b"])
        with pytest.raises(DispatchError, match=r"take \(split REPLICA\): argument 0 has 4 items but the group "
                                                r"has 2 replicas \(4 ranks, replica_size 2\)"):
            vision.take(["a", "b", "c", "d"])
        with pytest.raises(DispatchError, match="take_heads.*must be a list with one item per replica"):
            vision.take_heads("ab")
        # a producer's Pending gives the heads' refs, not tensors; another group consumes them
        pending = vision.produce_replica.submit([11, 12], Broadcast(50))
        assert len(pending.refs) == 4
        refs = pending.get()
        assert len(refs) == 2 and all(isinstance(r, ray.ObjectRef) for r in refs)
        assert refs == [pending.refs[0], pending.refs[2]]
        got = text.consume(refs)
        for seed, t in zip((11, 12), got, strict=True):
            assert torch.equal(t, torch.randn(50, generator=torch.Generator().manual_seed(seed)))


def test_replica_size_must_divide_the_ranks() -> None:
    with pytest.raises(ValueError, match="n_ranks 3 is not a multiple of replica_size 2"):
        GroupSpec(ToyWorker, 3, replica_size=2)
    with pytest.raises(ValueError, match="replica_size must be an int >= 1"):
        GroupSpec(ToyWorker, 2, replica_size=0)
    assert GroupSpec(ToyWorker, 2, None).kwargs == {}
