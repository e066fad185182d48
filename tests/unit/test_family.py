"""The model-family interface: a second encoder plugs in through the registry alone, and generic code
imports no family (checked on the import graph, including imports inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dhp.config import ConfigError, load_config
from dhp.data.sampler import BatchPlanner
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs
from dhp.models.registry import get_family, register_family, resolve_family
from tests.toy_audio import TOY_FAMILY, write_audio_data

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("dhp.models.spec", "dhp.models.registry", "dhp.models.layers")  # leaves, not families
GENERIC = ["dhp/runtime", "dhp/parallel", "dhp/backends", "dhp/engine.py", "dhp/train.py", "dhp/inputs.py",
           "dhp/evaluate.py", "dhp/cli.py", "dhp/config.py", "dhp/data/sampler.py"]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _files(entries: list[str]) -> list[Path]:
    files = []
    for e in entries:
        p = ROOT / e
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def test_generic_code_imports_no_model_family():
    offenders = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m.startswith("dhp.models.")
                                                  and m not in SHARED)
                 for f in _files(GENERIC)}
    assert {f: m for f, m in offenders.items() if m} == {}


def _all_dhp_imports(tree: ast.AST) -> set[str]:
    """dhp modules imported anywhere in a file (inside functions too), except under ``if TYPE_CHECKING:``."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    deps = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dhp") and node.level == 0:
            deps.add(node.module)
            deps.update(f"{node.module}.{a.name}" for a in node.names)  # `from dhp.x import module`
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("dhp"))
    return deps


def test_no_import_circles():
    """dhp's modules form no import cycle, counting imports inside functions (the old runtime/backend.py ->
    train.py -> runtime/backend.py circle went through one), so shared types live in leaves."""
    graph: dict[str, set[str]] = {}
    for f in (ROOT / "dhp").rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _all_dhp_imports(ast.parse(f.read_text()))
    for name, deps in graph.items():  # importing a.b.c imports its packages a.b and a first
        graph[name] = {d for d in deps if d in graph} - {name}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join(path[path.index(dep):] + [dep]) if dep in path else dep)
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


def test_registry_finds_builtin_and_plugin_families(tmp_path):
    assert get_family("qwen2_5_vl").module_names == ("vision", "text")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    assert resolve_family(None, str(tmp_path)).name == "qwen2_5_vl"
    register_family(TOY_FAMILY)
    assert get_family("toy_qwen_audio").module_names == ("vision", "audio", "text")
    assert get_family("tests.toy_audio:TOY_FAMILY") is TOY_FAMILY  # package.module:ATTR, as workers could use
    with pytest.raises(ConfigError, match="model.family: unknown family"):
        load_config(None, ["model.family=nonexistent"])


@pytest.fixture
def audio_overrides(demo_data, tmp_path):
    register_family(TOY_FAMILY)
    data = write_audio_data(demo_data.train, demo_data.root, tmp_path / "audio.jsonl")
    return [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "model.family=toy_qwen_audio", "train.global_batch_size=8", "train.micro_batch_size=4",
            "train.optimizer=sgd", "train.lr=0.05", "train.warmup_steps=1", f"output.dir={tmp_path / 'run'}"]


def test_toy_audio_family_trains_locally_and_both_encoders_learn(audio_overrides):
    from dhp.backends.local import LocalBackend

    cfg = load_config(None, audio_overrides + ["audio.lr_scale=2.0"])
    assert list(cfg.modules) == ["vision", "audio", "text"] and cfg.audio.lr_scale == 2.0
    inputs = resolve_inputs(cfg)
    ds = open_dataset(dataset_spec(inputs, inputs.train_path))
    costs = module_costs(inputs.family, inputs.model_cfg, ds)
    carry_audio = [i for i, c in enumerate(costs["audio"]) if c > 0]
    carry_image = [i for i, c in enumerate(costs["vision"]) if c > 0]
    assert carry_audio and carry_image and set(carry_audio) != set(carry_image)
    planner = BatchPlanner(costs, {m: 1 for m in costs}, 8, 4)
    plan = planner.plan(0)
    for rnd in plan.rounds:  # each encoder gets exactly the round's samples that carry its modality
        assert sorted(rnd.replicas("audio")[0]) == sorted(i for i in rnd.sample_ids if costs["audio"][i] > 0)
    backend = LocalBackend(inputs, ds)
    before = backend.state_dict()
    stats = [backend.run_step(planner.plan(s)) for s in range(2)]
    after = backend.state_dict()
    assert all(s.timings.get("audio_forward", 0) > 0 for s in stats)
    for prefix in ("audio.", "visual.", "language."):
        moved = max((after[k] - before[k]).abs().max().item() for k in after if k.startswith(prefix))
        assert moved > 1e-4, prefix


def test_audio_embeddings_reach_the_loss(audio_overrides):
    """Changing the audio encoder's output weights changes the loss: its embeddings really sit in the sequence."""
    from dhp.backends.local import LocalBackend

    cfg = load_config(None, audio_overrides)
    inputs = resolve_inputs(cfg)
    ds = open_dataset(dataset_spec(inputs, inputs.train_path))
    costs = module_costs(inputs.family, inputs.model_cfg, ds)
    plan = BatchPlanner(costs, {m: 1 for m in costs}, 8, 4).plan(0)
    losses = []
    for scale in (1.0, 3.0):
        backend = LocalBackend(inputs, ds)
        with torch.no_grad():
            backend.encoders[1].module.out.weight.mul_(scale)
        losses.append(backend.run_step(plan).loss)
    assert abs(losses[0] - losses[1]) > 1e-4


def test_toy_processor_counts_from_headers_and_names_a_bad_clip(audio_overrides, tmp_path):
    """The third family's own processor: token counts from the .npy header (the planner's costs see them before
    any decoding), the decoded frames in the sample, and a bad clip named by file and sample."""
    import json

    import numpy as np

    from dhp.errors import DataError

    cfg = load_config(None, audio_overrides)
    inputs = resolve_inputs(cfg)
    ds = open_dataset(dataset_spec(inputs, inputs.train_path))
    audio = inputs.family.module("audio")
    rows = [json.loads(line) for line in inputs.train_path.read_text().splitlines()]
    for i in range(len(ds)):
        row = rows[ds.source_index(i)]
        frames = [np.load(p).shape[0] for p in row.get("audio", [])]
        assert ds.info(i).audio_frames == tuple(frames)
        assert audio.num_placeholders(ds.info(i), inputs.model_cfg) == sum(frames) // 2
        if frames:
            sample = ds.get(i)
            assert torch.equal(sample.toy_frames, torch.cat([torch.from_numpy(np.load(p)) for p in row["audio"]]))
            assert audio.num_placeholders(sample, inputs.model_cfg) == sum(frames) // 2
    bad = next(k for k, r in enumerate(rows) if "audio" in r)
    np.save(rows[bad]["audio"][0], np.zeros((3, 12), np.float32))  # an odd number of frames
    # a media file changed in place leaves the data file's index key as it was: validated again without the cache
    inputs = resolve_inputs(load_config(None, [*audio_overrides, "data.index_cache=false"]))
    with pytest.raises(DataError, match=rf"(?s)sample {bad}.*{Path(rows[bad]['audio'][0]).name}.*even"):
        open_dataset(dataset_spec(inputs, inputs.train_path))


def test_families_doc_shows_the_toy_family_as_it_is():
    """Every code block of docs/families.md's minimal family is in tests/toy_audio.py, verbatim: the doc shows code
    that the tests run."""
    import re

    doc = (ROOT / "docs" / "families.md").read_text()
    source = (ROOT / "tests" / "toy_audio.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc.split("## A whole minimal family", 1)[1], flags=re.S)
    assert len(blocks) >= 3
    for block in blocks:
        assert block in source, block[:80]
