"""Experiment trackers (TensorBoard, Weights & Biases, trackio, MLflow), fed by the run directory.

``--report-to tensorboard,wandb,trackio,mlflow`` (one or several; ``none``, the default, turns tracking
off) sends each record of ``metrics.jsonl`` to every named tracker as :class:`opd.runs.rundir.RunDir`
writes it, and the resolved config when the run starts. ``metrics.jsonl`` stays the source of
truth: trackers get copies, and the report and ``opd results`` never read them. Only rank 0
tracks (the RunDir of every other rank is disabled), so a launch of N processes is one run.

What a tracker receives, per record, at the record's ``step``:
- every number as a scalar under its ``metrics.jsonl`` name (booleans as 0/1);
- a list (``depth/reward``, ``depth/loss``: one value per depth bucket, 0 = the start of the
  response) as one scalar per entry: ``depth/reward/0``, ``depth/reward/1``, ...;
- nothing else (text, None).
Samples (:meth:`Tracking.log_samples`: the logged rollouts, by :meth:`opd.runs.rundir.RunDir.log_rollouts`,
as prompt, response, reference answer, verdict, tokens and the sampled-token KL estimate, mean of
log p_student - log p_teacher over the trained tokens) go as a table under their key at their step:
a wandb/trackio Table, a TensorBoard text summary (a markdown table), an MLflow JSON table artifact
(``KEY/step_NNNNNNN.json``). Size-bounded: at most ``MAX_SAMPLE_ROWS`` rows per call and
``MAX_CELL_CHARS`` characters per cell (the rest cut, with a note of how much), so an 8k-token
response costs a tracker kilobytes, not megabytes; rollouts.jsonl keeps the whole.
The config goes to TensorBoard as a text summary (``config``: the options of config.json, flat rather than by section) and as
hparams (lists joined with commas), and to wandb and trackio as the run's config.

Where each writes:
- tensorboard: ``RUN/tensorboard`` (``tensorboard --logdir runs`` shows every run under runs/).
- wandb: ``RUN/wandb``, offline unless an API key is found (``WANDB_API_KEY``, or the
  ``wandb login`` entry in ~/.netrc) or ``WANDB_MODE`` says what to do; upload an offline run
  later with ``wandb sync RUN/wandb/offline-run-*``. Project ``WANDB_PROJECT`` (else ``opd``),
  run name the run directory's name (``WANDB_NAME`` wins), run id kept in ``RUN/tracking.json``.
- mlflow: ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a file store in ``RUN/mlruns``
  (``mlflow ui --backend-store-uri RUN/mlruns``); experiment ``MLFLOW_EXPERIMENT_NAME`` (else ``opd``),
  run name the run directory's name, run id kept in ``RUN/tracking.json``. The config goes as params
  (values cut at MLflow's 6,000 characters).
- trackio: its own local store (``TRACKIO_DIR``, default ~/.cache/huggingface/trackio), so that
  ``trackio show --project opd`` compares runs; project ``opd``, run name
  ``<run directory name>-<6 hex digits>`` kept in ``RUN/tracking.json``.

Resuming (``--resume``): metrics.jsonl drops the records after the checkpoint and the resumed
run logs those steps again. TensorBoard is given a restart marker at the first re-logged step
(``purge_step``), so it drops the interrupted attempt's later points and shows what
metrics.jsonl holds. wandb cannot take a step again (steps must increase) and trackio would
plot both, so the steps the interrupted attempt already sent are not sent to them again: for
those steps they keep the interrupted attempt's values. A tracker first named on resume is
sent the kept records of metrics.jsonl before the run goes on.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import netrc
import os
import re
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import urlparse

from opd.errors import UserError

if TYPE_CHECKING:
    from torch.utils.tensorboard.writer import FileWriter

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")  # each is also its module's and its pip package's name
MAX_SAMPLE_ROWS = 64
MAX_CELL_CHARS = 2000
STATE_FILE = "tracking.json"
TRACKIO_PROJECT = "opd"


def installed(module: str) -> bool:
    if module in sys.modules:  # None there means an import that is blocked (as tests do)
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_installed(names: list[str]) -> None:
    """One line naming the pip command when a named tracker's package is missing."""
    missing = [n for n in names if n in TRACKERS and not installed(n)]
    if missing:
        raise UserError(
            f"--report-to {','.join(missing)} needs {'these packages' if len(missing) > 1 else 'its package'}: "
            f"pip install {' '.join(missing)}"
        )


def scalars(record: dict) -> dict[str, float]:
    """The scalars a tracker gets from one metrics.jsonl record (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, (list, tuple)):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if isinstance(v, (bool, int, float))})
    return out


def bounded(rows: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of at most MAX_SAMPLE_ROWS rows, text cells cut at MAX_CELL_CHARS."""

    def cell(v: Any) -> Any:
        if isinstance(v, (bool, int, float)) or v is None:
            return v
        text = v if isinstance(v, str) else json.dumps(v)
        cut = len(text) - MAX_CELL_CHARS
        return text if cut <= 0 else f"{text[:MAX_CELL_CHARS]}... [{cut} more characters]"

    columns = list(dict.fromkeys(k for r in rows[:MAX_SAMPLE_ROWS] for k in r))
    return columns, [[cell(r.get(c)) for c in columns] for r in rows[:MAX_SAMPLE_ROWS]]


def rollout_rows(records: list[dict]) -> list[dict]:
    """A tracker's row per rollouts.jsonl record: the texts, the verdict, and the sampled-token estimate of
    KL(student || teacher) over the trained tokens (mean of log p_student - log p_teacher)."""
    rows = []
    for r in records:
        pairs = [
            (s, t)
            for s, t, m in zip(
                r.get("student_logprobs") or [], r.get("teacher_logprobs") or [], r.get("loss_mask") or []
            )
            if m and s is not None and t is not None
        ]
        kl = sum(s - t for s, t in pairs) / len(pairs) if pairs else None
        rows.append(
            {
                "prompt": r.get("prompt"),
                "response": r.get("response"),
                "answer": r.get("answer"),
                "correct": r.get("correct"),
                "tokens": len(r.get("tokens") or []),
                "kl": kl,
            }
        )
    return rows


def _markdown(columns: list[str], data: list[list[Any]]) -> str:
    esc = lambda v: "" if v is None else str(v).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(esc(v) for v in row) + " |" for row in data])


# ----------------------------------------------------------------------------- trackers
# Each opens in __init__ (``new``: this run directory had no run of it before), then log(values,
# step), samples(key, columns, rows, step) and close(failed). ``skip_through``: steps up to this one
# are not sent (see resuming).


class TensorBoard:
    def __init__(self, path: Path, config: dict | None, state: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        logdir = path / "tensorboard"
        self.new = not any(logdir.glob("events.out.tfevents.*"))
        self.skip_through = -1
        # A restart marker: TensorBoard drops the earlier points at first_step and after.
        self.writer = SummaryWriter(str(logdir), purge_step=None if self.new else first_step)
        atexit.register(self.writer.close)  # pending events are lost at exit otherwise
        if config is not None:
            self._write_config(config, first_step)

    def _write_config(self, config: dict, step: int) -> None:
        from torch.utils.tensorboard.summary import hparams

        text = json.dumps(config, indent=2, sort_keys=True)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), step)  # a code block
        flat = {
            k: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
            for k, v in config.items()
            if isinstance(v, (bool, int, float, str, list, tuple))
        }
        for summary in hparams(flat, {"eval/accuracy": 0.0, "train/loss": 0.0}):  # metric names only
            cast("FileWriter", self.writer.file_writer).add_summary(summary)

    def log(self, values: dict[str, float], step: int | None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per record (add_scalar makes one per value: 10x slower, 4.5 ms for a training record).
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        cast("FileWriter", self.writer.file_writer).add_summary(summary, step)  # created by SummaryWriter()
        self.writer.flush()  # as durable as metrics.jsonl: a killed run loses no step it logged

    def samples(self, key: str, columns: list[str], data: list[list[Any]], step: int | None) -> None:
        self.writer.add_text(key, _markdown(columns, data), step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()
        atexit.unregister(self.writer.close)


def _wandb_credentials() -> bool:
    """An API key wandb would find: the environment, or the ``wandb login`` entry in the netrc file."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        # No hostname: "" finds no machine entry, as None did (only a default entry)
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Wandb:
    def __init__(self, path: Path, config: dict | None, state: dict, first_step: int):
        import wandb

        self.new = "wandb_id" not in state
        state.setdefault("wandb_id", os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:8])
        mode: Literal["offline"] | None = None  # wandb's own choice: WANDB_MODE, else online
        if not os.environ.get("WANDB_MODE") and not _wandb_credentials():
            mode = "offline"
            print(
                f"wandb: no API key found, logging offline to {path / 'wandb'} "
                f"(upload with: wandb sync {path / 'wandb'}/offline-run-*)",
                file=sys.stderr,
            )
        self.skip_through = -1
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "opd",
            name=os.environ.get("WANDB_NAME") or path.name,
            id=state["wandb_id"],
            resume="allow",
            dir=str(path),
            config=config or {},
            allow_val_change=True,
            mode=mode,
        )

    def log(self, values: dict[str, float], step: int | None) -> None:
        self.run.log(values, step=step)

    def samples(self, key: str, columns: list[str], data: list[list[Any]], step: int | None) -> None:
        import wandb

        self.run.log({key: wandb.Table(columns=list[str | int](columns), data=data)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackio:
    def __init__(self, path: Path, config: dict | None, state: dict, first_step: int):
        import trackio

        self.new = "trackio_run" not in state
        state.setdefault("trackio_run", f"{path.name}-{uuid.uuid4().hex[:6]}")  # unique: resume="allow" joins by name
        self.skip_through = -1
        self.run = trackio.init(project=TRACKIO_PROJECT, name=state["trackio_run"], config=config or {}, resume="allow")

    def log(self, values: dict[str, float], step: int | None) -> None:
        self.run.log(values, step=step)

    def samples(self, key: str, columns: list[str], data: list[list[Any]], step: int | None) -> None:
        import trackio

        self.run.log({key: trackio.Table(columns=columns, data=data, allow_mixed_types=True)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish()


class MLflow:
    """Through ``MlflowClient`` with an explicit run id: no process-wide active run to leak between runs."""

    def __init__(self, path: Path, config: dict | None, state: dict, first_step: int):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store only on request; a run folder's own store needs no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (path / "mlruns").absolute().as_uri()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.new = "mlflow_run_id" not in state
        self.skip_through = -1
        if self.new:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "opd"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            state["mlflow_run_id"] = self.client.create_run(experiment, run_name=path.name).info.run_id
        else:
            self.client.update_run(state["mlflow_run_id"], status="RUNNING")
        self.run_id = state["mlflow_run_id"]
        if config is not None and self.new:
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in sorted(config.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, values: dict[str, float], step: int | None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(re.sub(r"[^\w\-. /]", "_", k), v, now, step or 0) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def samples(self, key: str, columns: list[str], data: list[list[Any]], step: int | None) -> None:
        table = {c: [row[i] for row in data] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, table, f"{key}/step_{step or 0:07d}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


OPEN: dict[str, type[TensorBoard | Wandb | Trackio | MLflow]] = {
    "tensorboard": TensorBoard,
    "wandb": Wandb,
    "trackio": Trackio,
    "mlflow": MLflow,
}


# ----------------------------------------------------------------------------- one run directory's trackers


class Tracking:
    """The trackers of one run directory (rank 0 only), fed by :class:`opd.runs.rundir.RunDir`:
    ``resumed`` when it truncates its logs, ``start`` when it writes the config, ``log`` per record."""

    def __init__(self, path: Path, names: list[str]):
        self.path, self.names = Path(path), [n for n in names if n in TRACKERS]
        self.trackers: dict[str, Any] = {}
        self.started = self.closed = False
        self.first_step = 0  # the first step this attempt logs
        self.last_sent = -1  # the last step the interrupted attempt logged

    def resumed(self, ckpt_step: int, last_logged: int) -> None:
        self.first_step, self.last_sent = ckpt_step + 1, last_logged

    def start(self, config: dict | None) -> None:
        if self.started:
            return
        self.started = True
        state_path = self.path / STATE_FILE
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        before = dict(state)
        for name in self.names:
            self.trackers[name] = tracker = OPEN[name](self.path, config, state, self.first_step)
            if not tracker.new and name != "tensorboard":
                tracker.skip_through = self.last_sent
        if state != before:
            tmp = state_path.with_name(f".{STATE_FILE}.tmp")
            tmp.write_text(json.dumps(state, indent=2) + "\n")
            os.replace(tmp, state_path)
        history = self._kept_records() if any(t.new for t in self.trackers.values()) else []
        for record in history:  # a tracker new to a resumed run gets what metrics.jsonl already holds
            for tracker in self.trackers.values():
                if tracker.new:
                    tracker.log(scalars(record), record.get("step"))

    def _kept_records(self) -> list[dict]:
        p = self.path / "metrics.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []

    def log(self, record: dict) -> None:
        if self.closed:
            return
        self.start(None)
        values, step = scalars(record), record.get("step")
        for tracker in self.trackers.values():
            if step is None or step > tracker.skip_through:
                tracker.log(values, step)

    def log_samples(self, key: str, rows: list[dict], step: int | None) -> None:
        """Rows of text and figures (rollouts, evaluation samples) as a table under ``key`` at ``step``,
        size-bounded (see the module docstring); a resumed run's re-logged steps are skipped as for metrics."""
        if self.closed or not rows:
            return
        self.start(None)
        columns, data = bounded(rows)
        for tracker in self.trackers.values():
            if step is None or step > tracker.skip_through:
                tracker.samples(key, columns, data, step)

    def close(self, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for tracker in self.trackers.values():
            tracker.close(failed)
