"""User mistakes at the command line: one `dhp: ...` line naming the key or file and the fix, an exit code per
class of mistake, no traceback (unless --debug)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dhp import cli
from dhp.cli import main
from dhp.errors import EXIT_CONFIG, EXIT_DATA, EXIT_INTERRUPTED, EXIT_MODEL, EXIT_WORKER


@pytest.fixture
def base(demo_data, tmp_path):
    """A valid run on the small demo set, for mistakes to be added to."""
    return [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "runtime.backend=local",
            "train.steps=1", "train.global_batch_size=4", "train.micro_batch_size=4", f"output.dir={tmp_path / 'run'}"]


def _without(overrides, key):
    return [o for o in overrides if not o.startswith(key + "=")]


def _rows(demo_data, tmp_path, base):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"conversations": []}) + "\n" + json.dumps({"image": "x.png"}) + "\n{oops\n")
    not_a_ckpt = tmp_path / "not_a_ckpt"
    not_a_ckpt.mkdir()
    (not_a_ckpt / "weights.bin").write_bytes(b"")
    other_root = tmp_path / "other_root"
    other_root.mkdir()
    demo_out = tmp_path / "demo_out"
    demo_out.mkdir()
    (demo_out / "mine.txt").write_text("keep me")
    no_data = _without(base, "data.path")
    # (name, argv, fragment of the first stderr line, exit code)
    return [
        ("missing data file", ["train", *no_data, f"data.path={tmp_path / 'missing.jsonl'}"],
         "data.path: ", EXIT_DATA),
        ("image_root that does not exist", ["train", *base, f"data.image_root={tmp_path / 'nowhere'}"],
         "data.image_root: ", EXIT_DATA),
        ("image_root that is the wrong folder", ["train", *base, f"data.image_root={other_root}"],
         "not found under data.image_root=", EXIT_DATA),
        ("empty JSONL", ["train", *no_data, f"data.path={empty}"], "holds no samples", EXIT_DATA),
        ("data.max_length too small", ["train", *base, "data.max_length=8"],
         "data.max_length=8: ", EXIT_DATA),
        ("unknown model.preset", ["train", *base, "model.preset=huge"],
         "model.preset: unknown preset 'huge'", EXIT_CONFIG),
        ("model.hf_path without config.json", ["train", *base, f"model.hf_path={not_a_ckpt}"],
         "has no config.json", EXIT_MODEL),
        ("model.hf_path that does not exist", ["train", *base, f"model.hf_path={tmp_path / 'no_ckpt'}"],
         "model.hf_path: ", EXIT_MODEL),
        ("data.tokenizer without tokenizer.json", ["train", *_without(base, "data.tokenizer"),
                                                    f"data.tokenizer={tmp_path}"], "data.tokenizer: ", EXIT_MODEL),
        ("dhp info with a path that does not exist", ["info", str(tmp_path / "no_model")],
         "no such preset", EXIT_MODEL),
        ("on_error=skip leaving no sample", ["train", *no_data, f"data.path={broken}", "data.on_error=skip"],
         "no usable samples", EXIT_DATA),
        ("a bad value", ["train", *base, "train.lr=fast"], "train.lr: expected a number", EXIT_CONFIG),
        ("a config file that does not exist", ["train", str(tmp_path / "my.yaml")], "does not exist", EXIT_CONFIG),
        ("data demo into a non-empty folder", ["data", "demo", str(demo_out)], "is not empty", EXIT_CONFIG),
        ("data check of a broken file", ["data", "check", *no_data, f"data.path={broken}"], "problem(s) in 3",
         EXIT_DATA),
        ("a bench layout the model cannot take", ["bench", *base, "--steps", "1", "--no-profile", "--layouts",
                                                  "ok=vision.parallel.dp=1,big=text.parallel.tp=4"],
         "config error: --layouts big: text.parallel.tp=4 must divide the key/value heads", EXIT_CONFIG),
        ("bench into an output.dir that cannot be written", ["bench", *_without(base, "output.dir"), "--no-profile",
                                                              "output.dir=/proc/no/bench"],
         "config error: output.dir=/proc/no/bench: cannot write in /proc", EXIT_CONFIG),
        ("data demo into a folder that cannot be written", ["data", "demo", "/proc/no/demo"],
         "config error: OUT /proc/no/demo: cannot write in /proc", EXIT_CONFIG),
        ("report into a folder that cannot be written", ["report", str(demo_data.root), "--out", "/proc/no/plots"],
         "config error: --out /proc/no/plots: cannot write in /proc", EXIT_CONFIG),
        ("varlen attention on the CPU", ["train", *base, "train.attention=varlen"],
         "config error: train.attention=varlen: its kernels run on CUDA in bfloat16/float16, this attention runs "
         "on cpu in float32", EXIT_CONFIG),
    ]


ROWS = ["missing data file", "image_root that does not exist", "image_root that is the wrong folder", "empty JSONL",
        "data.max_length too small", "unknown model.preset", "model.hf_path without config.json",
        "model.hf_path that does not exist", "data.tokenizer without tokenizer.json",
        "dhp info with a path that does not exist", "on_error=skip leaving no sample", "a bad value",
        "a config file that does not exist", "data demo into a non-empty folder", "data check of a broken file",
        "a bench layout the model cannot take", "bench into an output.dir that cannot be written",
        "data demo into a folder that cannot be written", "report into a folder that cannot be written",
        "varlen attention on the CPU"]


@pytest.mark.parametrize("name", ROWS)
def test_user_mistake_is_one_line(name, demo_data, tmp_path, base, capsys, monkeypatch):
    monkeypatch.delenv("DHP_DEBUG", raising=False)
    rows = {r[0]: r[1:] for r in _rows(demo_data, tmp_path, base)}
    assert set(rows) == set(ROWS)
    argv, fragment, code = rows[name]
    assert main(argv) == code
    out, err = capsys.readouterr()
    first = err.splitlines()[0]
    assert first.startswith("dhp: ") and fragment in first, err
    assert "Traceback" not in out + err
    assert all(line.startswith("  ") for line in err.splitlines()[1:]), err  # details indented under it
    if name == "on_error=skip leaving no sample":  # the first problems are listed
        assert "sample 0: empty conversation" in err and "not valid JSON" in err
        assert "(samples are numbered from 0, in file order)" in first  # the numbering is stated
    if name == "data demo into a non-empty folder":
        assert (tmp_path / "demo_out" / "mine.txt").read_text() == "keep me"
        assert not (tmp_path / "demo_out" / "train.jsonl").exists()
    if name != "data check of a broken file":
        assert not (tmp_path / "run").exists() or name in ("empty JSONL", "data.max_length too small",
                                                            "image_root that is the wrong folder",
                                                            "on_error=skip leaving no sample")


def test_debug_shows_the_traceback(base, tmp_path, capsys, monkeypatch):
    argv = ["train", *base, "model.preset=huge"]
    monkeypatch.delenv("DHP_DEBUG", raising=False)
    assert main([*argv, "--debug"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("dhp: config error: model.preset")
    monkeypatch.setenv("DHP_DEBUG", "1")
    assert main(argv) == EXIT_CONFIG
    assert "Traceback" in capsys.readouterr().err


WORKER_TRACEBACK = """\x1b[36mray::VisionWorker.forward()\x1b[39m (pid=4242, ip=127.0.0.1)
  File "/work/dhp/engine.py", line 10, in forward
    sample = self.dataset.get(i)
  File "/work/dhp/data/llava.py", line 150, in get
    raise DataError(...)
dhp.errors.DataError: /data/train.jsonl sample 7: image /data/images/7.png cannot be processed (truncated)
"""


def test_worker_failure_is_one_paragraph(monkeypatch, capsys):
    from dhp.runtime.errors import WorkerError

    def failing(args):
        err = WorkerError("vision", 1, "forward", WORKER_TRACEBACK)
        err.step = 12
        raise err

    monkeypatch.delenv("DHP_DEBUG", raising=False)
    monkeypatch.setattr(cli, "cmd_train", failing)
    assert main(["train"]) == EXIT_WORKER
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == "dhp: worker failure: vision rank 1 failed in forward() at step 12:"
    assert lines[1].strip() == ("dhp.errors.DataError: /data/train.jsonl sample 7: image /data/images/7.png cannot "
                                "be processed (truncated)")
    assert "Traceback" not in err and "File \"" not in err and len(lines) <= 4


def test_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_train", interrupted)
    assert main(["train"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "dhp: interrupted"


def test_a_bug_is_one_line_too(monkeypatch, capsys):
    def buggy(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.delenv("DHP_DEBUG", raising=False)
    monkeypatch.setattr(cli, "cmd_train", buggy)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dhp: unexpected error: ZeroDivisionError: division by zero") and "--debug" in err
    assert "Traceback" not in err


def test_a_real_process_prints_one_line_and_documents_the_codes(tmp_path):
    """The installed entry point, in its own process: no traceback reaches the terminal; --help lists the codes."""
    env = {k: v for k, v in os.environ.items() if k != "DHP_DEBUG"}
    run = subprocess.run([sys.executable, "-m", "dhp.cli", "info", str(tmp_path / "nothing")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == EXIT_MODEL
    assert run.stdout == "" and run.stderr.count("\n") == 1 and run.stderr.startswith("dhp: model error: ")
    run = subprocess.run([sys.executable, "-m", "dhp.cli", "train", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    for code in ("2 config error", "3 data error", "4 model or checkpoint error", "5 a worker failed",
                 "130 interrupted"):
        assert code in text, text
    assert "with no argument at all, the embedded demo" in text


def test_data_demo_prints_readable_paths(tmp_path, capsys, monkeypatch):
    from dhp.data import demo

    made = demo.make_demo_dataset

    def small(out_dir, seed=0):
        return made(out_dir, seed=seed, n_train=6, n_eval=2)

    monkeypatch.setattr(demo, "make_demo_dataset", small)
    out = tmp_path / "d"
    assert main(["data", "demo", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "DemoPaths" not in printed and f"train      {out / 'train.jsonl'}  (6 samples)" in printed
    assert f"data.tokenizer={out / 'tokenizer'}" in printed
    assert main(["data", "demo", str(out)]) == EXIT_CONFIG  # not empty now
    capsys.readouterr()
    assert main(["data", "demo", str(out), "--overwrite"]) == 0


def test_info_tiny_prints_readable_nonzero_counts(capsys):
    assert main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:]]
    for row in rows:
        value, unit = next((row[k], row[k + 1]) for k in range(len(row) - 1) if row[k + 1] in ("K", "M", "B"))
        assert float(value) > 0, out
    assert "0.000" not in out


def test_ray_startup_messages_only_with_debug(monkeypatch, capsys):
    """Ray's token-authentication notice and "Started a local Ray instance" come from these loggers (ray 2.60)."""
    import logging

    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    monkeypatch.delenv("DHP_DEBUG", raising=False)
    assert main(["info", "tiny"]) == 0
    assert notice.getEffectiveLevel() == logging.ERROR
    assert logging.getLogger("ray._private.worker").getEffectiveLevel() == logging.WARNING
    assert main(["info", "tiny", "--debug"]) == 0
    assert notice.level == logging.NOTSET
    capsys.readouterr()
