"""A run's task list (``tasks:`` in a config, or ``--tasks FILE``) as one validated config per task.

See :mod:`opd.training.schedule` for what a multi-task run is and how its steps use the tasks. This part
builds configs, so it lives with them; it knows a config's class only by its fields (an OPD run's
config has ``teacher_url``), which keeps it below the classes that call it while validating.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, Self, TypeVar

import yaml

from opd.config.fields import ConfigError, coerce_numbers, option_fields, parse_problem, typed_values

TASK_MODES = ("alternate", "mix")

# How a task's teacher scores, beyond where it is: tasks that agree on all of these (and name the
# same teacher) share one loaded teacher (opd.training.setup.build_tasks).
TEACHER_SCORING = (
    "teacher_dtype",
    "teacher_tokenizer",
    "cross_tokenizer",
    "cross_pairing",
    "cross_unmapped",
    "cross_joinable",
    "teacher_special_map",
)
# Metric namespaces a task name would collide with.
RESERVED = ("train", "rollout", "diag", "depth", "time", "eval", "step", "tasks")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class TaskList(Protocol):
    """The multitask section of a command that trains (train and sft)."""

    @property
    def tasks(self) -> list[Any] | None: ...
    @property
    def task_mode(self) -> str: ...


class Batches(Protocol):
    """The optimizer section of a command that trains: its batch is what a mix run shares out."""

    @property
    def batch_size(self) -> int: ...


class TrainingConfig(Protocol):
    """What this module reads of a command that trains (``TrainConfig`` or ``SFTConfig``, which sit above it)."""

    @property
    def multitask(self) -> TaskList: ...
    @property
    def optimizer(self) -> Batches: ...
    def flat(self) -> dict[str, Any]: ...
    def replace(self, **changes: Any) -> Self: ...


C = TypeVar("C", bound=TrainingConfig)


@dataclass
class TaskSpec(Generic[C]):
    """One task of a run: its name ("" in a single-task run: no prefix anywhere), its share of the
    steps (normalised) and its config (the run's, with its overrides)."""

    name: str
    share: float
    cfg: C  # the run's TrainConfig or SFTConfig, with the task's overrides


def read_task_list(value: Any) -> Any:
    """The ``tasks`` value as a list of entries: given inline, or a YAML/JSON file holding the list
    (``--tasks FILE``: the command line passes it as a one-item list), or one YAML/JSON mapping per
    ``--tasks`` option (``--tasks '{"name": "math", ...}' --tasks '{...}'``: how the experiments
    write a multi-task run's command line)."""
    if isinstance(value, list) and value and all(isinstance(v, str) and v.lstrip().startswith("{") for v in value):
        try:
            return [yaml.safe_load(v) for v in value]
        except yaml.YAMLError as exc:
            raise ConfigError(f"a --tasks mapping is not valid YAML/JSON ({parse_problem(exc)}); fix it there") from exc
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        return value
    p = Path(value)
    if not p.is_file():
        raise ConfigError(f"tasks={value!r}: no such file; give a YAML or JSON file holding the list of tasks")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"tasks file {p} is not valid YAML/JSON ({parse_problem(exc)}); fix it there") from exc
    if isinstance(data, dict) and "tasks" in data:  # a config-style file with a tasks: key
        data = data["tasks"]
    return data


def check_task_list(tasks: Any, mode: str) -> list[dict[str, Any]]:
    """The entries' shape: a non-empty list of mappings with distinct, usable names and positive shares."""
    if mode not in TASK_MODES:
        raise ConfigError(f"task_mode={mode!r}: choose alternate (one task per step) or mix (every task each step)")
    if not isinstance(tasks, list):
        raise ConfigError(f"tasks must be a list of task mappings (or a file holding one), not {type(tasks).__name__}")
    if not tasks:
        raise ConfigError("tasks is empty; list at least one task (name, teacher, task or env), or drop tasks")
    seen: set[str] = set()
    for i, entry in enumerate(tasks):
        if not isinstance(entry, dict):
            raise ConfigError(f"tasks[{i}] is a {type(entry).__name__}; each task is a mapping with a name")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in RESERVED:
            raise ConfigError(
                f"tasks[{i}] has name={name!r}; give each task a name of letters, digits, '_', '-' or '.' "
                f"(not {', '.join(RESERVED)}): it prefixes the task's metrics"
            )
        if name in seen:
            raise ConfigError(f"task {name!r} is listed twice; give each task its own name")
        seen.add(name)
        share = entry.get("share", 1)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
            raise ConfigError(
                f"task {name!r}: share={share!r} must be a positive number (shares are relative weights, normalised)"
            )
    return tasks


def per_task_keys(cfg: TrainingConfig | type) -> tuple[str, ...]:
    """The settings a task of this kind of run may set for itself: the options declared ``per_task``
    (``opt(..., per_task=True)``): its data or environment, its lengths and evaluation size, and (OPD) its
    teacher and sampling, or (SFT) its targets and how many of its examples it learns from."""
    cls = cfg if isinstance(cfg, type) else type(cfg)
    return tuple(f.name for _, f in option_fields(cls) if f.metadata.get("per_task"))


def _is_opd(cfg: TrainingConfig) -> bool:
    """An OPD run's config (its tasks need a teacher, in-process or served), not an SFT run's."""
    return "teacher_url" in _options(cfg)


def _options(cfg: TrainingConfig) -> set[str]:
    return {f.name for _, f in option_fields(type(cfg))}


def _overrides(entry: dict[str, Any], cfg: TrainingConfig, mode: str, share: float) -> dict[str, Any]:
    """The entry's settings as config fields, with the implied ones (see the module docstring)."""
    name, allowed = entry["name"], per_task_keys(cfg)
    given = {k: v for k, v in entry.items() if k not in ("name", "share")}
    for key in given:
        if key not in allowed:
            where = "is a global setting: set it at the top level" if key in _options(cfg) else "is not a setting"
            raise ConfigError(f"task {name!r}: {key!r} {where}; a task may set {', '.join(allowed)}")
    if "lr" in given and mode == "mix" and _is_opd(cfg):
        raise ConfigError(
            f"task {name!r}: its own lr needs --task-mode alternate (a mix step is one optimizer step over "
            "every task); set lr at the top level, or use alternate"
        )
    out = coerce_numbers(type(cfg), typed_values(type(cfg), given, "task list"))
    if _is_opd(cfg) and ("teacher" in given or "teacher_url" in given):
        out.setdefault("teacher", "")
        out.setdefault("teacher_url", "")
        out.setdefault("teacher_tokenizer", "")  # the global teacher's tokenizer is not this teacher's
        out.setdefault("teacher_revision", "")  # nor its revision
        if out["teacher_url"]:
            out.setdefault("teacher_dtype", "")
    if _is_opd(cfg):  # the run keeps checkpoints by its own figures (eval/<task>/...), not a task's view
        out.update(keep_best="", final_best=False)
    if "task" in given:
        out.setdefault("env", "")
    if out.get("eval") is False and "eval_every" in _options(cfg):
        out["eval_every"] = 0  # a task left out of evaluation has no schedule of its own: the run's is the others'
    if mode == "mix" and "batch_size" not in given:
        out["batch_size"] = round(share * cfg.optimizer.batch_size)
        if out["batch_size"] < 1:
            raise ConfigError(
                f"task {name!r} gets no prompts in mix mode (share {share:.3g} of batch_size {cfg.optimizer.batch_size} "
                "rounds to 0); raise its share or batch_size, or give the task its own batch_size"
            )
    return out


def resolve_tasks(cfg: C) -> list[TaskSpec[C]]:
    """Every task of ``cfg`` as a validated config; a single-task run is one task named "".

    An OPD run's task needs a teacher; an SFT run's may name one (its targets are then sampled)."""
    if cfg.multitask.tasks is None:
        return [TaskSpec("", 1.0, cfg)]
    entries = check_task_list(cfg.multitask.tasks, cfg.multitask.task_mode)
    total = sum(float(e.get("share", 1)) for e in entries)
    specs = []
    for entry in entries:
        name, share = entry["name"], float(entry.get("share", 1)) / total
        try:
            changes = _overrides(entry, cfg, cfg.multitask.task_mode, share)
            view = cfg.replace(**{"tasks": None, **changes})
        except (ConfigError, TypeError) as exc:  # _overrides' own errors name the task already
            said = str(exc)
            raise ConfigError(said if said.startswith(f"task {name!r}") else f"task {name!r}: {said}") from None
        flat = view.flat()
        if _is_opd(view) and not (flat["teacher"] or flat["teacher_url"]):
            raise ConfigError(
                f"task {name!r} has no teacher; give it teacher: DIR or teacher_url: URL, or set a global --teacher"
            )
        specs.append(TaskSpec(name, share, view))
    return specs
