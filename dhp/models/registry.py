"""Model families by name: ``model.family`` (or an HF ``config.json``'s ``model_type``) -> ``Family``.

Built-in families are listed as import paths and imported on first use, so
importing this registry imports no model. A plugin registers its own with
``register_family(spec)``, or names it in the config as ``model.family=package.module:ATTR``
(that form also reaches Ray workers, which import it themselves).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from dhp.models.spec import Family

DEFAULT_FAMILY = "qwen2_5_vl"
_BUILTIN = {
    "qwen2_5_vl": "dhp.models.qwen2_5_vl.family:FAMILY",
    "qwen2_5_omni": "dhp.models.qwen2_5_omni.family:FAMILY",
    "qwen3_vl": "dhp.models.qwen3_vl.family:FAMILY",
}
_registered: dict[str, Family] = {}


class UnknownFamily(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register_family(family: Family) -> Family:
    """Add (or replace) a family under ``family.name``; returns it."""
    _registered[family.name] = family
    return family


def builtin_names() -> list[str]:
    """The families dhp ships: every process finds them by name (a registered plugin only where it registered)."""
    return sorted(_BUILTIN)


def family_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered))


def get_family(name: str) -> Family:
    """The family registered as ``name``, a built-in one, or ``module:ATTR`` imported."""
    if name in _registered:
        return _registered[name]
    target = _BUILTIN.get(name, name if ":" in name else None)
    if target is None:
        raise UnknownFamily(f"model.family: unknown family {name!r}; known: {', '.join(family_names())} "
                            "(or give package.module:ATTR)")
    module_name, _, attr = target.partition(":")
    try:
        spec = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownFamily(f"model.family: cannot load {target} ({e})") from None
    if not isinstance(spec, Family):
        raise UnknownFamily(f"model.family: {target} is a {type(spec).__name__}, not a Family")
    if name in _BUILTIN:
        _registered[name] = spec
    return spec


def family_for_model_type(model_type: str) -> Family:
    """The family whose ``hf_model_types`` include ``model_type``."""
    for name in family_names():
        spec = get_family(name)
        if model_type in spec.hf_model_types:
            return spec
    raise UnknownFamily(f"model.hf_path: model_type {model_type!r} belongs to no known family "
                        f"({', '.join(family_names())}); set model.family")


def family_of_preset(preset: str) -> Family | None:
    """The family with a preset of that name (``omni-7b``: Qwen2.5-Omni), the default family first; or None."""
    names = [DEFAULT_FAMILY] + [n for n in family_names() if n != DEFAULT_FAMILY]
    return next((spec for spec in map(get_family, names) if preset in spec.presets), None)


def resolve_family(family: str | None, hf_path: str | None, preset: str | None = None) -> Family:
    """``model.family`` when set, else the family of ``model.hf_path``'s model_type, else the family with
    ``model.preset``, else the default."""
    if family:
        return get_family(family)
    if hf_path:
        config = Path(hf_path) / "config.json"
        if config.is_file():
            model_type = json.loads(config.read_text()).get("model_type")
            if model_type:
                return family_for_model_type(model_type)
    if preset and not hf_path:
        found = family_of_preset(preset)
        if found is not None:
            return found
    return get_family(DEFAULT_FAMILY)
