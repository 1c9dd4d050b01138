"""Completions in the trackers: the logged rollouts as a size-bounded table in TensorBoard, MLflow (its
local file store), wandb (offline) and trackio, at their step; a missing package names its install line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd.config import TrainConfig
from opd.errors import UserError
from opd.runs import tracking
from opd.runs.rundir import RunDir

LONG = "x" * (tracking.MAX_CELL_CHARS + 500)


def _records(step: int, n: int = 3) -> list[dict]:
    return [
        {
            "step": step,
            "prompt": f"What is {i} + 1?",
            "answer": str(i + 1),
            "response": LONG if i == 0 else f"{i + 1}",
            "correct": i != 0,
            "tokens": ["a", "b", "c"],
            "loss_mask": [1, 1, 0],
            "student_logprobs": [-1.0, -2.0, -9.0],
            "teacher_logprobs": [-1.5, -1.0, -0.1],
        }
        for i in range(n)
    ]


def test_rollout_rows_hold_the_texts_the_verdict_and_the_sampled_kl():
    (row, *_) = tracking.rollout_rows(_records(0))
    # mean over the two trained tokens of log p_s - log p_t: ((-1 + 1.5) + (-2 + 1)) / 2, by hand
    assert row["kl"] == pytest.approx(-0.25) and row["tokens"] == 3 and row["correct"] is False
    columns, data = tracking.bounded(tracking.rollout_rows(_records(0, n=tracking.MAX_SAMPLE_ROWS + 5)))
    assert len(data) == tracking.MAX_SAMPLE_ROWS
    cell = data[0][columns.index("response")]
    assert cell.startswith("x" * tracking.MAX_CELL_CHARS) and cell.endswith("... [500 more characters]")


def test_tensorboard_gets_the_rollouts_as_a_text_table_at_their_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path / "run", enabled=True, report_to=["tensorboard"])
    run.write_config(TrainConfig.from_flat(out=str(tmp_path / "run")))
    run.log_rollouts(_records(7))
    run.close()
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("rollouts/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 7 and "| prompt | response | answer | correct | tokens | kl |" in text
    assert "| What is 2 + 1? | 3 | 3 | True | 3 | -0.25 |" in text and "[500 more characters]" in text


def test_mlflow_file_store_holds_the_metrics_the_config_and_the_rollout_table(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    run = RunDir(out, enabled=True, report_to=["mlflow"])
    run.write_config(TrainConfig.from_flat(out=str(out), lr=2e-3, report_to=["mlflow"]))
    run.log_metrics({"step": 0, "train/loss": 1.5, "eval/pass@k": 0.25})
    run.log_rollouts(_records(0))
    run.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").absolute().as_uri())
    run_id = json.loads((out / "tracking.json").read_text())["mlflow_run_id"]
    got = client.get_run(run_id)
    assert got.data.metrics == {"train/loss": 1.5, "eval/pass_k": 0.25} and got.data.params["lr"] == "0.002"
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    table = json.loads(Path(client.download_artifacts(run_id, "rollouts/step_0000000.json", str(tmp_path))).read_text())
    assert table["columns"][:3] == ["prompt", "response", "answer"] and len(table["data"]) == 3


def test_a_missing_mlflow_names_its_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match=r"^--report-to mlflow needs its package: pip install mlflow$"):
        RunDir(tmp_path / "run", enabled=True, report_to=["mlflow"])


ATTEMPT = """
import json, sys
from opd.config import TrainConfig
from opd.runs.rundir import RunDir
a = json.loads(sys.argv[1])
run = RunDir(a["out"], enabled=True, report_to=a["report_to"])
run.write_config(TrainConfig.from_flat(out=a["out"], report_to=a["report_to"]))
run.log_metrics({"step": 3, "train/loss": 1.0})
run.log_rollouts(a["records"])
run.close()
if a["report_to"] == ["trackio"]:
    from pathlib import Path
    from trackio.sqlite_storage import SQLiteStorage
    name = json.loads((Path(a["out"]) / "tracking.json").read_text())["trackio_run"]
    print("LOGS " + json.dumps(SQLiteStorage.get_logs("opd", name), default=str))
"""


def _attempt(out: Path, tracker: str, env: dict) -> str:
    args = json.dumps({"out": str(out), "report_to": [tracker], "records": _records(3)})
    proc = subprocess.run(
        [sys.executable, "-c", ATTEMPT, args],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_wandb_offline_and_trackio_get_the_rollout_table(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "w"
    _attempt(out, "wandb", {"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    (table,) = (out / "wandb").glob("offline-run-*/files/media/table/rollouts_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"][:3] == ["prompt", "response", "answer"] and data["data"][1][:3] == [
        "What is 1 + 1?",
        "2",
        "2",
    ]
    pytest.importorskip("trackio")
    stdout = _attempt(tmp_path / "t", "trackio", {"TRACKIO_DIR": str(tmp_path / "trackio")})
    (line,) = [line for line in stdout.splitlines() if line.startswith("LOGS ")]
    logs = json.loads(line[len("LOGS ") :])
    tables = [entry["rollouts"] for entry in logs if "rollouts" in entry]
    assert len(tables) == 1 and "What is 1 + 1?" in json.dumps(tables[0])
