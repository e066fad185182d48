"""The path a user takes, run as the README writes it, on a tiny checkpoint that transformers itself makes and saves
(``save_pretrained`` plus a tokenizer, a processor config, a chat template and a generation config, as on the Hub):
the fine-tuning line, the export (``final/`` and ``dhp export``) as a drop-in copy that transformers loads, and
``dhp plan``'s printed overrides run back through ``dhp train``."""

from __future__ import annotations

import json
import logging
import math
import re
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from dhp.cli import main

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[2] / "README.md"
CKPT_IN_README = "/ckpt/Qwen2.5-VL-7B-Instruct"
CARRIED = ("preprocessor_config.json", "chat_template.json", "generation_config.json", "tokenizer_config.json",
           "tokenizer.json")


def readme_commands(prefix: str) -> list[list[str]]:
    """Every command of the README's bash blocks that starts with ``prefix`` (comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(prefix):
                out.append(shlex.split(line))
    return out


@pytest.fixture(scope="session")
def hf_checkpoint(demo_data, tmp_path_factory) -> Path:
    """A Qwen2.5-VL checkpoint directory as the Hub ships one, written by transformers: config.json (with its
    bos/eos/pad ids), model.safetensors, generation_config.json, preprocessor_config.json, chat_template.json and
    the demo's tokenizer (tokenizer.json, tokenizer_config.json)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from dhp.data.demo import QWEN2_5_VL_CHAT_TEMPLATE
    from dhp.data.tokenizer import Tokenizer
    from dhp.models.qwen2_5_vl.processor import vision_token_ids

    tok = Tokenizer(demo_data.tokenizer)
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.im_end_id
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=64 * math.ceil(tok.vocab_size / 64), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
                         bos_token_id=end, eos_token_id=im_end, pad_token_id=end),
        **vision_token_ids(tok))
    out = tmp_path_factory.mktemp("Qwen2.5-VL-tiny-Instruct")
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_data.tokenizer / f, out / f)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_5_VL_CHAT_TEMPLATE}) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": end, "eos_token_id": [im_end, end], "pad_token_id": end, "do_sample": True,
         "temperature": 0.1, "top_k": 1, "repetition_penalty": 1.05}, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
         "min_pixels": 3136, "max_pixels": 12544, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
         "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
         "do_convert_rgb": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711]}, indent=2) + "\n")
    return out


def _load_quietly(load, *args):
    """``load(*args)`` and what transformers said while loading (its log and Python warnings)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obj = load(*args)
    finally:
        root.removeHandler(handler)
    return obj, said + [str(w.message) for w in caught]


def assert_drop_in(export: Path, source: Path, dtype: str) -> None:
    """``export`` carries the source's processor, chat template, generation config and tokenizer, the same
    bos/eos/pad ids in config.json, and loads in transformers with no warning about them."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    for name in CARRIED:
        assert (export / name).read_bytes() == (source / name).read_bytes(), name
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (export, source))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours["text_config"][key] == theirs["text_config"][key], key
        assert ours[key] == theirs["text_config"][key], key
    model, said = _load_quietly(AutoModelForImageTextToText.from_pretrained, str(export))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not [s for s in said if re.search(r"\b(eos|bos|pad)", s)], said
    assert str(next(model.parameters()).dtype) == f"torch.{dtype}"
    assert model.generation_config.eos_token_id == json.loads((source / "generation_config.json").read_text())[
        "eos_token_id"]
    image = AutoImageProcessor.from_pretrained(str(export))
    assert type(image).__name__.startswith("Qwen2VLImageProcessor")
    assert image.to_dict() == AutoImageProcessor.from_pretrained(str(source)).to_dict()
    tok = AutoTokenizer.from_pretrained(str(export))
    assert tok.chat_template == AutoTokenizer.from_pretrained(str(source)).chat_template
    try:  # the export loads as its source does (transformers' Qwen2.5-VL processor needs torchvision for video)
        expected = type(AutoProcessor.from_pretrained(str(source)))
    except (ImportError, AttributeError, ValueError) as e:
        with pytest.raises(type(e)):
            AutoProcessor.from_pretrained(str(export))
    else:
        assert type(AutoProcessor.from_pretrained(str(export))) is expected


def test_readme_fine_tuning_line_then_export_is_a_drop_in_copy(hf_checkpoint, demo_data, tmp_path, capsys):
    (line,) = [c for c in readme_commands("dhp train model.hf_path=")]
    assert line[:3] == ["dhp", "train", f"model.hf_path={CKPT_IN_README}"]
    paths = {CKPT_IN_README: str(hf_checkpoint), "train.jsonl": str(demo_data.train), "images/": str(demo_data.root)}
    argv = [re.sub(r"=(.*)$", lambda m: "=" + paths.get(m.group(1), m.group(1)), a) for a in line[1:]]
    assert not any("data.tokenizer" in a for a in argv)  # the checkpoint's own tokenizer, as the README says
    out = tmp_path / "run"
    rc = main([*argv, f"output.dir={out}", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
               "train.warmup_steps=1", "data.max_pixels=12544", "runtime.backend=local"])
    assert rc == 0, capsys.readouterr().err
    assert "on cpu (one process)" in capsys.readouterr().out  # the start line names each group's device
    assert_drop_in(out / "final", hf_checkpoint, "float32")
    exports = [c for c in readme_commands("dhp export") if "--adapter" not in c]
    by_checkpoint = [c for c in exports if c[2].startswith("outputs/run/checkpoints/")]
    by_run = [c for c in exports if c[2] == "outputs/run"]  # a run's directory: its newest complete checkpoint
    assert len(by_checkpoint) == 1 and len(by_run) == 1 and len(exports) == 2, exports
    ckpt = out / "checkpoints" / "step_000002"
    for export, dtype in ((by_checkpoint[0], "bfloat16"), (by_run[0], "float32")):
        argv = [str(ckpt) if a.startswith("outputs/run/checkpoints/") else str(out) if a == "outputs/run"
                else str(tmp_path / f"{a}_{dtype}") if a == "hf_out" else a for a in export[1:]]
        assert main(argv) == 0
        assert_drop_in(tmp_path / f"hf_out_{dtype}", hf_checkpoint, dtype)


def test_export_of_a_preset_run_writes_qwen_ids_from_its_tokenizer(demo_overrides, demo_data, tmp_path):
    """No source checkpoint: config.json and generation_config.json take Qwen's ids from the tokenizer."""
    from dhp.data.tokenizer import Tokenizer

    assert main(["train", *demo_overrides, "train.steps=1", "train.eval_at_end=false"]) == 0
    final = tmp_path / "run" / "final"
    tok = Tokenizer(demo_data.tokenizer)
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.im_end_id
    config = json.loads((final / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (end, im_end, end)
    assert config["text_config"]["eos_token_id"] == im_end
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [im_end, end]
    assert (final / "tokenizer_config.json").is_file()


def test_plan_overrides_run_as_printed(demo_data, tmp_path, capsys):
    """The line `dhp plan` prints for a layout (``train_command``) trains as printed, on the Ray backend, the
    run's own data and output added: the Ray backend, the model and every layout key are in it."""
    from dhp.models.qwen2_5_vl.config import preset
    from dhp.plan.command import train_command
    from dhp.plan.planner import candidate_rows

    (row,) = [r for r in candidate_rows(preset("tiny"), 2, [256], 64, 1, ("dhp-collocated",)) if not r.ac
              and r.jobs["vision"].inner == 1]
    line = shlex.split(train_command("tiny", row))
    assert line[:4] == ["dhp", "train", "runtime.backend=ray", "model.preset=tiny"]
    assert "text.parallel.tp=2" in line and "vision.parallel.dp=2" in line
    rc = main([*line[1:], f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}",
               "data.max_pixels=12544", "train.steps=1", "train.global_batch_size=4", "train.micro_batch_size=2",
               "train.eval_at_end=false", "output.save_final=false", "runtime.cpus_per_worker=0.5",
               f"output.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "vision dp2 zero1 on cpu (gloo, 0.5 CPU per worker), text tp2 on cpu (gloo" in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
