"""Driver side of checkpoints: the directory layout, the run's record, which checkpoint to resume, HF export.

    output.dir/
      checkpoints/step_000120/
        vision/  text/ ...   DCP shards, written by each module group's own ranks (dhp/engine_checkpoint.py)
        trainer.json         step, epoch, seed, config, family, layouts, data fingerprint, skipped samples,
                             and a manifest of every file with its size
        COMPLETE             written last, atomically: a checkpoint without it is unfinished
      workers.json           module, rank, node, pid of every worker (rewritten at every start)
      final/                 Hugging Face safetensors, exported shard by shard from the last checkpoint

``output.dir`` may be an fsspec URL (``s3://bucket/run``): every path here is then a ``dhp.storage.UrlPath``,
the groups write their shards through DCP's fsspec writer, the record and ``COMPLETE`` are single objects put
after every group's save returned (an object store's put is all or nothing, so ``COMPLETE`` last is the
atomic step), and export uploads each safetensors shard as soon as it is written.

No weight passes through the driver: the workers write, and export streams tensors
from the DCP files into safetensors shards one shard at a time. Everything the driver
writes is JSON; tensors are read back only through DCP or safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dhp.errors import CheckpointError
from dhp.storage import AnyPath, UrlPath, dcp_reader, files_under, is_url, location, rmtree

COMPLETE = "COMPLETE"
RECORD = "trainer.json"
FORMAT = 1


def checkpoints_dir(out: AnyPath) -> AnyPath:
    return out / "checkpoints"


def step_dir(out: AnyPath, step: int) -> AnyPath:
    return checkpoints_dir(out) / f"step_{step:06d}"


def data_fingerprint(path: Path, num_samples: int, skipped: list[int]) -> str:
    """The training data as the plan sees it: the file's bytes, the usable samples, the skipped ones."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(json.dumps([num_samples, sorted(skipped)]).encode())
    return h.hexdigest()


def _manifest(ckpt: AnyPath) -> dict[str, int]:
    return {rel: size for rel, size in files_under(ckpt).items() if rel not in (RECORD, COMPLETE)}


def finish(ckpt: AnyPath, record: dict[str, Any]) -> None:
    """Write the run's record with a manifest of the shards, then the completion marker, atomically."""
    record = {"format": FORMAT, **record, "files": _manifest(ckpt)}
    _atomic_write(ckpt / RECORD, json.dumps(record, indent=2) + "\n")
    _atomic_write(ckpt / COMPLETE, f"{record['step']}\n")


def _atomic_write(path: AnyPath, text: str) -> None:
    """``text`` at ``path`` all at once, and on disk before this returns (the file, then its directory entry, are
    fsync'ed: on a shared filesystem another node reading COMPLETE finds the record it vouches for; the shards
    before it are fsync'ed by DCP's writer). On an object store one put: the object appears whole or not at all."""
    if isinstance(path, UrlPath):
        path.write_text(text)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(ckpt: str | AnyPath) -> dict[str, Any]:
    """The record of a complete, intact checkpoint; CheckpointError naming the file otherwise."""
    ckpt = location(ckpt)
    if not (ckpt / COMPLETE).is_file():
        raise CheckpointError(f"{ckpt}: incomplete (no {COMPLETE} marker): its save did not finish")
    try:
        record = json.loads((ckpt / RECORD).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt / RECORD}: unreadable ({e})") from None
    present = files_under(ckpt)  # one listing (one request on an object store)
    for rel, size in record.get("files", {}).items():
        f = ckpt / rel
        if rel not in present:
            raise CheckpointError(f"{f}: missing from the checkpoint")
        if present[rel] != size:
            raise CheckpointError(f"{f}: {present[rel]} bytes, {size} when written: truncated or corrupt")
    return record


def resolve_checkpoint(path: str | AnyPath, log: Any = print) -> AnyPath:
    """The checkpoint ``path`` names: a checkpoint directory itself, or a run's ``output.dir`` (or its
    ``checkpoints/`` folder), whose newest complete and intact checkpoint it means (said through ``log``); a
    CheckpointError naming the path and what to give otherwise."""
    given = location(path)
    if (given / COMPLETE).is_file():
        return given
    run = given.parent if given.name == "checkpoints" else given
    if checkpoints_dir(run).is_dir():
        found = latest(run, log)
        if found is None:
            raise CheckpointError(f"{checkpoints_dir(run)}: no complete checkpoint in this run")
        log(f"dhp: {path}: the run's newest complete checkpoint, {found[0].name}")
        return found[0]
    what = "give a checkpoint (output.dir/checkpoints/step_N) or a run's output.dir (its newest checkpoint)"
    if not given.is_dir():
        raise CheckpointError(f"{path}: no such directory; {what}")
    if not (given / RECORD).is_file():
        raise CheckpointError(f"{path}: neither a checkpoint (no {RECORD}) nor a run's output.dir (no checkpoints/); "
                              f"{what}")
    return given  # a checkpoint whose save did not finish: read_record says so


def complete_checkpoints(out: AnyPath) -> list[AnyPath]:
    """Checkpoint directories with a completion marker, oldest first."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())


def latest(out: AnyPath, log: Any = print) -> tuple[AnyPath, dict[str, Any]] | None:
    """The newest complete and intact checkpoint; incomplete or corrupt ones are skipped with a message."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return None
    for ckpt in sorted(root.glob("step_*"), reverse=True):
        try:
            return ckpt, read_record(ckpt)
        except CheckpointError as e:
            log(f"dhp: skipping checkpoint {ckpt.name}: {e}")
    return None


def prune(out: AnyPath, keep: int) -> list[AnyPath]:
    """Delete all but the newest ``keep`` complete checkpoints (and unfinished ones older than the newest complete);
    called only after a newer checkpoint is complete. ``keep=0`` keeps everything."""
    complete = complete_checkpoints(out)
    if not complete:
        return []
    doomed = complete[:-keep] if keep else []
    newest = complete[-1]
    doomed += [p for p in checkpoints_dir(out).glob("step_*") if p not in complete and p.name < newest.name]
    for p in doomed:
        rmtree(p)
    return doomed


@dataclass
class Mismatch:
    what: str
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.what}: the checkpoint has {_shown(self.saved)}, this run has {_shown(self.now)}"


def _shown(value: Any) -> str:
    return value if isinstance(value, Described) else repr(value)


class Described(str):
    """A value shown as its own words in a Mismatch (a description, not a config value to quote)."""


# Keys a resumed run may change with train.resume_changes=allow (from the checkpoint's step on): the schedule
# (steps, learning rate, warmup, ...), the optimizer's hyperparameters, the precision and the data's resizing.
# Each changes what the run computes, so each is named and refused unless the user allows it.
SCHEDULE_KEYS = ("steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "betas", "eps", "momentum",
                 "clip_grad_norm", "dtype", "precision")
BATCH_KEYS = ("seed", "global_batch_size")  # the batch plan itself: another is another run, never resumed
DATA_KEYS = ("image_root", "min_pixels", "max_pixels", "video_fps", "video_min_frames", "video_max_frames",
             "video_max_pixels", "video_total_pixels", "max_audio_seconds")


@dataclass
class Compatibility:
    """``refused``: what no setting can resume across (another model, other data, another optimizer, another
    batch plan: seed or global batch, other trainable modules); ``changed``: keys that differ and need
    ``train.resume_changes=allow``."""

    refused: list[Mismatch]
    changed: list[Mismatch]


def compatibility(record: dict[str, Any], family: str, model: dict, data: str, cfg: dict,
                  data_path: str | None = None, num_samples: int | None = None) -> Compatibility:
    """How this run differs from the checkpoint's: what refuses the resume outright, and the keys it changes."""
    refused = []
    if record.get("family") != family:
        refused.append(Mismatch("model.family", record.get("family"), family))
    if record.get("model") != model:
        diff = sorted(k for k in set(model) | set(record.get("model", {}))
                      if model.get(k) != record.get("model", {}).get(k))
        refused.append(Mismatch(f"the model config ({', '.join(diff)})", Described("another model"),
                                Described("this run's model.preset / model.hf_path")))
    if record.get("data_fingerprint") != data:
        refused.append(Mismatch("the training data (data.path and its samples)",
                                Described(_data_text(record.get("data_path"), record.get("num_samples"),
                                                     record.get("data_fingerprint"))),
                                Described(_data_text(data_path, num_samples, data))))
    saved = record.get("config", {})
    for key in ("optimizer", *BATCH_KEYS):
        old = _section(saved, "train").get(key, cfg["train"][key])
        if old != cfg["train"][key]:
            refused.append(Mismatch(f"train.{key}", old, cfg["train"][key]))
    modules = [k for k, v in cfg.items() if isinstance(v, dict) and "trainable" in v]
    for name in modules:
        old = _section(saved, name).get("trainable", cfg[name]["trainable"])
        if old != cfg[name]["trainable"]:
            refused.append(Mismatch(f"{name}.trainable", old, cfg[name]["trainable"]))
    changed = []
    for sec, keys in (("train", SCHEDULE_KEYS), ("data", DATA_KEYS),
                      *((name, ("lr_scale",)) for name in modules)):
        for key in keys:
            if key not in cfg.get(sec, {}) or key not in _section(saved, sec):
                continue
            old, now = _plain(_section(saved, sec)[key]), _plain(cfg[sec][key])
            if old != now:
                changed.append(Mismatch(f"{sec}.{key}", old, now))
    return Compatibility(refused, changed)


def _section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return cfg.get(name) or {}  # an older checkpoint's config may lack a section


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _data_text(path: str | None, num_samples: int | None, fingerprint: str | None) -> str:
    return (f"{path or 'an unknown file'} ({num_samples if num_samples is not None else '?'} usable samples, "
            f"SHA-256 {str(fingerprint)[:12]}...)")


# ---- export ----------------------------------------------------------------------------------------------


# What a drop-in copy carries over besides the weights and config.json: the tokenizer's files from the tokenizer
# directory, the processor's and generation's from the checkpoint the run started from (model.hf_path).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja")
SOURCE_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                "generation_config.json", "chat_template.json", "chat_template.jinja")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def source_dir(cfg: Any) -> Path | None:
    """The Hugging Face checkpoint a run started from (``model.hf_path``), when it is still there."""
    path = getattr(cfg.model, "hf_path", None)
    return Path(path) if path and Path(path).is_dir() else None


def export_hf(ckpt: str | AnyPath, out: str | AnyPath, family: Any, model_cfg: Any,
              tokenizer_dir: Path | None = None, dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 2**30,
              source_dir: Path | None = None) -> AnyPath:
    """A Hugging Face directory from a checkpoint, a drop-in copy of the one the run started from: config.json
    (with its bos/eos/pad ids), sharded safetensors with their index, the tokenizer's files, and the source's
    processor, chat template and generation config (``carry_files``).

    Streams: reads the tensors of one output shard from the DCP files, writes it, frees it; the whole model
    is never in memory. Tied weights are written once (as HF expects). ``out`` may be a URL: each file is
    written to a local staging directory and uploaded at once (one shard on local disk at a time)."""
    ckpt, out = location(ckpt), location(out)
    if isinstance(out, UrlPath):
        with tempfile.TemporaryDirectory(prefix="dhp-export-") as staging:
            for stale in out.glob("*"):  # an earlier export's files: the directory is the export's own
                stale.unlink(missing_ok=True)
            return _export_hf(ckpt, Path(staging), family, model_cfg, tokenizer_dir, dtype, max_shard_bytes,
                              source_dir, upload_to=out)
    return _export_hf(ckpt, out, family, model_cfg, tokenizer_dir, dtype, max_shard_bytes, source_dir)


def _upload(local: Path, remote: UrlPath | None) -> None:
    """Move a written file of the export to its URL (nothing to do for a local export)."""
    if remote is not None:
        remote.fs.put_file(str(local), (remote / local.name).key)
        local.unlink()


def _export_hf(ckpt: AnyPath, out: Path, family: Any, model_cfg: Any, tokenizer_dir: Path | None,
               dtype: torch.dtype | None, max_shard_bytes: int, source_dir: Path | None,
               upload_to: UrlPath | None = None) -> AnyPath:
    """``export_hf`` into the local ``out``, each finished file moved on to ``upload_to`` when given."""
    from safetensors.torch import save_file

    record = read_record(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    weights = family.weights  # our keys -> HF names (fused ones cut in parts), tying, config.json
    tied = weights.tied(model_cfg)
    items: list[tuple[str, str, str, Any]] = []  # (module dir, our key in the module, our whole-model key, meta)
    for spec in family.modules:
        mdir = ckpt / spec.name
        meta = dcp_reader(mdir).read_metadata()
        for key, m in meta.state_dict_metadata.items():
            if key.startswith("model.") and hasattr(m, "size"):
                full = f"{spec.weight_prefix}.{key[len('model.'):]}"
                if full not in tied:
                    items.append((spec.name, key, full, m))
    items, lora = _lora_items(record, family, model_cfg, items)  # adapters out of the list, folded into bases
    shards: list[list[tuple[str, str, str, Any]]] = [[]]
    size = 0
    for item in items:
        m = item[3]
        nbytes = m.size.numel() * (dtype or m.properties.dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    weight_map, total = {}, 0
    out_dtype = dtype
    for i, shard in enumerate(shards, 1):
        tensors = _merged(ckpt, shard, _read(ckpt, shard), lora)
        named = {}
        for (_, _, full, _), t in zip(shard, tensors, strict=True):
            t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            out_dtype = out_dtype or t.dtype
            named.update({k: v.contiguous() for k, v in weights.to_hf(full, t, model_cfg).items()})
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(named, str(out / name), metadata={"format": "pt"})
        _upload(out / name, upload_to)
        weight_map.update(dict.fromkeys(named, name))
        total += sum(t.numel() * t.element_size() for t in named.values())
        del tensors, named
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = weights.hf_config(model_cfg, out_dtype or torch.float32)
    ids = token_ids(source_dir, tokenizer_dir)
    config.update(ids)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].update(ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    carry_files(out, tokenizer_dir, source_dir, ids)
    (out / "dhp_export.json").write_text(json.dumps({"checkpoint": str(ckpt), "step": record["step"]}) + "\n")
    if upload_to is None:
        return out
    for f in sorted(p for p in out.iterdir() if p.is_file()):
        _upload(f, upload_to)
    return upload_to


Item = tuple  # (module dir, our key in the module ("model.<name>"), our whole-model key, DCP metadata)


def _lora_items(record: dict[str, Any], family: Any, model_cfg: Any,
                items: list[Item]) -> tuple[list[Item], dict[str, tuple[Any, Item, Item]]]:
    """The checkpoint's tensors less its LoRA adapters, and per LoRA base (whole-model ``<linear>.weight``):
    (scale, target, r) with its ``lora_A`` and ``lora_B`` items (``dhp.parallel.lora``; the run's ``<module>.lora``
    says which parts are active)."""
    from dhp.config import config_from_dict
    from dhp.parallel.lora import export_targets, is_adapter

    adapters = {full: item for item in items if is_adapter(full := item[2])}
    if not adapters:
        return items, {}
    cfg = config_from_dict(record["config"])
    shapes = {item[2]: tuple(item[3].size) for item in items}
    lora: dict[str, tuple[Any, Item, Item]] = {}
    for spec in family.modules:
        prefix = spec.weight_prefix + "."
        mine = {k[len(prefix):]: shapes[k] for k in adapters if k.startswith(prefix)}
        rows = {k.removesuffix(".lora_A.weight"): shapes[f"{prefix}{k.removesuffix('.lora_A.weight')}.weight"][0]
                for k in mine if k.endswith(".lora_A.weight")}
        targets = export_targets(mine, rows, spec.weight_prefix, family.weights, model_cfg, cfg.module(spec.name).lora)
        for linear, how in targets.items():
            lora[f"{linear}.weight"] = (how, adapters[f"{linear}.lora_A.weight"], adapters[f"{linear}.lora_B.weight"])
    return [item for item in items if item[2] not in adapters], lora


def _merged(ckpt: AnyPath, shard: list[Item], tensors: list[torch.Tensor],
            lora: dict[str, tuple[Any, Item, Item]]) -> list[torch.Tensor]:
    """The shard's tensors with each LoRA base's adapters folded in (``W + scale * B_i @ A_i`` per part)."""
    from dhp.parallel.lora import fold

    bases = [k for k, item in enumerate(shard) if item[2] in lora]
    if not bases:
        return tensors
    pairs = _read(ckpt, [x for k in bases for x in lora[shard[k][2]][1:]])
    out = list(tensors)
    for j, k in enumerate(bases):
        (scale, target, r), _, _ = lora[shard[k][2]]
        out[k] = fold(tensors[k], pairs[2 * j], pairs[2 * j + 1], scale, target, r)
    return out


def export_adapter(ckpt: str | AnyPath, out: str | Path) -> Path:
    """``dhp export --adapter``: the checkpoint's LoRA adapters as a PEFT adapter directory
    (``adapter_config.json``, ``adapter_model.safetensors`` under the transformers model's module paths), which
    ``peft.PeftModel.from_pretrained`` loads onto the model the run started from (``base_model_name_or_path``:
    its ``model.hf_path``)."""
    from safetensors.torch import save_file

    from dhp.config import config_from_dict
    from dhp.inputs import resolve_inputs
    from dhp.parallel.lora import memory_names, part_keys, peft_config, peft_tensors

    ckpt, out = location(ckpt), Path(out)
    record = read_record(ckpt)
    cfg = config_from_dict(record["config"])
    inputs = resolve_inputs(cfg)
    family, model_cfg = inputs.family, inputs.model_cfg
    items = []
    for spec in family.modules:
        meta = dcp_reader(ckpt / spec.name).read_metadata()
        items += [(spec.name, key, f"{spec.weight_prefix}.{key[len('model.'):]}", m)
                  for key, m in meta.state_dict_metadata.items() if key.startswith("model.") and hasattr(m, "size")]
    _, lora = _lora_items(record, family, model_cfg, items)
    if not lora:
        raise CheckpointError(f"{ckpt}: no LoRA adapters (the run set no <module>.lora.r); export the model with "
                              "`dhp export` without --adapter")
    pairs = _read(ckpt, [x for how in lora.values() for x in how[1:]])
    state, targets, ranks = {}, {}, {}
    name_of = memory_names(family.weights)
    trained, saved = _trained_whole(cfg, family, items)
    for j, (base, (how, a_item, _)) in enumerate(lora.items()):
        linear = base.removesuffix(".weight")
        state[f"{linear}.lora_A.weight"], state[f"{linear}.lora_B.weight"] = pairs[2 * j], pairs[2 * j + 1]
        targets[linear] = how
        alpha = cfg.module(a_item[0]).lora.alpha
        for part, on in zip(part_keys(linear, how[1]), how[1].active, strict=True):
            if on:
                ranks[name_of(part)] = (how[2], alpha)
    tensors = peft_tensors(state, targets, name_of)
    for item, t in zip(saved, _read(ckpt, saved), strict=True):  # what trains whole: PEFT's modules_to_save
        parts = family.weights.to_hf(item[2], t, model_cfg)
        module, leaf = item[2].rsplit(".", 1)
        for hf_name, part in parts.items():  # a fused tensor's parts: our module's sibling of the part's name
            ours = module if len(parts) == 1 else f"{module.rsplit('.', 1)[0]}.{hf_name.rsplit('.', 2)[-2]}"
            tensors[f"base_model.model.{name_of(ours)}.{leaf}"] = part.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    dropout = max(cfg.module(s.name).lora.dropout for s in family.modules)
    config = peft_config(ranks, dropout, cfg.model.hf_path or "")
    config["modules_to_save"] = [name_of(p) for p in trained] or None
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _trained_whole(cfg: Any, family: Any, items: list[Item]) -> tuple[list[str], list[Item]]:
    """What a LoRA run trained whole beside its adapters (PEFT's ``modules_to_save``): the module paths (a
    module without LoRA that trains; the projector of a LoRA module under ``merger.trainable``) and their
    tensors' items."""
    from dhp.parallel.lora import is_adapter

    paths = []
    for spec in family.modules:
        m = cfg.module(spec.name)
        if m.trainable and not m.lora.enabled:
            paths.append(spec.weight_prefix)
        elif cfg.merger.trainable:
            paths += [f"{spec.weight_prefix}.{p.rstrip('.')}" for p in spec.projector_prefixes]
    chosen = [item for item in items if not is_adapter(item[2]) and any(item[2].startswith(p + ".") for p in paths)]
    return paths, chosen


def token_ids(source: Path | None, tokenizer_dir: Path | None) -> dict[str, Any]:
    """bos/eos/pad ids for config.json: the source checkpoint's own (top level or text_config), else Qwen's
    choice from the tokenizer (bos = pad = ``<|endoftext|>``, eos = ``<|im_end|>``, as Qwen2.5-VL-Instruct)."""
    found: dict[str, Any] = {}
    if source is not None and (source / "config.json").is_file():
        d = json.loads((source / "config.json").read_text())
        for key in TOKEN_ID_KEYS:
            for where in (d, d.get("text_config") or {}, (d.get("thinker_config") or {}).get("text_config") or {}):
                if where.get(key) is not None:
                    found.setdefault(key, where[key])
    if len(found) == len(TOKEN_ID_KEYS) or tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return found
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    for key, value in (("bos_token_id", end), ("eos_token_id", im_end), ("pad_token_id", end)):
        if value is not None:
            found.setdefault(key, value)
    return found


def carry_files(out: Path, tokenizer_dir: Path | None, source: Path | None, ids: dict[str, Any]) -> list[str]:
    """Copy the tokenizer's files and the source checkpoint's processor, chat template and generation config into
    ``out``; without a source generation config, write one from ``ids`` (eos: ``<|im_end|>`` and
    ``<|endoftext|>``, as Qwen's). Returns the names written."""
    written = []
    if out.resolve() not in {Path(f).resolve() for f in (source, tokenizer_dir) if f is not None}:
        for name in {*SOURCE_FILES, *TOKENIZER_FILES}:  # an earlier export's into the same directory
            (out / name).unlink(missing_ok=True)
    for folder, names in ((source, SOURCE_FILES), (tokenizer_dir, TOKENIZER_FILES)):  # the tokenizer's win
        if folder is None:
            continue
        for name in names:
            f = Path(folder) / name
            if f.is_file() and f.resolve() != (out / name).resolve():
                shutil.copy(f, out / name)
                written.append(name)
    if not (out / "generation_config.json").is_file() and ids:
        eos = ids.get("eos_token_id")
        if isinstance(eos, int) and ids.get("bos_token_id") not in (None, eos):
            eos = [eos, ids["bos_token_id"]]
        gen = {k: v for k, v in {"bos_token_id": ids.get("bos_token_id"), "eos_token_id": eos,
                                 "pad_token_id": ids.get("pad_token_id")}.items() if v is not None}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        written.append("generation_config.json")
    return sorted(set(written))


def _read(ckpt: AnyPath, items: list[tuple[str, str, str, Any]]) -> list[torch.Tensor]:
    """The full tensors of ``items`` from their module directories (one DCP read per module)."""
    import torch.distributed.checkpoint as dcp

    from dhp.engine_checkpoint import quiet_single_process

    result: dict[int, torch.Tensor] = {}
    by_module: dict[str, list[int]] = {}
    for k, item in enumerate(items):
        by_module.setdefault(item[0], []).append(k)
    for module, ks in by_module.items():
        template = {"model": {items[k][1][len("model."):]: torch.empty(items[k][3].size,
                                                                        dtype=items[k][3].properties.dtype)
                              for k in ks}}
        try:
            with quiet_single_process():
                dcp.load(template, checkpoint_id=str(ckpt / module), no_dist=True,
                         **({"storage_reader": dcp_reader(ckpt / module)} if is_url(ckpt) else {}))
        except Exception as e:  # noqa: BLE001 - DCP raises many types for a bad file
            raise CheckpointError(f"{ckpt / module}: cannot read ({type(e).__name__}: {e})") from None
        for k in ks:
            result[k] = template["model"][items[k][1][len("model."):]]
    return [result[k] for k in range(len(items))]


def export_checkpoint(ckpt: str | AnyPath, out: str | AnyPath, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = 2 * 2**30) -> AnyPath:
    """``dhp export``: the checkpoint's own record says which model and tokenizer; see ``export_hf``."""
    from dhp.config import config_from_dict
    from dhp.inputs import resolve_inputs

    record = read_record(ckpt)
    cfg = config_from_dict(record["config"])
    inputs = resolve_inputs(cfg)
    return export_hf(ckpt, out, inputs.family, inputs.model_cfg, inputs.tokenizer_dir, dtype, max_shard_bytes,
                     source_dir=source_dir(cfg))
