"""The run directory: config.json, metrics.jsonl, rollouts.jsonl, checkpoints, final model.

Everything a run leaves behind is written here, and readers (the report, ``opd eval``) read only
these files. Checkpoints are written to a temporary directory and renamed into place, and the
``latest`` pointer is replaced atomically, so a run killed at any moment leaves either the old or
the new checkpoint, never half of one. Only rank 0 writes (``enabled=False`` elsewhere).

Experiment trackers (``--report-to``, :mod:`opd.runs.tracking`) are fed from here: they start when the
config is written, get each metrics record as it is logged, and stop at :meth:`RunDir.close`
(or at the end of a ``with RunDir(...)`` block).

A run folder says it is opd's: :data:`MARKER` (``opd-run.json``, the command that made it: train, sft or
eval) is its first file. :func:`claim` checks ``--out`` before any work: a command writes only into a new or
empty folder or a run of its own (train resumes only its own run with a checkpoint). Folders written before
the marker existed are recognised by their layout (:func:`run_owner`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from opd.config import CommandConfig, check_report_to, config_record, dump_config
from opd.errors import UserError
from opd.runs.progress import is_main_process
from opd.runs.quiet import quiet_transformers
from opd.runs.tracking import Tracking, check_installed, rollout_rows

CKPT_DIR = "checkpoints"
MARKER = "opd-run.json"  # written first: the command whose run this folder holds
STARTED = "STARTED.json"  # opd experiment's record of how it began a train run (opd.lab.experiments.core)
SCORE_FILE = "score.json"  # a checkpoint's evaluation figure under --keep-best


def _usual_modes(path: Path) -> None:
    """Give ``path`` (and a directory's contents) the modes a plain write would have.

    mkstemp/mkdtemp (and safetensors) create private 0600/0700 entries; renamed into place they
    would keep them, leaving run files and models unreadable to other users of a shared machine.
    """
    umask = os.umask(0)
    os.umask(umask)
    entries = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in entries:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _usual_modes(Path(tmp))
    os.replace(tmp, path)


class RunDir:
    """``command`` (train, sft, eval): the folder is claimed for it (:func:`claim`, with ``resume`` and the
    ``models`` the command reads) before anything is written; None: a plain handle on the folder."""

    def __init__(
        self,
        path: str | Path,
        enabled: bool | None = None,
        report_to: Iterable[str] | str = (),
        command: str | None = None,
        resume: bool = False,
        models: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.enabled = is_main_process() if enabled is None else enabled
        trackers = [n for n in check_report_to(report_to) if n != "none"] if report_to else []
        check_installed(trackers)  # on every rank, so that all of them stop alike, before any work
        if self.enabled and command is not None:
            claim(self.path, command, resume, models or {})
        self.tracking = Tracking(self.path, trackers) if self.enabled and trackers else None
        if self.enabled:
            self.path.mkdir(parents=True, exist_ok=True)

    def close(self, failed: bool = False) -> None:
        """Stop the trackers (flushes TensorBoard; ``failed`` marks a wandb run as failed). Idempotent."""
        if self.tracking is not None:
            self.tracking.close(failed)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    # ------------------------------------------------------------------ logs
    def write_config(self, cfg: CommandConfig) -> None:
        if self.enabled:
            dump_config(cfg, self.path / "config.json")
            if self.tracking is not None:
                self.tracking.start(config_record(cfg))

    def _append(self, name: str, records: Iterable[dict]) -> None:
        if not self.enabled:
            return
        with open(self.path / name, "a") as f:
            for r in records:
                f.write(json.dumps(r, allow_nan=True) + "\n")

    def log_metrics(self, record: dict) -> None:
        if self.tracking is not None:
            self.tracking.start(None)  # no-op once write_config started it; before the append, so no replay of it
        self._append("metrics.jsonl", [record])
        if self.tracking is not None:
            self.tracking.log(record)

    def log_rollouts(self, records: list[dict]) -> None:
        self._append("rollouts.jsonl", records)
        if self.tracking is not None and records:  # the trackers' table of them (opd.runs.tracking)
            self.tracking.log_samples("rollouts", rollout_rows(records), records[0].get("step"))

    def log_samples(self, key: str, rows: list[dict], step: int | None) -> None:
        """Rows (an evaluation's samples) to the trackers as a table; the caller writes its own file."""
        if self.tracking is not None:
            self.tracking.log_samples(key, rows, step)

    def write_json(self, name: str, data: Any) -> None:
        if self.enabled:
            _atomic_write_text(self.path / name, json.dumps(data, indent=2) + "\n")

    def write_jsonl(self, name: str, records: Iterable[dict]) -> None:
        if self.enabled:
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)  # a task's own files: tasks/<name>/
            _atomic_write_text(self.path / name, "".join(json.dumps(r) + "\n" for r in records))

    def truncate_logs_after(self, step: int) -> None:
        """Drop log lines of steps after ``step`` (a resumed run rewrites them)."""
        if not self.enabled:
            return
        last_logged = step
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            p = self.path / name
            if not p.exists():
                continue
            kept = []
            for line in p.read_text().splitlines():
                try:
                    line_step = json.loads(line).get("step", -1)
                except json.JSONDecodeError:
                    continue  # a line cut short by the kill
                if line_step <= step:
                    kept.append(line)
                elif name == "metrics.jsonl":
                    last_logged = max(last_logged, line_step)
            _atomic_write_text(p, "".join(line + "\n" for line in kept))
        if self.tracking is not None:
            self.tracking.resumed(step, last_logged)

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_root(self) -> Path:
        return self.path / CKPT_DIR

    def save_checkpoint(
        self,
        step: int,
        model,
        state: dict,
        keep: int = 2,
        model_state: dict | None = None,
        score: float | None = None,
        best: tuple[str, str] | None = None,
    ) -> Path | None:
        """Atomically write ``model`` (save_pretrained; ``model_state`` replaces its own state dict, e.g.
        the gathered weights of an FSDP-sharded model) and ``state`` (optimizer, RNG, ...), then keep the
        ``keep`` newest checkpoints and, with ``best`` (metric, "max" or "min"), the best ``score``d one."""
        if not self.enabled:
            return None
        root = self.ckpt_root
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step_{step:07d}"
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        with quiet_transformers():
            model.save_pretrained(tmp / "model", safe_serialization=True, state_dict=model_state)
        torch.save(state, tmp / "state.pt")
        if score is not None and best is not None:  # inside the checkpoint: written with it, atomically
            (tmp / SCORE_FILE).write_text(json.dumps({"metric": best[0], "value": score, "step": step}) + "\n")
        (tmp / "COMPLETE").write_text(str(step))
        _usual_modes(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(root / "latest", final.name)
        kept = set(sorted(root.glob("step_*"))[-keep:])
        winner = self._best_of(root, best) if best is not None else None
        if winner is not None:
            kept.add(winner)
            _atomic_write_text(root / "best", winner.name)
        for old in root.glob("step_*"):
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def _best_of(root: Path, best: tuple[str, str]) -> Path | None:
        """The checkpoint with the best score of ``best[0]`` (the earliest of a tie), or None."""
        metric, mode = best
        winner, top = None, None
        for ckpt in sorted(root.glob("step_*")):
            try:
                record = json.loads((ckpt / SCORE_FILE).read_text())
            except (OSError, ValueError):
                continue  # unscored (a --ckpt-every checkpoint between evaluations)
            value = record.get("value")
            if record.get("metric") != metric or not isinstance(value, (int, float)) or value != value:
                continue
            if top is None or (value > top if mode == "max" else value < top):
                winner, top = ckpt, value
        return winner

    def best_checkpoint(self) -> dict | None:
        """The best checkpoint's path and score (``checkpoints/best``), or None when there is none."""
        pointer = self.ckpt_root / "best"
        if not pointer.exists():
            return None
        ckpt = self.ckpt_root / pointer.read_text().strip()
        if not (ckpt / SCORE_FILE).is_file():  # pruned (a resume that changed --keep-best): no best kept yet
            return None
        score = json.loads((ckpt / SCORE_FILE).read_text())
        return {"path": str(ckpt), "model": str(ckpt / "model"), **score}

    def latest_checkpoint(self) -> Path | None:
        pointer = self.ckpt_root / "latest"
        if not pointer.exists():
            return None
        ckpt = self.ckpt_root / pointer.read_text().strip()
        if not (ckpt / "COMPLETE").exists() or not (ckpt / "state.pt").exists():
            raise UserError(
                f"checkpoint {ckpt} is incomplete or missing; delete {pointer} to start over, or point it at an "
                "earlier step_* directory to resume from there"
            )
        return ckpt

    def load_state(self, ckpt: Path) -> dict:
        try:
            # on the CPU whatever device wrote it: load_state_dict moves optimizer state to its parameters
            return torch.load(ckpt / "state.pt", weights_only=False, map_location="cpu")
        except Exception as exc:  # torch raises several types for a damaged file
            raise UserError(
                f"checkpoint {ckpt / 'state.pt'} is corrupted ({type(exc).__name__}: {exc}); delete {ckpt} and "
                f"update {self.ckpt_root / 'latest'} to an earlier checkpoint, or start a fresh run directory"
            ) from exc


def save_final_model(
    path: Path,
    model,
    tokenizer,
    enabled: bool = True,
    model_state: dict | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a Hugging Face model directory loadable with AutoModelForCausalLM/AutoTokenizer (a LoRA
    student writes its adapter: see :mod:`opd.models.lora`). ``dtype``: the floating-point weights are
    written in it, and config.json says so (a mixed-precision run's float32 masters saved in its --dtype)."""
    if not enabled:
        return
    if dtype is not None:
        state = model.state_dict() if model_state is None else model_state
        # one cast per tensor: a tied head stays one tensor under two names, which save_pretrained writes once
        same = lambda v: (v.device, v.data_ptr(), v.shape, v.stride())  # state_dict detaches each name anew
        cast = {same(v): v.to(dtype) if v.is_floating_point() else v for v in state.values()}
        model_state = {k: cast[same(v)] for k, v in state.items()}
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    with quiet_transformers():
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
        tokenizer.save_pretrained(tmp)
    if dtype is not None:  # save_pretrained records the dtype of the model's parameters, not of what it wrote
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _usual_modes(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- ownership of --out


def mark_run(path: Path, command: str, by: str = "") -> None:
    """Write ``path``'s marker: the folder holds a run of opd ``command`` (``by``: what ran it, e.g. experiment)."""
    record = {"command": command, **({"by": by} if by else {})}
    path.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(path / MARKER, json.dumps(record) + "\n")


def run_owner(path: Path) -> str | None:
    """The command whose run ``path`` holds (train, sft, eval), or None for a folder that is not an opd run.
    The marker says so; a folder written before it existed is known by its layout: a config.json with a
    train or sft config beside its metrics.jsonl or checkpoints, an eval.json alone, or an experiment's
    STARTED.json (a train run it began)."""
    marker = path / MARKER
    if marker.is_file():
        try:
            command = json.loads(marker.read_text())["command"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return command if isinstance(command, str) else None
    config = path / "config.json"
    if config.is_file() and ((path / "metrics.jsonl").is_file() or (path / CKPT_DIR).is_dir()):
        keys = _config_keys(config)
        if "objective" in keys:  # TrainConfig's, not SFTConfig's
            return "train"
        if "arch" in keys or "patience" in keys:  # SFTConfig's, not TrainConfig's
            return "sft"
    if (path / "eval.json").is_file() and not config.exists() and not (path / "metrics.jsonl").exists():
        return "eval"
    if (path / STARTED).is_file():
        return "train"
    return None


def _config_keys(config: Path) -> set[str]:
    """The option names of a run's config.json, nested by section or flat (runs written before sections)."""
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict):
        return set()
    return set(data) | {k for v in data.values() if isinstance(v, dict) for k in v}


def _listing(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def claim(path: Path, command: str, resume: bool = False, models: dict[str, str] | None = None) -> None:
    """Before any work, make ``path`` the run folder of opd ``command`` and write its marker, or raise
    UserError saying what is there: a file, a model the command reads (``models``: option -> directory), a
    folder that is not an opd run, another command's run, a run of its own it would overwrite; with
    ``resume`` (train), anything but a run of its own with a checkpoint (one stopped before its first
    checkpoint starts over, said so). The marker's write is the check that the folder is writable."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {path} is a file; --out must be a folder (a new one, or a run of opd {command})")
    for option, model in (models or {}).items():
        if model and path.is_dir() and Path(model).is_dir() and path.resolve() == Path(model).resolve():
            raise UserError(
                f"--out {path} is the model given as --{option}; the run would overwrite its files: choose another --out"
            )
    found = path.is_dir() and any(path.iterdir())
    owner = run_owner(path) if found else None
    if resume:
        _check_resumable(path, command, owner, found)
    elif found and owner is None:
        raise UserError(
            f"--out {path} is not an opd run folder (it holds {_listing(path)}); choose a new or empty folder"
        )
    if owner is not None and owner != command:
        raise UserError(f"--out {path} holds an opd {owner} run; opd {command} writes its own: choose another --out")
    if not resume and owner == command and (path / "metrics.jsonl").exists():
        fix = (
            "pass --resume to continue it, or choose a new --out (or delete that folder) to start over"
            if command == "train"
            else f"opd {command} has no --resume: choose a new --out (or delete that folder) to start over"
        )
        raise UserError(f"{path} already holds a run of opd {command} (metrics.jsonl); {fix}")
    try:
        mark_run(path, command)
    except OSError as exc:
        raise UserError(f"cannot write in --out {path} ({exc.strerror}); choose a folder you can write to") from None


def _check_resumable(path: Path, command: str, owner: str | None, found: bool) -> None:
    """``--resume`` continues a run of ``command`` from its checkpoint; anything else is named."""
    if not path.is_dir():
        raise UserError(
            f"--resume: {path} does not exist, so there is no run to resume; check --out, or drop --resume to start "
            "a new run there"
        )
    if not found:
        raise UserError(f"--resume: {path} is empty, so there is no run to resume; drop --resume to start one there")
    if owner is None:
        raise UserError(
            f"--resume: {path} is not an opd run folder (it holds {_listing(path)}); point --out at an opd "
            f"{command} run, or choose a new folder without --resume"
        )
    if owner != command:
        raise UserError(
            f"--resume: {path} holds an opd {owner} run, not an opd {command} run; resume a {command} run, or "
            "choose a new --out without --resume"
        )
    if (path / CKPT_DIR / "latest").is_file():
        return
    if (path / "final").exists() or (path / "summary.json").exists():
        raise UserError(
            f"--resume: {path} holds a finished opd {command} run without checkpoints (no {CKPT_DIR}/latest), so "
            "there is nothing to resume; choose a new --out to train again"
        )
    print(f"opd {command}: note: {path} has no checkpoint yet (the run stopped before its first); starting it over")
