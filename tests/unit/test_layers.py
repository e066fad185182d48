"""The layer order of docs/design.md, on the import graph: no import runs back up a layer, and the planner imports
no model family and holds none of a family's constants (dhp/data/: tests/unit/test_data_generic.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_family import _all_dhp_imports  # every dhp import of a file, inside functions too

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top (docs/design.md, "Layers"). A module may import its own layer and the ones below, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("dhp.errors", "dhp.progress", "dhp.storage", "dhp.optim", "dhp.lifetime", "dhp.data_path")),
    ("observe", ("dhp.observe",)),
    ("ops", ("dhp.ops",)),
    ("parallel", ("dhp.parallel",)),
    ("model interface", ("dhp.models.spec", "dhp.models.registry", "dhp.models.layers", "dhp.models.adapter",
                         "dhp.models.loss", "dhp.models")),
    ("config", ("dhp.config",)),
    ("data", ("dhp.data",)),
    ("families", tuple(f"dhp.models.{d.name}" for d in sorted((ROOT / "dhp" / "models").iterdir())
                       if (d / "__init__.py").is_file())),  # every folder under dhp/models/ is a family
    ("engines", ("dhp.engine", "dhp.engine_checkpoint", "dhp.inputs", "dhp.evaluate")),
    ("runtime", ("dhp.runtime",)),
    ("backends and planner", ("dhp.backends", "dhp.plan")),
    ("commands", ("dhp.train", "dhp.checkpoint", "dhp.bench", "dhp.cli", "dhp")),
]


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a dotted module name (the longest matching prefix wins)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and to docs/design.md"
    return best


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Path]:
    return sorted((ROOT / "dhp").rglob("*.py"))


def test_layers_in_the_design_doc_are_the_tested_ones():
    text = (ROOT / "docs" / "design.md").read_text()
    for name, prefixes in LAYERS:
        assert name in text, f"docs/design.md does not describe the layer {name!r}"
        for p in prefixes:
            assert f"`{p}`" in text or p in ("dhp", "dhp.models"), f"docs/design.md does not place {p}"


def test_no_import_runs_up_a_layer():
    upward = []
    for f in _sources():
        module = _module_name(f)
        mine = layer_of(module)
        for target in _all_dhp_imports(ast.parse(f.read_text())):
            if layer_of(target) > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert upward == []


def test_plan_imports_no_family_and_holds_no_family_constant():
    """The planner plans any family through the interface (dhp/data/ is held to the same in test_data_generic)."""
    from tests.unit.test_data_generic import _findings

    families = LAYERS[layer_of("dhp.models.qwen2_5_vl")][1]
    found = []
    for f in sorted((ROOT / "dhp" / "plan").rglob("*.py")):
        source = f.read_text()
        found += [f"{f.name} imports {t}" for t in _all_dhp_imports(ast.parse(source))
                  if any(t == p or t.startswith(p + ".") for p in families)]
        found += _findings(f.name, source)
    assert found == []
