"""Experiment trackers (--report-to): each holds exactly the scalars of metrics.jsonl, per step, and
the config; resume, other ranks and bad input. Every tracker writes offline here: TensorBoard to the
run directory, wandb in offline mode, trackio to a local store. A tracker whose package is not
installed is skipped, not failed."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import read_metrics, run_options, train_killed_at
from typer.testing import CliRunner

from opd.cli import app
from opd.config import ConfigError, SFTConfig, TrainConfig, build_config
from opd.errors import UserError
from opd.runs.rundir import RunDir

NAN = float("nan")


# ----------------------------------------------------------------------------- helpers


def expected_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from metrics.jsonl, written independently of opd.runs.tracking.scalars:
    numbers and booleans as they are, lists one tag per entry, anything else left out."""
    out: dict[str, dict[int, float]] = {}
    for r in read_metrics(run_dir):
        for key, value in r.items():
            if key == "step" or isinstance(value, str) or value is None:
                continue
            pairs = [(f"{key}/{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
            for tag, v in pairs:
                assert r["step"] not in out.setdefault(tag, {}), f"{tag} logged twice at step {r['step']}"
                out[tag][r["step"]] = float(v)
    return out


def same(a: float, b: float, f32: bool = False) -> bool:
    if f32:
        b = float(np.float32(b))
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_same_scalars(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], f32: bool = False) -> None:
    assert sorted(got) == sorted(want)
    for tag in want:
        assert sorted(got[tag]) == sorted(want[tag]), tag
        for step, value in want[tag].items():
            assert same(got[tag][step], value, f32), (tag, step, got[tag][step], value)


def record(step: int, scale: float = 1.0) -> dict:
    """A training record shaped like opd train's: floats, a bool, an int, per-bucket lists (an empty
    bucket is NaN), and a text value that no tracker gets."""
    return {
        "step": step,
        "train/loss": scale / (step + 1),
        "train/clipped": step % 2 == 0,
        "train/loss_tokens": 100 + step,
        "diag/overlap": 0.25 * scale,
        "depth/reward": [0.1 * step * scale, NAN, -0.5],
        "depth/loss": [1.0, 2.0, scale],
        "note": "text",
    }


def tensorboard_scalars(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    return got, acc


def tiny_train_cfg(models, out, **kw) -> TrainConfig:
    student, teacher = models
    small = dict(
        device="cpu",
        steps=4,
        batch_size=4,
        max_new_tokens=8,
        eval_size=4,
        eval_samples=0,
        k=8,
        warmup_steps=1,
        log_rollouts=2,
        diag_positions=16,
        eval_every=0,
        ckpt_every=2,
    )
    return TrainConfig.from_flat(student=str(student), teacher=str(teacher), out=str(out), **{**small, **kw})


# ----------------------------------------------------------------------------- config and CLI


def test_report_to_is_parsed_like_other_lists():
    assert TrainConfig.from_flat().run.report_to == ["none"] and SFTConfig.from_flat(
        arch="qwen2:1:8"
    ).run.report_to == ["none"]
    assert build_config(TrainConfig, {}, {"report_to": ["tensorboard,wandb"]}).run.report_to == ["tensorboard", "wandb"]
    repeated = build_config(TrainConfig, {}, {"report_to": ["TensorBoard", "wandb", "tensorboard"]})
    assert repeated.run.report_to == ["tensorboard", "wandb"]
    assert build_config(SFTConfig, {"report_to": "trackio", "arch": "qwen2:1:8"}).run.report_to == [
        "trackio"
    ]  # YAML scalar


@pytest.mark.parametrize(
    "value, match",
    [
        (
            ["tensorbord"],
            r"report_to=tensorbord: unknown tracker; choose from none, tensorboard, wandb, trackio, mlflow",
        ),
        (["none,wandb"], r"none turns tracking off, so it cannot be combined"),
        (["none", "tensorboard"], r"none turns tracking off"),
        ([], r"report_to is empty"),
    ],
)
def test_bad_report_to_is_a_clear_error(value, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_flat(report_to=value)
    with pytest.raises(ConfigError, match=match):
        SFTConfig.from_flat(arch="qwen2:1:8", report_to=value)


def test_cli_takes_repeated_and_comma_separated_report_to(monkeypatch, tmp_path):
    import opd.training.loop as train_mod

    seen = []
    monkeypatch.setattr(train_mod, "train", lambda cfg: seen.append(cfg.run.report_to))
    for args in (["--report-to", "tensorboard", "--report-to", "wandb"], ["--report-to", "tensorboard,wandb"]):
        result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), *args])
        assert result.exit_code == 0, result.output + repr(result.exception)
    assert seen == [["tensorboard", "wandb"]] * 2
    result = CliRunner().invoke(app, ["train", "--report-to", "comet"])
    assert isinstance(result.exception, ConfigError) and "choose from none, tensorboard, wandb, trackio, mlflow" in str(
        result.exception
    )


@pytest.mark.parametrize("enabled", [True, False], ids=["rank0", "rank1"])
def test_missing_tracker_package_names_the_pip_command(monkeypatch, tmp_path, enabled):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of wandb now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(UserError, match=r"^--report-to wandb,trackio needs these packages: pip install wandb trackio$"):
        RunDir(tmp_path / "run", enabled=enabled, report_to=["tensorboard", "wandb", "trackio"])
    with pytest.raises(UserError, match=r"^--report-to wandb needs its package: pip install wandb$"):
        RunDir(tmp_path / "run", enabled=enabled, report_to=["wandb"])
    assert not (tmp_path / "run").exists()  # nothing started


def test_report_to_none_starts_nothing(tmp_path):
    assert RunDir(tmp_path / "other", enabled=True, report_to="tensorboard").tracking.names == [
        "tensorboard"
    ]  # a string
    run = RunDir(tmp_path / "run", enabled=True, report_to=["none"])
    run.write_config(TrainConfig.from_flat())
    run.log_metrics(record(0))
    run.close()
    assert run.tracking is None
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "metrics.jsonl"]


def test_other_ranks_create_no_tracker_files(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    names = ["tensorboard", *[n for n in ("wandb", "trackio") if _importable(n)]]
    monkeypatch.setenv("RANK", "1")
    with RunDir(tmp_path / "run", report_to=names) as run:
        run.write_config(TrainConfig.from_flat(report_to=names))
        run.log_metrics(record(0))
    assert run.tracking is None
    assert not (tmp_path / "run").exists()


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------- TensorBoard


def test_tensorboard_holds_the_scalars_of_metrics_jsonl_and_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import plugin_data_pb2

    out = tmp_path / "run"
    cfg = TrainConfig.from_flat(out=str(out), report_to=["tensorboard"], lr=3e-3, lora_targets=["q_proj", "v_proj"])
    with RunDir(out, enabled=True, report_to=cfg.run.report_to) as run:
        run.write_config(cfg)
        for step in range(5):
            run.log_metrics(record(step))
        run.log_metrics({"step": 4, "eval/accuracy": 0.75, "eval/pass@2": 1.0})
    got, acc = tensorboard_scalars(out)
    want = expected_scalars(out)
    assert "depth/reward/1" in want and "train/clipped" in want and "note" not in want
    assert_same_scalars(got, want, f32=True)  # TensorBoard keeps float32

    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(textwrap.dedent(text)) == run_options(out)
    hp = plugin_data_pb2.HParamsPluginData()
    hp.ParseFromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = hp.session_start_info.hparams
    assert hparams["lr"].number_value == 3e-3 and hparams["objective"].string_value == "lsm"
    assert hparams["lora_targets"].string_value == "q_proj,v_proj" and hparams["renormalize"].number_value == 1.0


@pytest.mark.parametrize("tracked_before", [True, False], ids=["tracked-before", "added-on-resume"])
def test_tensorboard_after_resume_shows_what_metrics_jsonl_holds(tmp_path, tracked_before):
    """A killed run logged steps 0-5, its checkpoint is at step 3: the resumed run logs 4-7 again
    with other values. TensorBoard must show metrics.jsonl (the new 4 and 5, not both)."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    first = RunDir(out, enabled=True, report_to=["tensorboard"] if tracked_before else [])
    first.write_config(TrainConfig.from_flat(out=str(out)))
    for step in range(6):
        first.log_metrics(record(step))
    # killed: never closed
    with RunDir(out, enabled=True, report_to=["tensorboard"]) as resumed:
        resumed.truncate_logs_after(3)
        resumed.write_config(TrainConfig.from_flat(out=str(out), resume=True))
        for step in range(4, 8):
            resumed.log_metrics(record(step, scale=2.0))
    assert [r["step"] for r in read_metrics(out)] == list(range(8))
    got, _ = tensorboard_scalars(out)
    assert_same_scalars(got, expected_scalars(out), f32=True)


def test_opd_train_killed_and_resumed_with_tensorboard(tiny_models, tmp_path, monkeypatch):
    """The real training loop (RunDir given report_to as train.py passes it), killed at step 3 and
    resumed from the step-1 checkpoint: the events hold exactly metrics.jsonl's scalars."""
    pytest.importorskip("tensorboard")
    import opd.training.loop as train_mod
    import opd.training.setup as setup_mod

    monkeypatch.setattr(setup_mod, "RunDir", lambda path, **kw: RunDir(path, **{"report_to": ["tensorboard"], **kw}))
    cfg = tiny_train_cfg(tiny_models, tmp_path / "run", report_to=["tensorboard"])
    train_killed_at(cfg, 3, monkeypatch)
    train_mod.train(cfg.replace(resume=True), show_progress=False)

    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 3]  # the last is the final evaluation
    got, _ = tensorboard_scalars(tmp_path / "run")
    want = expected_scalars(tmp_path / "run")
    assert {"train/loss", "rollout/accuracy", "diag/overlap", "depth/reward/7", "eval/accuracy"} <= set(want)
    assert_same_scalars(got, want, f32=True)


# ----------------------------------------------------------------------------- wandb (offline), trackio

# One attempt of a run in its own process (wandb and trackio keep process-wide state and exit hooks).
ATTEMPT = """
import json, sys
from pathlib import Path
from opd.config import TrainConfig
from opd.runs.rundir import RunDir
a = json.loads(sys.argv[1])
run = RunDir(a["out"], enabled=True, report_to=a["report_to"])
if a["resume_after"] is not None:
    run.truncate_logs_after(a["resume_after"])
run.write_config(TrainConfig.from_flat(out=a["out"], lr=2e-3, report_to=a["report_to"]))
for r in a["records"]:
    run.log_metrics(r)
run.close()
if a["report_to"] == ["trackio"]:
    from trackio.sqlite_storage import SQLiteStorage
    name = json.loads((Path(a["out"]) / "tracking.json").read_text())["trackio_run"]
    with open(Path(a["out"]).parent / "readback.json", "w") as f:
        json.dump({"logs": SQLiteStorage.get_logs("opd", name), "config": SQLiteStorage.get_run_config("opd", name)}, f)
"""


def attempt(out: Path, report_to: list[str], records: list[dict], env: dict, resume_after: int | None = None) -> str:
    args = json.dumps({"out": str(out), "report_to": report_to, "records": records, "resume_after": resume_after})
    proc = subprocess.run(
        [sys.executable, "-c", ATTEMPT, args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stderr


def wandb_records(path: Path):
    """The records of a wandb transaction log (run-ID.wandb): W&B's header, then LevelDB's log format
    (32 KiB blocks; each chunk: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            yield rec


def wandb_history(path: Path) -> tuple[dict, dict[str, dict[int, float]]]:
    config, got = {}, {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config = {u.key: json.loads(u.value_json) for u in rec.run.config.update if not u.key.startswith("_")}
            assert rec.run.project == "opd" and rec.run.display_name == "run"
        elif kind == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    got.setdefault(key, {})[rec.history.step.num] = float(json.loads(item.value_json))
    return config, got


def test_wandb_offline_holds_metrics_jsonl_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        NETRC=str(tmp_path / "no-netrc"),
        HOME=str(tmp_path / "home"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
    )
    stderr = attempt(out, ["wandb"], [record(step) for step in range(6)], env)
    assert "no API key found, logging offline" in stderr
    first_log = {tag: dict(v) for tag, v in expected_scalars(out).items()}
    run_id = json.loads((out / "tracking.json").read_text())["wandb_id"]
    # resumed from a step-3 checkpoint: 4 and 5 are logged again (with other values); wandb had them already
    attempt(out, ["wandb"], [record(step, 2.0) for step in range(4, 8)], env, resume_after=3)
    assert json.loads((out / "tracking.json").read_text())["wandb_id"] == run_id

    logs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(logs) == 2  # one offline log per attempt, both of the same run id (wandb sync joins them)
    (config1, got1), (config2, got2) = map(wandb_history, logs)
    want = expected_scalars(out)
    assert config1 == config2 == run_options(out)
    assert_same_scalars(
        {t: {s: v for s, v in d.items() if s <= 3} for t, d in got1.items()},
        {t: {s: v for s, v in d.items() if s <= 3} for t, d in want.items()},
    )
    assert_same_scalars(
        {t: {s: v for s, v in d.items() if s in (4, 5)} for t, d in got1.items()},
        {t: {s: v for s, v in d.items() if s in (4, 5)} for t, d in first_log.items()},
    )
    assert_same_scalars(got2, {t: {s: v for s, v in d.items() if s >= 6} for t, d in want.items()})


def test_trackio_holds_metrics_jsonl_and_the_config(tmp_path):
    pytest.importorskip("trackio")
    out = tmp_path / "run"
    records = [record(step) for step in range(4)] + [{"step": 3, "eval/accuracy": 0.5}]
    attempt(out, ["trackio"], records, {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")})
    result = json.loads((tmp_path / "readback.json").read_text())
    assert (tmp_path / "trackio" / "opd.db").exists()
    got: dict[str, dict[int, float]] = {}
    for row in result["logs"]:
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                got.setdefault(key, {})[row["step"]] = float(value)
    assert_same_scalars(got, expected_scalars(out))
    config = {k: v for k, v in result["config"].items() if not k.startswith("_")}
    assert config == run_options(out)
